//! Chunks' rows handed from the backfill's readers to the pipeline in
//! memory. A reader stores each chunk in its file first (synced, then
//! marked stored: what a restart reads) and then hands the same rows
//! over here, so the pipeline, at the chunk's high watermark, emits them
//! without reading back the file just written: a copy of every row out of
//! the page cache and a pass to check it, on the pipeline's one task.
//!
//! What this holds is only ever a shortcut: a chunk it no longer holds
//! (given up, pushed out, or from before a restart) is read from its file.
//! It holds the chunks of the last [`Handoff::new`]'s `capacity`, so a
//! chunk whose high watermark never comes (its window given up, the
//! backfill cancelled) cannot keep its rows in memory past that.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::checkpoint::ChunkBody;

/// The chunks handed over and not yet taken, by chunk id; shared by the
/// readers and the pipeline of one process.
#[derive(Debug, Clone)]
pub(crate) struct Handoff {
    chunks: Arc<Mutex<BTreeMap<i64, Arc<ChunkBody>>>>,
    capacity: usize,
}

impl Handoff {
    /// Holds at most `capacity` chunks: the readers' chunks that may wait
    /// for the pipeline at once.
    pub(crate) fn new(capacity: usize) -> Handoff {
        Handoff {
            chunks: Arc::default(),
            capacity: capacity.max(1),
        }
    }

    /// Hands over a stored chunk's rows. The oldest chunk (lowest id) goes
    /// if this would hold more than its capacity.
    pub(crate) fn give(&self, chunk: i64, rows: Arc<ChunkBody>) {
        let mut chunks = self.chunks.lock().expect("not poisoned");
        chunks.insert(chunk, rows);
        while chunks.len() > self.capacity {
            chunks.pop_first();
        }
    }

    /// The rows handed over for `chunk`, if they still are here; they are
    /// gone from here after.
    pub(crate) fn take(&self, chunk: i64) -> Option<Arc<ChunkBody>> {
        self.chunks.lock().expect("not poisoned").remove(&chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: u64) -> Arc<ChunkBody> {
        let mut body = ChunkBody::default();
        body.push(n, b"{}");
        Arc::new(body)
    }

    #[test]
    fn a_chunk_is_taken_once_and_the_oldest_go_past_the_capacity() {
        let handoff = Handoff::new(2);
        handoff.give(3, rows(3));
        handoff.give(1, rows(1));
        assert_eq!(handoff.take(3), Some(rows(3)));
        assert_eq!(handoff.take(3), None, "taken once");
        handoff.give(2, rows(2));
        handoff.give(4, rows(4));
        // Three given, two kept: chunk 1, the oldest, is read from its file.
        assert_eq!(handoff.take(1), None);
        assert_eq!(handoff.take(2), Some(rows(2)));
        assert_eq!(handoff.take(4), Some(rows(4)));
    }
}
