//! The windows between a chunk's low and high watermark, as the stream
//! passes them (see the module docs of [`super`]).
//!
//! One window per lane (a reader of `backfill.parallelism`); lanes' windows
//! overlap in the stream. A window opens at its low watermark, starts
//! watching its table once the low watermark's transaction commits,
//! remembers the rows changed (or the table truncated) until its high
//! watermark, and completes when the high watermark's transaction commits.
//! [`Windows`] is that state machine alone; the pipeline does the I/O
//! (reading the chunk's rows, emitting them, recording the chunk done) and
//! holds the confirmation back as the answers here say.

use std::collections::{BTreeMap, HashSet};

use crate::archive::envelope::{Change, Op};

/// One chunk's window.
#[derive(Debug)]
pub(crate) struct Window {
    pub chunk: i64,
    /// `schema.table` of the chunk's table.
    table: String,
    /// Rows of that table changed inside the window (row identity hashes).
    changed: HashSet<u64>,
    truncated: bool,
    /// End LSN of the low watermark's transaction, once committed.
    pub low_end: Option<u64>,
    /// The high watermark came, with this many `read` events sent; its
    /// transaction's commit completes the chunk.
    pub sent: Option<u64>,
    /// The places of the chunk's rows left out at the high watermark (they
    /// changed inside the window), recorded with the chunk when it completes.
    pub skipped: Vec<u32>,
}

impl Window {
    /// Whether changes of its table count: after the low watermark's commit,
    /// before the high watermark.
    fn watching(&self) -> bool {
        self.low_end.is_some() && self.sent.is_none()
    }
}

/// What a commit did to the windows.
#[derive(Debug, Default)]
pub(crate) struct Committed {
    /// The transaction was a low watermark's: it must not be confirmed
    /// until its chunk's `read` events are written.
    pub low: bool,
    /// The transaction was a high watermark's: its window, now closed, with
    /// its lane.
    pub completed: Option<(u32, Window)>,
}

/// The open windows, by lane.
#[derive(Debug, Default)]
pub(crate) struct Windows {
    open: BTreeMap<u32, Window>,
}

impl Windows {
    /// A low watermark of `chunk` (of table `table`, `schema.table`) opens
    /// the lane's window; the lane's previous window, if any, is returned:
    /// its chunk was given up.
    pub(crate) fn open(&mut self, lane: u32, chunk: i64, table: String) -> Option<Window> {
        self.open.insert(
            lane,
            Window {
                chunk,
                table,
                changed: HashSet::new(),
                truncated: false,
                low_end: None,
                sent: None,
                skipped: Vec::new(),
            },
        )
    }

    /// Closes a lane's window without completing it (its chunk is given
    /// up or cancelled).
    pub(crate) fn close(&mut self, lane: u32) -> Option<Window> {
        self.open.remove(&lane)
    }

    /// The lanes with a window.
    pub(crate) fn lanes(&self) -> Vec<u32> {
        self.open.keys().copied().collect()
    }

    /// Whether the lane's window is `chunk`'s and its low watermark has
    /// committed: a high watermark of `chunk` then completes it.
    pub(crate) fn is_open(&self, lane: u32, chunk: i64) -> bool {
        self.open
            .get(&lane)
            .is_some_and(|w| w.chunk == chunk && w.low_end.is_some())
    }

    /// A change in the stream: a row of a watched table changed (or the
    /// table was truncated) inside its window.
    pub(crate) fn observe(&mut self, change: &Change) {
        for w in self.open.values_mut() {
            if w.watching() && change.table.name == w.table {
                match change.op {
                    Op::Truncate => w.truncated = true,
                    _ => w.changed.extend(change.rows.as_slice()),
                }
            }
        }
    }

    /// The places of `rows` (a chunk's row identities, in key order) that
    /// the lane's window saw change: they are left out of the chunk.
    pub(crate) fn skipped(&self, lane: u32, rows: impl Iterator<Item = u64>) -> Vec<u32> {
        let Some(w) = self.open.get(&lane) else {
            return Vec::new();
        };
        rows.enumerate()
            .filter(|(_, hash)| w.truncated || w.changed.contains(hash))
            .map(|(ord, _)| ord as u32)
            .collect()
    }

    /// The lane's high watermark came and `sent` rows went out, leaving out
    /// those at `skipped`; the window completes at the next commit.
    pub(crate) fn sent(&mut self, lane: u32, sent: u64, skipped: Vec<u32>) {
        if let Some(w) = self.open.get_mut(&lane) {
            w.sent = Some(sent);
            w.skipped = skipped;
        }
    }

    /// A transaction committed, ending at `end_lsn`. A watermark is a
    /// transaction of its own, so at most one window opens or completes
    /// here.
    pub(crate) fn commit(&mut self, end_lsn: u64) -> Committed {
        let mut out = Committed::default();
        let mut completed = None;
        for (&lane, w) in self.open.iter_mut() {
            if w.low_end.is_none() {
                w.low_end = Some(end_lsn);
                out.low = true;
            } else if w.sent.is_some() {
                completed = Some(lane);
            }
        }
        out.completed = completed.and_then(|lane| self.open.remove(&lane).map(|w| (lane, w)));
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::archive::envelope::{RowSet, TableRef};

    fn change(table: &str, op: Op, row: u64) -> Change {
        Change {
            op,
            table: Arc::new(TableRef::from_name(table.into())),
            data: None,
            old: None,
            commit_lsn: 0,
            commit_ts: 0,
            index: 0,
            rows: RowSet::one(row),
        }
    }

    /// Only changes of the window's table between the low watermark's
    /// commit and the high watermark leave rows out of the chunk.
    #[test]
    fn a_window_watches_its_table_from_the_low_commit_to_the_high_mark() {
        let mut w = Windows::default();
        assert!(w.open(0, 7, "public.t".into()).is_none());
        // In the low watermark's own transaction: not yet watching.
        w.observe(&change("public.t", Op::Update, 1));
        assert!(!w.is_open(0, 7));
        let c = w.commit(100);
        assert!(c.low && c.completed.is_none());
        assert!(w.is_open(0, 7) && !w.is_open(0, 8) && !w.is_open(1, 7));
        w.observe(&change("public.t", Op::Update, 2));
        w.observe(&change("public.other", Op::Update, 3));
        w.observe(&change("public.t", Op::Delete, 4));
        let skipped = w.skipped(0, [1, 2, 3, 4, 5].into_iter());
        assert_eq!(skipped, vec![1, 3], "rows 2 and 4 changed in the window");
        w.sent(0, 3, skipped);
        // After the high watermark: changes get later seqs than the chunk.
        w.observe(&change("public.t", Op::Update, 5));
        let c = w.commit(200);
        assert!(!c.low);
        let (lane, done) = c.completed.expect("the high watermark's commit");
        assert_eq!((lane, done.chunk, done.low_end), (0, 7, Some(100)));
        assert_eq!((done.sent, done.skipped), (Some(3), vec![1, 3]));
        assert!(w.lanes().is_empty());
    }

    #[test]
    fn a_truncate_in_the_window_leaves_out_every_row() {
        let mut w = Windows::default();
        w.open(0, 1, "public.t".into());
        w.commit(10);
        w.observe(&change("public.t", Op::Truncate, 0));
        assert_eq!(w.skipped(0, [1, 2, 3].into_iter()), vec![0, 1, 2]);
    }

    /// Lanes' windows overlap: each watches its own table and completes
    /// at its own high watermark's commit; the other stays open.
    #[test]
    fn overlapping_lanes_keep_their_own_windows() {
        let mut w = Windows::default();
        w.open(0, 1, "public.a".into());
        assert!(w.commit(10).low);
        w.open(1, 2, "public.b".into());
        assert!(w.commit(20).low);
        w.observe(&change("public.a", Op::Update, 1));
        w.observe(&change("public.b", Op::Update, 2));
        assert_eq!(w.skipped(0, [1, 2].into_iter()), vec![0]);
        assert_eq!(w.skipped(1, [1, 2].into_iter()), vec![1]);
        w.sent(1, 1, vec![1]);
        let c = w.commit(30);
        assert_eq!(c.completed.map(|(lane, w)| (lane, w.chunk)), Some((1, 2)));
        assert_eq!(w.lanes(), vec![0]);
        // An ordinary commit completes nothing and holds nothing back.
        let c = w.commit(40);
        assert!(!c.low && c.completed.is_none());
    }

    /// A new low watermark in a lane gives up the lane's previous chunk.
    #[test]
    fn a_new_low_mark_gives_up_the_lanes_previous_window() {
        let mut w = Windows::default();
        w.open(0, 1, "public.t".into());
        w.commit(10);
        let given_up = w.open(0, 2, "public.t".into()).expect("chunk 1's window");
        assert_eq!((given_up.chunk, given_up.low_end), (1, Some(10)));
        assert!(!w.is_open(0, 1) && !w.is_open(0, 2));
        assert_eq!(w.close(0).map(|w| w.chunk), Some(2));
        assert!(w.close(0).is_none());
    }
}
