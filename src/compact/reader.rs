//! The write stage's reader: the plan's objects fetched from the store and
//! typed (see [`crate::lakehouse::read`]) a group at a time, ahead of the
//! writer and in plan order, on every core the writers leave free.

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStore;

use super::plan::Plan;
use super::task::Task;
use crate::archive::listing;
use crate::error::ErrorKind;
use crate::lakehouse::{line, read};
use crate::{Error, Result};

/// Parsed groups (see [`GROUP_BYTES`]) waiting for the writer beside the
/// one it is taking objects from.
const READ_AHEAD: usize = 2;

/// Groups of objects fetched and parsed at once, each group's parse a task
/// of its own, so the NDJSON parse (a third of compact's CPU) uses every
/// core the history and spool writers leave free; their order is kept. On
/// the runtime's workers, not blocking threads: those would add runnable
/// threads beyond the cores, which measured 10-15% slower (a parse of
/// 10,000 lines holds a worker for ~30 ms; nothing in compact needs a lower
/// latency).
const PARSERS: usize = 2;

/// Consecutive objects are fetched and parsed as one group up to this many
/// bytes (a larger object is a group of its own): an archive of small
/// objects (a quiet source writes a few lines per object) costs one parse
/// task per group, not per object, and its GETs overlap (see [`FETCHES`]).
const GROUP_BYTES: u64 = 1 << 20;

/// GETs in flight within a group: objects of a few KiB are latency-bound
/// on S3, where two at a time (one per parser) would leave the run waiting
/// on round trips.
const FETCHES: usize = 16;

/// The plan's objects (key, first seq to compact) in plan order, cut into
/// groups of consecutive objects of at most [`GROUP_BYTES`] together (or
/// one larger object).
fn object_groups(plan: &Plan) -> Vec<Vec<(String, u64)>> {
    let mut groups: Vec<Vec<(String, u64)>> = Vec::new();
    let mut bytes = 0;
    for o in plan.files.iter().flat_map(|f| &f.objects) {
        let object = (o.key.clone(), o.from_seq);
        match groups.last_mut() {
            Some(group) if bytes + o.size <= GROUP_BYTES => {
                bytes += o.size;
                group.push(object);
            }
            _ => {
                bytes = o.size;
                groups.push(vec![object]);
            }
        }
    }
    groups
}

/// Reads and types the plan's objects, in plan order, [`PARSERS`] groups at
/// a time (see [`GROUP_BYTES`]); up to [`READ_AHEAD`] parsed groups wait
/// for the writer (so memory holds up to `READ_AHEAD + PARSERS + 1`
/// groups); stops when the receiver is dropped.
///
/// A group is fetched and parsed on one task, which goes on whether or not
/// the writer is taking groups; objects are handed over a group at a time.
/// Before, objects went one by one through a channel of four and the
/// fetches were driven by the loop that fed it: with objects of 100 lines
/// the channel was always full and the next group's GETs waited on it
/// (the run used 1.5-1.8 of its 2 cores).
pub(crate) fn read_ahead(
    store: &Arc<dyn ObjectStore>,
    plan: &Plan,
    shapes: &Arc<line::Shapes>,
    starts: &Arc<[u64]>,
) -> ReadAhead {
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    let store = Arc::clone(store);
    let (shapes, starts) = (Arc::clone(shapes), Arc::clone(starts));
    let groups = object_groups(plan);
    let task = Task::spawn(async move {
        let mut parsed = futures::stream::iter(groups)
            .map(|group| {
                let (store, shapes) = (Arc::clone(&store), Arc::clone(&shapes));
                let starts = Arc::clone(&starts);
                Task::spawn(async move {
                    let bodies: Vec<(String, u64, bytes::Bytes)> = futures::stream::iter(group)
                        .map(|(key, from_seq)| {
                            let store = Arc::clone(&store);
                            async move {
                                let body = listing::get_ndjson(store.as_ref(), &key).await?;
                                Ok::<_, Error>((key, from_seq, body))
                            }
                        })
                        .buffered(FETCHES)
                        .try_collect()
                        .await?;
                    bodies
                        .iter()
                        .map(|(key, from_seq, body)| {
                            parse_object(&shapes, &starts, key, *from_seq, body)
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .join("the archive reader")
            })
            .buffered(PARSERS);
        while let Some(group) = parsed.next().await {
            let group = group.and_then(|parsed| parsed);
            let failed = group.is_err();
            if tx.send(group).await.is_err() || failed {
                return;
            }
        }
    });
    ReadAhead {
        rx,
        group: Vec::new().into_iter(),
        _task: task,
    }
}

/// The changes of one object to compact: from seq `from_seq` on, table
/// `i`'s from `starts[i]` on (see [`read::ObjectReader`]); an error names
/// the object and the line.
fn parse_object(
    shapes: &line::Shapes,
    starts: &[u64],
    key: &str,
    from_seq: u64,
    body: &[u8],
) -> Result<read::ObjectChanges> {
    // About one line per 200 bytes.
    let mut reader = read::ObjectReader::new(shapes, from_seq, starts, body.len() / 200 + 1);
    // Checked whole, faster than line by line; an object that is not UTF-8
    // is read line by line, so the error says which line and where.
    let text = std::str::from_utf8(body).ok();
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', body).chain(std::iter::once(body.len()));
    for (n, end) in ends.enumerate() {
        let (start_of_line, line) = (start, &body[start..end]);
        start = end + 1;
        if line.is_empty() {
            continue;
        }
        let typed = match text {
            // Cut at newlines: char boundaries.
            Some(text) => read::type_text_into(shapes, &text[start_of_line..end], reader.spare()),
            None => read::type_line(shapes, line),
        };
        reader.push(typed.map_err(|what| {
            Error::fatal(
                format!("{key} line {}: {what}", n + 1),
                "archive objects are written by `waltail run`; restore this one from a copy, or move it away and compact again",
            )
            .with_kind(ErrorKind::Archive)
        })?);
    }
    Ok(reader.finish())
}

/// The changes of each object, in plan order.
pub(crate) struct ReadAhead {
    rx: tokio::sync::mpsc::Receiver<Result<Vec<read::ObjectChanges>>>,
    /// The objects left of the group being taken.
    group: std::vec::IntoIter<read::ObjectChanges>,
    /// Aborted when the reader is dropped.
    _task: Task<()>,
}

impl ReadAhead {
    pub(crate) async fn recv(&mut self) -> Option<Result<read::ObjectChanges>> {
        loop {
            if let Some(lines) = self.group.next() {
                return Some(Ok(lines));
            }
            match self.rx.recv().await? {
                Ok(group) => self.group = group.into_iter(),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use object_store::ObjectStoreExt;
    use object_store::path::Path as ObjectPath;

    use super::*;
    use crate::compact::plan;
    use crate::lakehouse::typing::TableShape;

    /// Small objects are fetched and parsed together, in plan order, up to
    /// a mebibyte a group; an object larger than that is a group alone.
    #[test]
    fn small_objects_are_grouped_in_order_and_a_large_one_stands_alone() {
        let object = |key: &str, size: u64| plan::PlannedObject {
            key: key.into(),
            size,
            from_seq: 0,
        };
        let file = |objects| plan::PlannedFile {
            date: "2026-11-30".into(),
            first_seq: 1,
            last_seq: 1,
            objects,
        };
        let half = GROUP_BYTES / 2;
        let plan = Plan {
            from_seq: 1,
            to_seq: 1,
            tables: Vec::new(),
            // A group goes on across history files: only bytes cut it.
            files: vec![
                file(vec![object("a", half), object("b", half)]),
                file(vec![object("c", 1), object("d", 3 * GROUP_BYTES)]),
                file(vec![object("e", 1), object("f", 1)]),
            ],
            repeated: Vec::new(),
        };
        let groups = object_groups(&plan);
        let keys: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.iter().map(|(key, _)| key.as_str()).collect())
            .collect();
        assert_eq!(keys, [vec!["a", "b"], vec!["c"], vec!["d"], vec!["e", "f"]]);
    }

    /// Every object comes back once and whole, in plan order, through
    /// groups of many small objects and groups of one large one; a bad
    /// line stops the reader after the groups before its own, with an
    /// error naming the object and the line.
    #[tokio::test]
    async fn objects_come_back_in_plan_order_and_a_bad_line_stops_the_reader() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let shapes = Arc::new(line::Shapes::new([Arc::new(TableShape::test_t())]));
        let line = |seq: u64| {
            format!(
                r#"{{"op":"insert","table":"public.t","data":{{"id":{seq},"doc":"d"}},"old":null,"seq":{seq},"idempotency_key":"k{seq}","commit_lsn":"0/1"}}"#
            ) + "\n"
        };
        // Every tenth object is over a group's size (a group of its own).
        let sizes: Vec<u64> = (0..40)
            .map(|i| if i % 10 == 9 { 9_000 } else { 200 })
            .collect();
        let (mut objects, mut seq) = (Vec::new(), 0);
        for (i, &lines) in sizes.iter().enumerate() {
            let body: String = (0..lines)
                .map(|_| {
                    seq += 1;
                    line(seq)
                })
                .collect();
            let key = format!("o{i:02}");
            let size = body.len() as u64;
            store
                .put(&ObjectPath::from(key.as_str()), body.into())
                .await
                .unwrap();
            objects.push(plan::PlannedObject {
                key,
                size,
                from_seq: 0,
            });
        }
        let plan = |objects: Vec<plan::PlannedObject>| Plan {
            from_seq: 1,
            to_seq: seq,
            tables: vec!["public.t".into()],
            files: vec![plan::PlannedFile {
                date: "2026-11-30".into(),
                first_seq: 1,
                last_seq: seq,
                objects,
            }],
            repeated: Vec::new(),
        };
        let whole = plan(objects.clone());
        let groups = object_groups(&whole);
        assert!(groups.iter().any(|g| g.len() > 1) && groups.iter().any(|g| g.len() == 1));
        let starts: Arc<[u64]> = Arc::from([0]);
        let mut reader = read_ahead(&store, &whole, &shapes, &starts);
        let mut next = 1;
        for &lines in &sizes {
            let got = reader.recv().await.unwrap().unwrap();
            let [table] = &got.tables[..] else {
                panic!("one table's changes");
            };
            let seqs = table.batch.seqs().values();
            assert_eq!(
                seqs,
                &(next as i64..(next + lines) as i64).collect::<Vec<_>>()
            );
            next += lines;
        }
        assert!(reader.recv().await.is_none());

        let bad = objects[25].clone();
        let body = line(1) + "not json\n";
        let size = body.len() as u64;
        store
            .put(&ObjectPath::from(bad.key.as_str()), body.into())
            .await
            .unwrap();
        objects[25].size = size;
        // The objects of the groups before the bad one's (a group's parse
        // fails whole; the run stops there, before anything is committed).
        let before: usize = groups
            .iter()
            .take_while(|g| !g.iter().any(|(key, _)| *key == bad.key))
            .map(Vec::len)
            .sum();
        assert!(before > 0);
        let mut reader = read_ahead(&store, &plan(objects), &shapes, &starts);
        for _ in 0..before {
            reader.recv().await.unwrap().unwrap();
        }
        let e = reader.recv().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("o25 line 2"), "{e}");
        assert!(reader.recv().await.is_none());
    }
}
