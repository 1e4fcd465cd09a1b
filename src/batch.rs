//! The batcher: cuts the numbered change stream into batches by size and
//! linger, and re-forms exactly the batches recorded before a crash.
//!
//! Batch boundaries normally depend on timing (a partial batch leaves after
//! `linger`), so they are not a function of the stream alone. That is why
//! every cut batch's seq range is recorded as an intent before its PUT
//! (see [`crate::checkpoint`]); on restart the batcher is given those
//! intents and forces the same boundaries, and new batching begins after
//! the last of them. Changes of an intent already written are skipped.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::archive::codec::Codec;
use crate::archive::envelope::{self, Change, TableRef};

/// The default of `delivery.max_batch_bytes`: a batch is also cut once its
/// body reaches this size, so wide rows (large TOASTed values) cannot make
/// one object, and the memory holding the batches in flight, grow without
/// bound (see the pipeline's bound on the batches in memory).
pub const MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// The row identities of a batch (see [`Change::rows`]). They are hashes
/// already, so the set hashes them again with a fast in-memory hasher, not
/// std's SipHash (which took 2-3% of a backfill's CPU).
pub type RowHashSet = HashSet<u64, foldhash::fast::RandomState>;

/// A batch whose seq range is fixed, as the local state records it before
/// its PUT: `done` once its object is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intent {
    /// The seq of the batch's first change.
    pub first_seq: u64,
    /// The seq of the batch's last change, inclusive.
    pub last_seq: u64,
    /// The batch's object is written: its changes are skipped on replay.
    pub done: bool,
    /// How the batch's object is encoded (its key says so too): a batch
    /// re-formed after `destination.compression` changed keeps it.
    pub codec: Codec,
}

/// A batch ready for delivery: one object's worth of envelope lines.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The seq of the batch's first change; with `last_seq` it names the key.
    pub first_seq: u64,
    /// The seq of the batch's last change, inclusive.
    pub last_seq: u64,
    /// Commit time of the first change (it dates the key).
    pub commit_ts: i64,
    /// NDJSON lines, each ending in a newline.
    pub body: Vec<u8>,
    /// Hashes of the rows in the batch (see [`Change::rows`]).
    pub rows: RowHashSet,
    /// The tables the batch touches (for `parked list`).
    pub tables: Vec<Arc<TableRef>>,
    /// The intent is already in the local state (a re-formed or parked batch).
    pub recorded: bool,
    /// The object key (set when the batch is queued for delivery).
    pub key: String,
    /// The batch comes from the parked table (a replay or a released held
    /// batch): once written, it is removed from there.
    pub from_parked: bool,
    /// How its object is encoded: the codec its intent recorded (a
    /// re-formed batch keeps it, whatever the setting says now), or `None`
    /// until it is queued with the configured one.
    pub codec: Option<Codec>,
}

impl Batch {
    /// The identities of the tables the batch touches (see
    /// [`crate::row_identity::Holds`]).
    pub fn table_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.tables.iter().map(|t| t.hash)
    }

    /// The tables, comma-separated, for messages.
    pub fn table_names(&self) -> String {
        self.tables
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many changes the batch holds.
    pub fn changes(&self) -> u64 {
        self.last_seq - self.first_seq + 1
    }
}

/// What a change did to the batcher.
#[derive(Debug)]
pub enum Cut {
    /// A batch is complete and must be delivered.
    Ready(Batch),
    /// A batch written before a restart was seen again in full; nothing to send.
    AlreadyWritten {
        /// The seq of the written batch's first change.
        first_seq: u64,
        /// The seq of the written batch's last change, inclusive.
        last_seq: u64,
    },
}

/// Cuts batches; see the module docs.
pub struct Batcher {
    batch_size: usize,
    /// The size of a batch holding only `read` events (backfill).
    read_batch_size: usize,
    /// A batch is cut once its body reaches this many bytes.
    max_bytes: usize,
    /// The current batch holds only `read` events.
    reads_only: bool,
    linger: Duration,
    namespace: Uuid,
    /// Recorded intents not yet re-formed, in seq order.
    fixed: VecDeque<Intent>,
    current: Option<Batch>,
    /// When the current (non-fixed) batch must leave even if not full.
    deadline: Option<Instant>,
    /// The bytes of a line in the last batch cut: a new batch's body is
    /// sized from it, so it is not grown (and copied) again and again as
    /// lines are appended.
    line_bytes: usize,
}

impl Batcher {
    /// A batcher cutting every `batch_size` changes or `linger` after a
    /// batch's first change, whose first batches are the recorded
    /// `intents` (in seq order) re-formed exactly; lines are keyed in the
    /// pipeline's `namespace`.
    pub fn new(batch_size: usize, linger: Duration, namespace: Uuid, intents: Vec<Intent>) -> Self {
        Batcher {
            batch_size,
            read_batch_size: batch_size,
            max_bytes: MAX_BATCH_BYTES,
            reads_only: true,
            linger,
            namespace,
            fixed: intents.into(),
            current: None,
            deadline: None,
            line_bytes: 256,
        }
    }

    /// Lets batches of `read` events alone grow to `size` changes (backfill
    /// rows are bulk; their objects can be larger than streamed changes').
    pub fn with_read_batch_size(mut self, size: usize) -> Self {
        self.read_batch_size = size.max(1);
        self
    }

    /// Cuts a batch once its body reaches `bytes` (`delivery.max_batch_bytes`)
    /// instead of [`MAX_BATCH_BYTES`]. A restart re-forms recorded batches by
    /// their seqs, so changing it between runs never re-cuts a batch.
    pub fn with_max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes.max(1);
        self
    }

    /// Adds the change numbered `seq` (seqs arrive contiguous, ascending).
    pub fn push(&mut self, seq: u64, change: &Change) -> Option<Cut> {
        // Drop intents that end before this seq (wholly confirmed already).
        while self.fixed.front().is_some_and(|i| i.last_seq < seq) {
            self.fixed.pop_front();
        }
        if let Some(intent) = self.fixed.front().copied()
            && intent.first_seq <= seq
        {
            if intent.done {
                if seq == intent.last_seq {
                    self.fixed.pop_front();
                    return Some(Cut::AlreadyWritten {
                        first_seq: intent.first_seq,
                        last_seq: intent.last_seq,
                    });
                }
                return None;
            }
            self.append(seq, change);
            if seq == intent.last_seq {
                self.fixed.pop_front();
                let mut batch = self.cut().expect("appended above");
                batch.recorded = true;
                batch.codec = Some(intent.codec);
                return Some(Cut::Ready(batch));
            }
            return None;
        }
        if self.current.is_none() {
            self.deadline = Some(Instant::now() + self.linger);
            self.reads_only = true;
        }
        self.reads_only &= change.op == envelope::Op::Read;
        self.append(seq, change);
        let limit = if self.reads_only {
            self.read_batch_size
        } else {
            self.batch_size
        };
        if self
            .current
            .as_ref()
            .is_some_and(|b| b.changes() as usize >= limit || b.body.len() >= self.max_bytes)
        {
            return self.take().map(Cut::Ready);
        }
        None
    }

    fn append(&mut self, seq: u64, change: &Change) {
        let batch = match &mut self.current {
            Some(batch) => batch,
            None => self.current.insert(Batch {
                first_seq: seq,
                last_seq: seq,
                commit_ts: change.commit_ts,
                body: Vec::with_capacity(self.body_size(change.op)),
                rows: RowHashSet::default(),
                tables: Vec::new(),
                recorded: false,
                key: String::new(),
                from_parked: false,
                codec: None,
            }),
        };
        if !batch.tables.iter().any(|t| Arc::ptr_eq(t, &change.table)) {
            batch.tables.push(change.table.clone());
        }
        batch.last_seq = seq;
        batch.rows.extend(change.rows.as_slice().iter().copied());
        envelope::write_line(&mut batch.body, &self.namespace, change, seq);
    }

    /// When the partial batch must leave; `None` when there is nothing to
    /// flush or the batch being re-formed has fixed bounds.
    pub fn deadline(&self) -> Option<Instant> {
        if self.in_fixed() {
            None
        } else {
            self.current.as_ref().and(self.deadline)
        }
    }

    fn in_fixed(&self) -> bool {
        self.current.as_ref().is_some_and(|b| {
            self.fixed
                .front()
                .is_some_and(|i| i.first_seq <= b.first_seq && b.first_seq <= i.last_seq)
        })
    }

    /// Cuts the partial batch (linger elapsed, or shutting down). A batch
    /// being re-formed to recorded bounds is never cut short: it is simply
    /// re-formed again on the next start.
    pub fn take(&mut self) -> Option<Batch> {
        if self.in_fixed() {
            return None;
        }
        self.deadline = None;
        self.cut()
    }

    /// The room a new batch's body starts with, its first change being
    /// `op`: an eighth more than its limit of the last batch's lines, so
    /// lines a little longer still fit; never more than a batch may hold.
    fn body_size(&self, op: envelope::Op) -> usize {
        let limit = if op == envelope::Op::Read {
            self.read_batch_size
        } else {
            self.batch_size
        };
        (limit.min(10_000) * self.line_bytes / 8 * 9).min(self.max_bytes + self.line_bytes)
    }

    /// The current batch, taken out; its lines' size is what the next
    /// batch is sized by.
    fn cut(&mut self) -> Option<Batch> {
        let batch = self.current.take()?;
        self.line_bytes = (batch.body.len() / batch.changes() as usize).max(64);
        Some(batch)
    }

    /// Nothing is held: no partial batch, no recorded batch half re-formed.
    pub fn is_empty(&self) -> bool {
        self.current.is_none()
    }

    /// The last seq fixed by a recorded intent; new batches start after it.
    pub fn fixed_until(&self) -> Option<u64> {
        self.fixed.back().map(|i| i.last_seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::envelope::{Op, RowSet, TableRef};

    fn change(i: u64) -> Change {
        Change {
            op: Op::Insert,
            table: Arc::new(TableRef::new("public", "t")),
            data: Some(format!("{{\"id\":{i}}}").into_bytes()),
            old: None,
            commit_lsn: 0x100 + i,
            commit_ts: 1_000_000,
            index: 0,
            rows: RowSet::one(i),
        }
    }

    fn ready(cut: Option<Cut>) -> Batch {
        match cut {
            Some(Cut::Ready(b)) => b,
            other => panic!("expected a ready batch, got {other:?}"),
        }
    }

    #[test]
    fn cuts_at_batch_size() {
        let mut b = Batcher::new(3, Duration::from_secs(1), Uuid::nil(), vec![]);
        assert!(b.push(1, &change(1)).is_none());
        assert!(b.push(2, &change(2)).is_none());
        let batch = ready(b.push(3, &change(3)));
        assert_eq!((batch.first_seq, batch.last_seq), (1, 3));
        assert_eq!(batch.body.iter().filter(|&&c| c == b'\n').count(), 3);
        assert!(b.is_empty());
    }

    #[test]
    fn batches_of_reads_alone_grow_to_the_read_batch_size() {
        let read = |i| Change {
            op: Op::Read,
            ..change(i)
        };
        let mut b =
            Batcher::new(2, Duration::from_secs(1), Uuid::nil(), vec![]).with_read_batch_size(4);
        for i in 1..4 {
            assert!(b.push(i, &read(i)).is_none(), "read {i}");
        }
        let batch = ready(b.push(4, &read(4)));
        assert_eq!((batch.first_seq, batch.last_seq), (1, 4));
        // A streamed change in a batch of reads brings back the usual size.
        assert!(b.push(5, &read(5)).is_none());
        let batch = ready(b.push(6, &change(6)));
        assert_eq!((batch.first_seq, batch.last_seq), (5, 6));
        assert!(b.push(7, &change(7)).is_none());
        let batch = ready(b.push(8, &read(8)));
        assert_eq!((batch.first_seq, batch.last_seq), (7, 8));
    }

    #[test]
    fn cuts_at_max_batch_bytes_before_batch_size() {
        let mut b = Batcher::new(100, Duration::from_secs(1), Uuid::nil(), vec![]);
        let mut wide = change(1);
        wide.data = Some(format!("{{\"blob\":\"{}\"}}", "x".repeat(3 * 1024 * 1024)).into_bytes());
        assert!(b.push(1, &wide).is_none());
        assert!(b.push(2, &wide).is_none());
        let batch = ready(b.push(3, &wide));
        assert_eq!((batch.first_seq, batch.last_seq), (1, 3));
        assert!(batch.body.len() >= MAX_BATCH_BYTES);
    }

    #[test]
    fn cuts_at_the_configured_max_bytes() {
        let mut b =
            Batcher::new(100, Duration::from_secs(1), Uuid::nil(), vec![]).with_max_bytes(1024);
        let mut wide = change(1);
        wide.data = Some(format!("{{\"blob\":\"{}\"}}", "x".repeat(250)).into_bytes());
        assert!(b.push(1, &wide).is_none());
        assert!(b.push(2, &wide).is_none());
        let batch = ready(b.push(3, &wide));
        assert_eq!((batch.first_seq, batch.last_seq), (1, 3));
        assert!(batch.body.len() >= 1024 && batch.body.len() < MAX_BATCH_BYTES);
    }

    #[tokio::test(start_paused = true)]
    async fn linger_sets_a_deadline_for_partial_batches() {
        let mut b = Batcher::new(100, Duration::from_millis(200), Uuid::nil(), vec![]);
        assert!(b.deadline().is_none());
        let before = Instant::now();
        b.push(1, &change(1));
        assert_eq!(b.deadline(), Some(before + Duration::from_millis(200)));
        let batch = b.take().unwrap();
        assert_eq!((batch.first_seq, batch.last_seq), (1, 1));
        assert!(b.deadline().is_none());
    }

    #[test]
    fn recorded_intents_are_reformed_exactly_and_written_ones_skipped() {
        let intents = vec![
            Intent {
                first_seq: 5,
                last_seq: 9,
                done: true,
                codec: Codec::None,
            },
            Intent {
                first_seq: 10,
                last_seq: 11,
                done: false,
                codec: Codec::None,
            },
        ];
        // Restart with S = 7: seqs 7..9 belong to a written batch.
        let mut b = Batcher::new(100, Duration::from_millis(1), Uuid::nil(), intents);
        assert!(b.push(7, &change(7)).is_none());
        assert!(b.push(8, &change(8)).is_none());
        assert!(matches!(
            b.push(9, &change(9)),
            Some(Cut::AlreadyWritten {
                first_seq: 5,
                last_seq: 9
            })
        ));
        assert!(b.push(10, &change(10)).is_none());
        // A re-formed batch is never cut by linger or shutdown.
        assert!(b.deadline().is_none());
        assert!(b.take().is_none());
        let batch = ready(b.push(11, &change(11)));
        assert_eq!(
            (batch.first_seq, batch.last_seq, batch.recorded),
            (10, 11, true)
        );
        // Then normal batching.
        assert!(b.push(12, &change(12)).is_none());
        assert!(b.deadline().is_some());
    }

    #[test]
    fn same_changes_give_same_bytes() {
        let mut a = Batcher::new(2, Duration::from_secs(1), Uuid::nil(), vec![]);
        let mut b = Batcher::new(
            2,
            Duration::from_secs(1),
            Uuid::nil(),
            vec![Intent {
                first_seq: 1,
                last_seq: 2,
                done: false,
                codec: Codec::None,
            }],
        );
        a.push(1, &change(1));
        b.push(1, &change(1));
        let x = ready(a.push(2, &change(2)));
        let y = ready(b.push(2, &change(2)));
        assert_eq!(x.body, y.body);
    }

    /// The state a crash leaves, as the pipeline keeps it (see
    /// `pipeline::record_waiting` and `persist`).
    #[derive(Default)]
    struct Model {
        /// first_seq -> (last_seq, done)
        intents: std::collections::BTreeMap<u64, (u64, bool)>,
        next_seq: u64,
        /// Every object ever written: (first_seq, last_seq).
        objects: HashSet<(u64, u64)>,
    }

    impl Model {
        fn open_intents(&self) -> Vec<Intent> {
            self.intents
                .iter()
                .filter(|(_, (last, _))| *last >= self.next_seq)
                .map(|(&first_seq, &(last_seq, done))| Intent {
                    first_seq,
                    last_seq,
                    done,
                    codec: Codec::None,
                })
                .collect()
        }
    }

    /// One run of a pipeline from the model's cursor to `end`: cuts by
    /// size, by linger at random; cut batches wait, and are recorded
    /// (all those waiting at once) when the first of them starts; PUTs
    /// finish out of order; done marks go with the cursor at random times.
    /// At `crash_at`, the PUTs in flight may or may not have been written.
    fn run(
        model: &mut Model,
        rng: &mut fastrand::Rng,
        batch_size: usize,
        end: u64,
        crash_at: Option<u64>,
    ) {
        use std::collections::BTreeMap;
        let mut b = Batcher::new(
            batch_size,
            Duration::from_secs(1),
            Uuid::nil(),
            model.open_intents(),
        )
        .with_read_batch_size(batch_size * 3);
        let mut waiting: VecDeque<Batch> = VecDeque::new();
        let mut in_flight: Vec<Batch> = Vec::new();
        let mut done: Vec<u64> = Vec::new();
        let mut written: BTreeMap<u64, u64> = BTreeMap::new();
        let mut frontier = model.next_seq - 1;
        let advance = |written: &mut BTreeMap<u64, u64>, frontier: &mut u64| {
            while let Some(last) = written.remove(&(*frontier + 1)) {
                *frontier = last;
            }
        };
        let persist = |model: &mut Model, done: &mut Vec<u64>, frontier: u64| {
            for f in done.drain(..) {
                model
                    .intents
                    .get_mut(&f)
                    .expect("recorded before its PUT")
                    .1 = true;
            }
            model.next_seq = frontier + 1;
            model.intents.retain(|_, (last, _)| *last > frontier);
        };
        let start =
            |model: &mut Model, waiting: &mut VecDeque<Batch>, in_flight: &mut Vec<Batch>| {
                while in_flight.len() < 4 {
                    let Some(front) = waiting.front() else { break };
                    if !front.recorded {
                        for w in waiting.iter_mut() {
                            model
                                .intents
                                .entry(w.first_seq)
                                .or_insert((w.last_seq, false));
                            w.recorded = true;
                        }
                    }
                    in_flight.push(waiting.pop_front().expect("front exists"));
                }
            };
        for seq in model.next_seq..=end {
            if crash_at == Some(seq) {
                for batch in in_flight {
                    if rng.bool() {
                        model.objects.insert((batch.first_seq, batch.last_seq));
                    }
                }
                return;
            }
            // Read events come in runs (a backfill chunk), streamed changes between.
            let op = if (seq / 37) % 3 == 0 {
                Op::Read
            } else {
                Op::Insert
            };
            let mut cuts: Vec<Cut> = b
                .push(seq, &Change { op, ..change(seq) })
                .into_iter()
                .collect();
            if rng.u8(..) < 8 {
                cuts.extend(b.take().map(Cut::Ready));
            }
            for cut in cuts {
                match cut {
                    Cut::Ready(batch) => waiting.push_back(batch),
                    Cut::AlreadyWritten {
                        first_seq,
                        last_seq,
                    } => {
                        written.insert(first_seq, last_seq);
                        advance(&mut written, &mut frontier);
                    }
                }
            }
            start(model, &mut waiting, &mut in_flight);
            while !in_flight.is_empty() && rng.u8(..) < 100 {
                let batch = in_flight.swap_remove(rng.usize(..in_flight.len()));
                model.objects.insert((batch.first_seq, batch.last_seq));
                done.push(batch.first_seq);
                written.insert(batch.first_seq, batch.last_seq);
                advance(&mut written, &mut frontier);
                start(model, &mut waiting, &mut in_flight);
            }
            if rng.u8(..) < 20 {
                persist(model, &mut done, frontier);
            }
        }
        waiting.extend(b.take());
        while !waiting.is_empty() || !in_flight.is_empty() {
            start(model, &mut waiting, &mut in_flight);
            for batch in in_flight.drain(..) {
                model.objects.insert((batch.first_seq, batch.last_seq));
                done.push(batch.first_seq);
                written.insert(batch.first_seq, batch.last_seq);
            }
        }
        advance(&mut written, &mut frontier);
        persist(model, &mut done, frontier);
        assert_eq!(frontier, end, "every seq is written");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Crashes anywhere, with a change of batch size in between or not,
        /// never write two different objects over the same seqs, and in the
        /// end every seq is in an object.
        #[test]
        fn crashes_never_write_a_seq_range_twice_differently(
            seed in proptest::prelude::any::<u64>(),
            crashes in 1usize..4,
            change_size in proptest::prelude::any::<bool>(),
        ) {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut model = Model { next_seq: 1, ..Model::default() };
            let mut batch_size = 7;
            let end = 3_000;
            for _ in 0..crashes {
                let crash_at = rng.u64(model.next_seq..=end);
                run(&mut model, &mut rng, batch_size, end, Some(crash_at));
                if change_size {
                    batch_size = rng.usize(1..15);
                }
            }
            run(&mut model, &mut rng, batch_size, end, None);
            let mut objects: Vec<_> = model.objects.iter().copied().collect();
            objects.sort();
            for pair in objects.windows(2) {
                proptest::prop_assert!(
                    pair[0].1 < pair[1].0,
                    "objects {:?} and {:?} overlap", pair[0], pair[1]
                );
            }
            let covered: u64 = objects.iter().map(|(f, l)| l - f + 1).sum();
            proptest::prop_assert_eq!(covered, end);
        }
    }
}
