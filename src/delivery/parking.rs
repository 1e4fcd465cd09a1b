//! The parking lot: batches that failed every attempt (*parked*), the later
//! batches on their rows (*held* behind them), and the order they leave in.
//!
//! The local state keeps the lot's contents (see
//! [`crate::checkpoint::Parked`]), so a restart or another process
//! (`waltail parked replay`) sees the same lot. [`ParkingLot`] is the
//! running pipeline's view of it: which rows a new batch must not pass, and
//! which parked-table batches are cleared to leave now. It does no I/O; the
//! pipeline stores and removes batches and hands the lot what the state
//! holds.
//!
//! The rule that keeps per-row order is [`releasable`]: a held batch leaves
//! only when no batch before it on one of its rows (or truncating one of its
//! tables) still waits.

use std::collections::{HashSet, VecDeque};

use crate::batch::Batch;
use crate::checkpoint::{ParkStatus, Parked};
use crate::row_identity::Holds;

/// The batches of `parked` (seq order) that may be delivered now: replay
/// requests, and held batches none of whose rows (or truncated tables, see
/// [`Holds`]) belongs to a batch still parked or being replayed, or to an
/// earlier held batch that must still wait. Per-row order is kept because a
/// held batch leaves only when every earlier batch on its rows is written.
pub(crate) fn releasable(parked: &[Parked]) -> Vec<u64> {
    let mut blocked = Holds::default();
    for p in parked.iter().filter(|p| p.status != ParkStatus::Held) {
        blocked.add(&p.rows, p.table_hashes());
    }
    let mut out = Vec::new();
    for p in parked {
        match p.status {
            ParkStatus::Parked => {}
            ParkStatus::Replay => out.push(p.first_seq),
            ParkStatus::Held => {
                let tables = p.table_hashes();
                if blocked.conflicts(&p.rows, tables.iter().copied()) {
                    blocked.add(&p.rows, tables);
                } else {
                    out.push(p.first_seq);
                }
            }
        }
    }
    out
}

/// The running pipeline's view of the parking lot.
#[derive(Debug, Default)]
pub(crate) struct ParkingLot {
    /// Rows and tables of parked and held batches: a new batch touching one
    /// is held behind them.
    blocked: Holds,
    /// Parked-table batches cleared to leave, in seq order, not started yet.
    released: VecDeque<Batch>,
    /// First seqs of the parked-table batches released and not settled
    /// (queued or in flight), so a second look at the state does not send
    /// one twice.
    releasing: HashSet<u64>,
}

impl ParkingLot {
    /// Whether `batch` touches a row (or a table truncated) of a parked or
    /// held batch: it must be held behind them instead of sent.
    pub(crate) fn blocks(&self, batch: &Batch) -> bool {
        self.blocked.conflicts(&batch.rows, batch.table_hashes())
    }

    /// A new batch was parked or held (and stored): later batches on its
    /// rows wait behind it.
    pub(crate) fn parked(&mut self, batch: &Batch) {
        self.blocked.add(&batch.rows, batch.table_hashes());
    }

    /// Takes the lot as the state holds it now (seq order): the blocked
    /// rows are those of `parked`, and the batches [`releasable`] now are
    /// queued to leave, each once until it is [`settled`](Self::settled).
    pub(crate) fn reload(&mut self, parked: Vec<Parked>) {
        self.blocked.clear();
        for p in &parked {
            self.blocked.add(&p.rows, p.table_hashes());
        }
        let ready: HashSet<u64> = releasable(&parked).into_iter().collect();
        for p in parked {
            if !ready.contains(&p.first_seq) || !self.releasing.insert(p.first_seq) {
                continue;
            }
            tracing::info!(id = p.first_seq, key = %p.key, status = p.status.as_str(), "delivering a parked-table batch");
            let tables = p.tables();
            self.released.push_back(Batch {
                first_seq: p.first_seq,
                last_seq: p.last_seq,
                commit_ts: 0,
                body: p.body,
                rows: p.rows.iter().copied().collect(),
                tables,
                recorded: true,
                from_parked: true,
                key: p.key,
                // Its key and stored bytes are already encoded.
                codec: None,
            });
        }
    }

    /// The next released batch to start, if any.
    pub(crate) fn next(&self) -> Option<&Batch> {
        self.released.front()
    }

    /// Takes the batch [`next`](Self::next) showed, to start it.
    pub(crate) fn take(&mut self) -> Option<Batch> {
        self.released.pop_front()
    }

    /// A released batch was written, or failed again (and was parked
    /// again): a later reload may release it anew.
    pub(crate) fn settled(&mut self, first_seq: u64) {
        self.releasing.remove(&first_seq);
    }

    /// Stopping: released batches not started stay in the state for the
    /// next start.
    pub(crate) fn stop(&mut self) {
        for b in self.released.drain(..) {
            self.releasing.remove(&b.first_seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::archive::envelope::TableRef;
    use crate::checkpoint::parked::tests::parked;

    fn batch(first_seq: u64, rows: &[u64], table: &str) -> Batch {
        Batch {
            first_seq,
            last_seq: first_seq,
            commit_ts: 0,
            body: Vec::new(),
            rows: rows.iter().copied().collect(),
            tables: vec![Arc::new(TableRef::from_name(table.into()))],
            recorded: false,
            from_parked: false,
            key: String::new(),
            codec: None,
        }
    }

    fn released(lot: &mut ParkingLot) -> Vec<u64> {
        std::iter::from_fn(|| lot.take())
            .map(|b| b.first_seq)
            .collect()
    }

    #[test]
    fn held_batches_leave_only_when_nothing_before_them_on_their_rows_waits() {
        let all = vec![
            parked(1, &[1], ParkStatus::Parked),
            parked(11, &[2], ParkStatus::Replay),
            parked(21, &[1, 3], ParkStatus::Held), // behind parked row 1
            parked(31, &[3], ParkStatus::Held),    // behind the held batch on row 3
            parked(41, &[2], ParkStatus::Held),    // behind a batch being replayed: waits for it
            parked(51, &[4], ParkStatus::Held),
        ];
        assert_eq!(releasable(&all), vec![11, 51]);
    }

    /// A new batch on a parked row waits; one on other rows of the same
    /// table passes; a truncate of the parked batch's table waits.
    #[test]
    fn a_batch_on_a_parked_row_or_table_is_blocked() {
        let mut lot = ParkingLot::default();
        let first = batch(1, &[7, 8], "public.t");
        assert!(!lot.blocks(&first));
        lot.parked(&first);
        assert!(lot.blocks(&batch(2, &[8], "public.t")));
        assert!(!lot.blocks(&batch(3, &[9], "public.t")));
        let mut truncate = batch(4, &[], "public.t");
        // A truncate's row is its table's identity.
        truncate.rows = crate::batch::RowHashSet::from_iter([truncate.tables[0].hash]);
        assert!(
            lot.blocks(&truncate),
            "a truncate of the table of a parked batch"
        );
        assert!(!lot.blocks(&batch(5, &[70], "public.other")));
    }

    /// A reload queues what may leave, in seq order, once: a second look at
    /// the same state does not send it again while it is on its way; once
    /// it is settled (failed again) the next reload may release it anew.
    #[test]
    fn a_reload_releases_each_batch_once_until_it_is_settled() {
        let mut lot = ParkingLot::default();
        let state = || {
            vec![
                parked(1, &[1], ParkStatus::Replay),
                parked(11, &[1], ParkStatus::Held),
                parked(21, &[5], ParkStatus::Held),
            ]
        };
        lot.reload(state());
        assert_eq!(lot.next().map(|b| b.first_seq), Some(1));
        assert!(lot.next().unwrap().from_parked && lot.next().unwrap().recorded);
        assert_eq!(released(&mut lot), vec![1, 21]);
        lot.reload(state());
        assert_eq!(released(&mut lot), Vec::<u64>::new(), "still on their way");
        // 1 failed again and is parked again; 21 was written and unparked.
        lot.settled(1);
        lot.settled(21);
        lot.reload(vec![
            parked(1, &[1], ParkStatus::Parked),
            parked(11, &[1], ParkStatus::Held),
        ]);
        assert_eq!(released(&mut lot), Vec::<u64>::new(), "1 waits for replay");
        lot.reload(vec![
            parked(1, &[1], ParkStatus::Replay),
            parked(11, &[1], ParkStatus::Held),
        ]);
        assert_eq!(released(&mut lot), vec![1]);
        // 1 written: the held batch behind it goes next.
        lot.settled(1);
        lot.reload(vec![parked(11, &[1], ParkStatus::Held)]);
        assert_eq!(released(&mut lot), vec![11]);
    }

    /// The blocked rows are those of the state at the last reload: rows of a
    /// batch delivered since no longer block.
    #[test]
    fn a_reload_unblocks_the_rows_of_batches_gone() {
        let mut lot = ParkingLot::default();
        lot.parked(&batch(1, &[7], "public.t"));
        lot.reload(vec![parked(1, &[7], ParkStatus::Parked)]);
        assert!(lot.blocks(&batch(2, &[7], "public.t")));
        lot.reload(Vec::new());
        assert!(!lot.blocks(&batch(2, &[7], "public.t")));
    }

    /// Stopping leaves queued batches to the next start, and a reload after
    /// it may queue them again.
    #[test]
    fn stopping_drops_the_queue_and_forgets_it() {
        let mut lot = ParkingLot::default();
        lot.reload(vec![parked(1, &[1], ParkStatus::Replay)]);
        lot.stop();
        assert!(lot.next().is_none());
        lot.reload(vec![parked(1, &[1], ParkStatus::Replay)]);
        assert_eq!(released(&mut lot), vec![1]);
    }
}
