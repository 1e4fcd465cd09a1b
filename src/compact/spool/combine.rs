//! Combining a key's changes of a spool round into its net change (see
//! the [spool's](super) opening comment), and the prediction that tells
//! when combining no longer pays.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::lakehouse::change::{ChangeOp, TypedChange};
use crate::lakehouse::typing::Cell;

/// Changes of a round after which its repeats so far may already show that
/// combining will not pay by the round's end (see [`combining_may_pay`]).
pub(super) const EARLY_CHANGES: u64 = 65_536;

/// Whether combining a table's changes is likely to save at least a quarter
/// of a round of `round` changes, having saved `combined` of its first
/// `seen`.
///
/// The number of keys is estimated as if each change picked one at random:
/// `seen` picks that found `seen - combined` distinct keys, of `k` keys,
/// expect `k (1 - e^(-seen/k))`; solved for `k`, the same formula gives the
/// share of repeats over the whole round. Keys with a hot set repeat more
/// early on than later, so for them the prediction errs on the side of
/// combining, and the round's end decides as before.
pub(super) fn combining_may_pay(seen: u64, combined: u64, round: u64) -> bool {
    if round <= seen {
        return combined * 4 >= seen;
    }
    let (n, d) = (seen as f64, (seen - combined.min(seen)) as f64);
    let distinct = |k: f64, picks: f64| k * -(-picks / k).exp_m1();
    // `distinct` grows with `k`: halve the range until it finds `d`.
    let (mut lo, mut hi) = (d.max(1.0), d.max(1.0) * 1e9);
    for _ in 0..200 {
        let mid = (lo + hi) / 2.0;
        if distinct(mid, n) < d {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let share = 1.0 - distinct(hi, round as f64) / round as f64;
    share * 4.0 >= 1.0
}

/// A combined change, found by its key (never `None` here).
pub(super) struct Pending(pub(super) Arc<TypedChange>);

impl Pending {
    pub(super) fn key(&self) -> &str {
        self.0.key.as_deref().unwrap_or_default()
    }
}

impl Borrow<str> for Pending {
    fn borrow(&self) -> &str {
        self.key()
    }
}

impl Hash for Pending {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl PartialEq for Pending {
    fn eq(&self, other: &Pending) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Pending {}

/// The one change that stands for `before` followed by `after` (an upsert
/// or a delete of the same key, neither moving a row between keys) when the
/// merge replays it: `after`, except that the columns an upsert left out
/// (unchanged TOAST) take `before`'s values, which may themselves be left
/// out (to be carried from the view), or null after a delete (there is no
/// row to carry them from, as the merge would find).
pub(super) fn combine(before: &TypedChange, after: &Arc<TypedChange>) -> Arc<TypedChange> {
    if after.op != ChangeOp::Upsert || !after.cells.contains(&Cell::Absent) {
        return Arc::clone(after);
    }
    let cells = after
        .cells
        .iter()
        .zip(&before.cells)
        .map(|(now, was)| match (now, before.op) {
            (Cell::Absent, ChangeOp::Upsert) => was.clone(),
            (Cell::Absent, _) => Cell::Null,
            (now, _) => now.clone(),
        })
        .collect();
    Arc::new(TypedChange {
        op_name: after.op_name,
        op: after.op,
        seq: after.seq,
        lsn: after.lsn.clone(),
        key: after.key.clone(),
        old_key: after.old_key.clone(),
        cells,
        // The spool keeps neither: only the history writes them.
        old: None,
        unchanged: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A uniform million keys: 3% repeats after 65,536 changes, 16% by the
    /// end of a round of 353,381 (the benchmark's first): stop. 200,000
    /// keys: 15%, then 50%: go on, as the round's end would decide.
    #[test]
    fn the_share_a_round_would_combine_is_predicted_from_its_start() {
        let seen = EARLY_CHANGES;
        // What `seen` uniform picks among `keys` repeat, about.
        let repeats = |keys: f64| {
            let distinct = keys * -(-(seen as f64) / keys).exp_m1();
            (seen as f64 - distinct) as u64
        };
        assert!(!combining_may_pay(seen, repeats(1e6), 353_381));
        assert!(combining_may_pay(seen, repeats(2e5), 353_381));
        // No repeat at all, or only repeats.
        assert!(!combining_may_pay(seen, 0, 353_381));
        assert!(combining_may_pay(seen, seen - 1, 353_381));
        // A round no longer than what was seen: what was seen decides.
        assert!(combining_may_pay(seen, seen / 4, seen));
        assert!(!combining_may_pay(seen, seen / 4 - 1, seen));
    }
}
