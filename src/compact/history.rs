//! The history: every change of a table as a typed Parquet row, in files
//! `[prefix/]parquet/<schema>/<table>/date=YYYY-MM-DD/<firstSeq>-<lastSeq>.parquet`
//! (Hive-style, so `date` is a partition column for DuckDB, Athena, Spark,
//! Trino), with the metadata columns `_op`, `_seq`, `_lsn`, `_key`, `_old`
//! and `_unchanged` (the columns an update left unchanged, JSON).
//!
//! Files are streamed to the store (multipart upload, visible only when
//! complete), a row group at a time, so memory holds at most a row group
//! and four 10 MiB parts per file being written (see `Upload`). Shared
//! here: [`ParquetFile`], the writer the latest view uses too.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::hash_utils::create_hashes_with_hasher;
use parquet::basic::Encoding;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::parquet_file::{Output, ParquetFile};
use super::spool;
use super::task::Task;
use crate::lakehouse::columns::{ChangeBatch, LSN};
use crate::lakehouse::layout::history_schema;
use crate::lakehouse::typing::TableShape;
use crate::{Error, Result};

/// Changes written at a time: the batches of small objects are joined up
/// to this many, so Arrow's and Parquet's per-batch costs do not matter;
/// an object's batch of more is written as it is.
const BATCH_ROWS: usize = 8192;

/// A buffer of changes to write: the batches of consecutive objects.
type Rows = Vec<ChangeBatch>;

/// One table's history file of a planned group, created at its first
/// change and opened with its first buffer (whose values choose the
/// dictionaries, see [`dictionaries_for`]).
///
/// A full buffer (the batches the parse built for consecutive objects, at
/// least [`BATCH_ROWS`] changes or one object's) is joined into one batch
/// and encoded (Parquet, zstd: a third of compact's CPU) on a task of its
/// own while the next buffer fills, so encoding runs beside the parse and
/// the spool. Up to [`ENCODING_DEPTH`] buffers are on such tasks at once: a
/// buffer is joined (and made into spool rows) while the one before it is
/// still being written, and waits for that one's hand-off of the file only
/// to write. With one task at a time, that work and the writing ran one
/// after the other and the run left an eighth of its two cores idle (a
/// single table's file is a chain the whole run waits on). Memory holds
/// `ENCODING_DEPTH + 1` buffers and the spool rows of the buffers being
/// encoded.
///
/// For a table with a key whose spool takes them, the task also gives the
/// buffer's rows for the latest view's spool ([`spool::change_rows`], from
/// the batch's arrays): [`HistoryFile::push`] and [`HistoryFile::finish`]
/// hand them on, buffer after buffer in seq order.
pub struct HistoryFile {
    /// The table the file holds changes of.
    pub shape: Arc<TableShape>,
    schema: SchemaRef,
    /// The spool's schema of the table, when it has a key.
    spool: Option<SchemaRef>,
    /// Where the next encoding task gets the file: the file itself before
    /// the first task, then the last task's hand-off. `None` only after a
    /// failure.
    next: Option<Handoff>,
    rows: Rows,
    /// The changes in `rows`.
    buffered: usize,
    /// The buffers being encoded, oldest first; each gives back its spool
    /// rows.
    encoding: VecDeque<Task<Result<Encoded>>>,
}

/// Buffers of one file being converted and written at once (see
/// [`HistoryFile`]).
const ENCODING_DEPTH: usize = 2;

/// What encoding a buffer gives back: the buffer's rows for the spool (a
/// table with a key that takes them).
type Encoded = Option<spool::ChangeRows>;

/// How an encoding task gets the file it writes to: at once (the first),
/// or from the task before it, once that one has written its buffer.
/// Made once per buffer (8,192 changes or more): its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Handoff {
    Ready(Target),
    After(tokio::sync::oneshot::Receiver<Target>),
}

impl Handoff {
    async fn take(self) -> Result<Target> {
        match self {
            Handoff::Ready(target) => Ok(target),
            // The earlier task's own error is the one reported: tasks are
            // joined in order.
            Handoff::After(rx) => rx
                .await
                .map_err(|_| Error::bug("a history buffer's writer stopped before handing on")),
        }
    }
}

/// A history file, before or after its first buffer opens it. One per
/// file, moved once per buffer (8,192 changes or more): its size does not
/// matter.
#[allow(clippy::large_enum_variant)]
enum Target {
    Unopened(Output, String, WriterProperties),
    Open(ParquetFile),
}

impl Target {
    /// The file, opened if not yet with the dictionaries the first
    /// buffer's `columns` (as [`history_schema`] lays them out) choose;
    /// without a buffer (no change came), Parquet's defaults.
    fn open(
        self,
        shape: &TableShape,
        schema: &SchemaRef,
        columns: Option<&[ArrayRef]>,
    ) -> Result<ParquetFile> {
        match self {
            Target::Open(file) => Ok(file),
            Target::Unopened(output, key, props) => {
                let n = shape.columns.len();
                let props = match columns {
                    Some(c) => dictionaries_for(props, shape, &c[..n], c[n + LSN].as_ref()),
                    None => props,
                };
                ParquetFile::create(&output, key, Arc::clone(schema), props)
            }
        }
    }
}

impl HistoryFile {
    /// Starts the file `key` of `shape`'s table on `output`; nothing is
    /// uploaded before its first buffer is full.
    pub fn create(
        output: &Output,
        key: String,
        shape: Arc<TableShape>,
        props: WriterProperties,
    ) -> Result<HistoryFile> {
        let schema = history_schema(&shape);
        let props = history_properties(props);
        Ok(HistoryFile {
            next: Some(Handoff::Ready(Target::Unopened(output.clone(), key, props))),
            spool: (!shape.key.is_empty()).then(|| spool::spool_schema(&shape)),
            shape,
            schema,
            rows: Vec::new(),
            buffered: 0,
            encoding: VecDeque::with_capacity(ENCODING_DEPTH),
        })
    }

    /// Adds a batch of changes (in seq order); when an earlier buffer's
    /// encoding ends, its rows for the spool. `wants_rows` (asked when a
    /// full buffer goes to encoding): whether the spool takes the table's
    /// rows from here (see [`spool::Spool::takes_rows`]); if not, they are
    /// not built.
    pub async fn push(
        &mut self,
        changes: ChangeBatch,
        wants_rows: impl FnOnce() -> bool,
    ) -> Result<Option<spool::ChangeRows>> {
        self.buffered += changes.len();
        self.rows.push(changes);
        if self.buffered >= BATCH_ROWS {
            return self.flush(wants_rows()).await;
        }
        Ok(None)
    }

    /// Hands the buffered rows to an encoding task, first waiting for the
    /// oldest one if [`ENCODING_DEPTH`] are under way: that one's rows for
    /// the spool.
    async fn flush(&mut self, wants_rows: bool) -> Result<Option<spool::ChangeRows>> {
        if self.rows.is_empty() {
            return Ok(None);
        }
        let previous = if self.encoding.len() >= ENCODING_DEPTH {
            self.settle_oldest().await?
        } else {
            None
        };
        let rows = std::mem::take(&mut self.rows);
        self.buffered = 0;
        let handoff = self.next.take().ok_or_else(|| self.failed())?;
        let (handed, next) = tokio::sync::oneshot::channel();
        self.next = Some(Handoff::After(next));
        let (shape, schema) = (Arc::clone(&self.shape), Arc::clone(&self.schema));
        let spool_schema = self.spool.clone().filter(|_| wants_rows);
        self.encoding.push_back(Task::spawn(async move {
            // One copy of the small objects' batches; an object of a
            // buffer's size or more is written as it is.
            let changes = ChangeBatch::concat(&rows).map_err(|e| {
                Error::bug(format!("cannot join the changes of {}: {e}", shape.table))
            })?;
            drop(rows);
            let spooled = match &spool_schema {
                Some(s) => Some(spool::change_rows(&shape, s, &changes)?),
                None => None,
            };
            let columns = changes.history;
            let target = handoff.take().await?;
            let mut file = target.open(&shape, &schema, Some(&columns))?;
            let batch = RecordBatch::try_new(schema, columns)
                .map_err(|e| Error::bug(format!("cannot build a batch of {}: {e}", file.key)))?;
            file.write(&batch).await?;
            // The next buffer's task waits for it (none if this was the last).
            let _ = handed.send(Target::Open(file));
            Ok(spooled)
        }));
        Ok(previous)
    }

    /// Waits for the oldest encoding task: the spool rows of the buffer it
    /// encoded.
    async fn settle_oldest(&mut self) -> Result<Encoded> {
        match self.encoding.pop_front() {
            Some(task) => task.join("the history encoder").await?,
            None => Err(Error::bug("no history buffer is being encoded")),
        }
    }

    fn failed(&self) -> Error {
        Error::bug(format!(
            "the history file of {} was used after it failed",
            self.shape.table
        ))
    }

    /// Writes what is buffered and completes the file: (key, rows, bytes,
    /// the spool rows of its last buffers, in order; `wants_rows` as for
    /// [`HistoryFile::push`]).
    pub async fn finish(
        mut self,
        wants_rows: bool,
    ) -> Result<(String, u64, u64, Vec<spool::ChangeRows>)> {
        let mut spooled: Vec<spool::ChangeRows> =
            self.flush(wants_rows).await?.into_iter().collect();
        while !self.encoding.is_empty() {
            spooled.extend(self.settle_oldest().await?);
        }
        let handoff = self.next.take().ok_or_else(|| self.failed())?;
        let file = handoff
            .take()
            .await?
            .open(&self.shape, &self.schema, None)?;
        let key = file.key.clone();
        let rows = file.rows;
        let bytes = file.finish().await?;
        Ok((key, rows, bytes, spooled))
    }
}

/// `props` (shared with the latest view) for a history file: no
/// statistics for `_key` and `_old`.
///
/// Why: a history file is in seq order, so every row group's keys span
/// about the table's whole range and their min and max prune nothing; and
/// `_old` is JSON, whose text order means nothing. Comparing each value
/// with the running min and max was about 3% of compact's CPU. The latest
/// view, ordered by key, keeps them for `_key`.
pub fn history_properties(props: WriterProperties) -> WriterProperties {
    let mut builder = props.into_builder();
    for column in ["_key", "_old"] {
        builder = builder
            .set_column_statistics_enabled(ColumnPath::from(column), EnabledStatistics::None);
    }
    builder.build()
}

/// Rows of a first buffer from which a column's values are judged.
const DICTIONARY_SAMPLE: usize = 1000;

/// `props` with Parquet's dictionary turned off for the data columns (and
/// `_lsn`) whose values nearly never repeat in a file's first batch
/// (`columns`: the data columns, as the shape lays them out; `lsns`): 90%
/// or more distinct.
///
/// Why: a row group holds 131,072 rows by default, so the dictionary of a
/// column of unique 8-byte values reaches Parquet's 1 MiB limit only at
/// the group's end: every value goes through the writer's interner (9% of
/// compact's CPU in a profile of the benchmark, which has ids, amounts,
/// notes and timestamps that rarely repeat) for a dictionary that is
/// larger than the values it encodes. Columns with repeats (a status, an
/// account number, a transaction's shared LSN) keep it.
///
/// Such a column stored as integers (ids, amounts, timestamps) is delta
/// encoded instead of plain: values bit-packed by their differences, so
/// ids drawn from a million take 3 bytes instead of 8 and timestamps that
/// ascend take one or two. Every reader the layout targets (DuckDB,
/// Athena, Spark, Trino, DataFusion) reads the encoding.
pub fn dictionaries_for(
    props: WriterProperties,
    shape: &TableShape,
    columns: &[ArrayRef],
    lsns: &dyn Array,
) -> WriterProperties {
    if lsns.len() < DICTIONARY_SAMPLE {
        return props;
    }
    let hasher = foldhash::fast::FixedState::default();
    let mut hashes = vec![0u64; lsns.len()];
    let mut rarely_repeats = |values: &dyn Array| {
        hashes.fill(0);
        if create_hashes_with_hasher([values], &hasher, &mut hashes).is_err() {
            return false; // a type it cannot hash: Parquet's default
        }
        let valid = (0..values.len()).filter(|&i| values.is_valid(i));
        let mut seen = std::collections::HashSet::with_capacity(values.len());
        let mut n = 0usize;
        for i in valid {
            n += 1;
            seen.insert(hashes[i]);
        }
        n >= DICTIONARY_SAMPLE && seen.len() * 10 >= n * 9
    };
    let mut builder = props.into_builder();
    for (column, values) in shape.columns.iter().zip(columns) {
        if rarely_repeats(values.as_ref()) {
            let path = || ColumnPath::from(column.name.as_str());
            builder = builder.set_column_dictionary_enabled(path(), false);
            if stored_as_integers(values.data_type()) {
                builder = builder.set_column_encoding(path(), Encoding::DELTA_BINARY_PACKED);
            }
        }
    }
    if rarely_repeats(lsns) {
        builder = builder.set_column_dictionary_enabled(ColumnPath::from("_lsn"), false);
    }
    builder.build()
}

/// Whether Parquet stores values of `data_type` as INT32 or INT64, the
/// types its delta encoding takes.
fn stored_as_integers(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::Date32
            | DataType::Timestamp(..)
    ) || matches!(data_type, DataType::Decimal128(precision, _) if *precision <= 18)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use bytes::Bytes;
    use futures::StreamExt;
    use object_store::memory::InMemory;
    use object_store::multipart::{MultipartStore, PartId};
    use object_store::path::Path as ObjectPath;
    use object_store::{MultipartId, ObjectStore, ObjectStoreExt, PutPayload};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    use super::*;
    use crate::compact::parquet_file::{PART_BYTES, writer_properties};
    use crate::lakehouse::change::ChangeOp;
    use crate::lakehouse::change::TypedChange;
    use crate::lakehouse::columns::change_batch;
    use crate::lakehouse::layout::history_columns;
    use crate::lakehouse::typing::Cell;

    /// The bytes of the file `key` in `output`'s store.
    async fn stored(output: &Output, key: &str) -> Bytes {
        let got = output.store.get(&ObjectPath::from(key)).await.unwrap();
        got.bytes().await.unwrap()
    }

    /// A local output in memory.
    fn memory_output() -> Output {
        Output {
            store: Arc::new(InMemory::new()),
            parts: None,
        }
    }

    /// A history file of `public.t` named `h.parquet` on `output`, with
    /// compact's default properties.
    fn test_file(output: &Output) -> HistoryFile {
        let shape = Arc::new(TableShape::test_t());
        let props = writer_properties(&crate::config::CompactConfig::default());
        HistoryFile::create(output, "h.parquet".into(), shape, props).unwrap()
    }

    /// An insert of `public.t` at `seq` (key and id `seq`) with `doc`.
    fn insert(seq: u64, doc: Cell) -> TypedChange {
        TypedChange {
            op_name: "insert",
            op: ChangeOp::Upsert,
            seq,
            lsn: format!("0/{seq:X}").into(),
            key: Some(format!(r#"{{"id":{seq}}}"#).into()),
            old_key: None,
            cells: vec![Cell::Int(seq as i64), doc],
            old: None,
            unchanged: None,
        }
    }

    /// A batch of one change of `public.t`, as the archive reader gives
    /// an object's (the buffer joins them).
    fn one(change: &TypedChange) -> ChangeBatch {
        change_batch(&TableShape::test_t(), std::slice::from_ref(change))
    }

    /// A column whose values nearly never repeat is written without a
    /// dictionary; one whose values repeat, and `_lsn` shared by a
    /// transaction's changes, keep theirs. `_key` and `_old` have no
    /// statistics.
    #[tokio::test]
    async fn columns_that_rarely_repeat_are_written_without_a_dictionary() {
        let output = memory_output();
        let mut file = test_file(&output);
        for seq in 1..=20_000u64 {
            let mut change = insert(seq, Cell::Str(format!("status {}", seq % 7).into()));
            // Ten changes per transaction: their LSN repeats.
            change.lsn = format!("0/{:X}", seq / 10 * 64).into();
            file.push(one(&change), || false).await.unwrap();
        }
        let (key, rows, _, _) = file.finish(false).await.unwrap();
        assert_eq!(rows, 20_000);
        let bytes = stored(&output, &key).await;
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
        let group = reader.metadata().row_group(0);
        let column = |name: &str| {
            group
                .columns()
                .iter()
                .find(|c| c.column_path().string() == name)
                .unwrap()
        };
        let dictionary = |name: &str| column(name).dictionary_page_offset().is_some();
        assert!(!dictionary("id"));
        assert!(!dictionary("_seq"));
        assert!(dictionary("doc"));
        assert!(dictionary("_lsn"));
        assert!(dictionary("_op"));
        // Integers without a dictionary are delta-encoded (ids, seqs); a
        // text column never is.
        let delta = |name: &str| {
            column(name)
                .encodings()
                .any(|e| e == Encoding::DELTA_BINARY_PACKED)
        };
        assert!(delta("id"));
        assert!(delta("_seq"));
        assert!(!delta("doc"));
        assert!(!delta("_key"));
        // Min and max where they can prune: not for `_key` (seq order) or
        // `_old` (JSON).
        let statistics = |name: &str| column(name).statistics().is_some();
        assert!(statistics("id"));
        assert!(statistics("_seq"));
        assert!(statistics("_lsn"));
        assert!(!statistics("_key"));
        assert!(!statistics("_old"));
        // Under a thousand rows nothing is judged: parquet's defaults.
        let few: Vec<TypedChange> = (1..=999).map(|seq| insert(seq, Cell::Null)).collect();
        let shape = TableShape::test_t();
        let props = writer_properties(&crate::config::CompactConfig::default());
        let columns = history_columns(&shape, &few);
        let judged = dictionaries_for(props, &shape, &columns[..2], columns[4].as_ref());
        assert!(judged.dictionary_enabled(&ColumnPath::from("id")));
    }

    /// The spool rows of every buffer come back once, buffer after buffer
    /// in seq order (the last two from `finish`), and only for the buffers
    /// handed to encoding while the spool wanted them.
    #[tokio::test]
    async fn each_buffers_spool_rows_come_back_once_in_order() {
        let output = memory_output();
        let mut file = test_file(&output);
        let n = 3 * BATCH_ROWS as u64 + 100;
        let mut buffers = Vec::new();
        for seq in 1..=n {
            let change = insert(seq, Cell::Null);
            // The first buffer goes to encoding while the spool combines.
            let wanted = seq > BATCH_ROWS as u64;
            buffers.extend(file.push(one(&change), || wanted).await.unwrap());
        }
        let (_, rows, _, last) = file.finish(true).await.unwrap();
        assert_eq!(rows, n);
        // The full buffers still being encoded, and the rest's.
        assert_eq!(last.len(), ENCODING_DEPTH + 1);
        buffers.extend(last);
        let seqs: Vec<Vec<u64>> = buffers
            .iter()
            .map(|b| {
                let mut seqs = b.seqs();
                seqs.sort();
                seqs
            })
            .collect();
        assert_eq!(seqs.len(), 3);
        let first = BATCH_ROWS as u64 + 1;
        assert_eq!(seqs.concat(), (first..=n).collect::<Vec<u64>>());
    }

    /// Writes `n` changes of `public.t` (`doc` of `doc_bytes` random
    /// letters: incompressible, to make a large file) as one history file
    /// through `output`, and reads back the `_seq` column and the docs.
    async fn write_and_read(output: &Output, n: u64, doc_bytes: usize) -> (Vec<i64>, Vec<String>) {
        let mut file = test_file(output);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut docs = Vec::new();
        for seq in 1..=n {
            let doc: String = std::iter::repeat_with(|| rng.alphanumeric())
                .take(doc_bytes)
                .collect();
            docs.push(doc.clone());
            file.push(one(&insert(seq, Cell::Str(doc.into()))), || false)
                .await
                .unwrap();
        }
        let (key, rows, _, _) = file.finish(false).await.unwrap();
        assert_eq!(rows, n);
        let bytes = stored(output, &key).await;
        let (mut seqs, mut read) = (Vec::new(), Vec::new());
        for batch in ParquetRecordBatchReaderBuilder::try_new(bytes)
            .unwrap()
            .build()
            .unwrap()
        {
            let batch = batch.unwrap();
            let column = batch.column_by_name("_seq").unwrap();
            seqs.extend(column.as_primitive::<Int64Type>().values().iter().copied());
            let column = batch.column_by_name("doc").unwrap().as_string::<i32>();
            read.extend(column.iter().map(|d| d.unwrap().to_string()));
        }
        assert_eq!(read, docs);
        (seqs, read)
    }

    #[tokio::test]
    async fn a_file_of_several_buffers_holds_every_change_once_in_order() {
        let output = memory_output();
        // Past two full buffers: the second waits for the first's encoder.
        let n = 2 * BATCH_ROWS as u64 + 1;
        let (seqs, _) = write_and_read(&output, n, 8).await;
        assert_eq!(seqs, (1..=n as i64).collect::<Vec<_>>());
    }

    /// An in-memory store's multipart interface that fails the first try of
    /// every part and of the completion as a reset connection would, and
    /// refuses part `refuse` for good (as a 403 would).
    #[derive(Debug, Default)]
    struct FirstTryFails {
        inner: Arc<InMemory>,
        refuse: Option<usize>,
        tried: Mutex<HashSet<String>>,
        /// Parts stored: (index, bytes).
        parts: Mutex<Vec<(usize, usize)>>,
        aborted: Mutex<bool>,
    }

    impl FirstTryFails {
        fn first_try(&self, what: String) -> object_store::Result<()> {
            match self.tried.lock().unwrap().insert(what.clone()) {
                true => Err(object_store::Error::Generic {
                    store: "test",
                    source: format!("connection reset during {what}").into(),
                }),
                false => Ok(()),
            }
        }
    }

    #[async_trait::async_trait]
    impl MultipartStore for FirstTryFails {
        async fn create_multipart(&self, path: &ObjectPath) -> object_store::Result<MultipartId> {
            self.inner.create_multipart(path).await
        }

        async fn put_part(
            &self,
            path: &ObjectPath,
            id: &MultipartId,
            part_idx: usize,
            data: PutPayload,
        ) -> object_store::Result<PartId> {
            if self.refuse == Some(part_idx) {
                return Err(object_store::Error::PermissionDenied {
                    path: path.to_string(),
                    source: "refused".into(),
                });
            }
            self.first_try(format!("part {part_idx}"))?;
            let len = data.content_length();
            self.parts.lock().unwrap().push((part_idx, len));
            self.inner.put_part(path, id, part_idx, data).await
        }

        async fn complete_multipart(
            &self,
            path: &ObjectPath,
            id: &MultipartId,
            parts: Vec<PartId>,
        ) -> object_store::Result<object_store::PutResult> {
            self.first_try("completion".into())?;
            self.inner.complete_multipart(path, id, parts).await
        }

        async fn abort_multipart(
            &self,
            path: &ObjectPath,
            id: &MultipartId,
        ) -> object_store::Result<()> {
            *self.aborted.lock().unwrap() = true;
            self.inner.abort_multipart(path, id).await
        }
    }

    #[tokio::test]
    async fn a_large_file_goes_in_parts_each_tried_again_alone() {
        let flaky = Arc::new(FirstTryFails::default());
        let output = Output {
            store: Arc::clone(&flaky.inner) as Arc<dyn ObjectStore>,
            parts: Some(Arc::clone(&flaky) as Arc<dyn MultipartStore>),
        };
        // About 30 MB of random letters: three parts.
        let n = 20_000;
        let (seqs, _) = write_and_read(&output, n, 2000).await;
        assert_eq!(seqs, (1..=n as i64).collect::<Vec<_>>());
        // Each part failed once and was sent again under its own number;
        // all but the last of PART_BYTES exactly.
        let mut parts = flaky.parts.lock().unwrap().clone();
        parts.sort();
        assert!(parts.len() >= 3, "{parts:?}");
        let (last, full) = parts.split_last().unwrap();
        assert!(full.iter().all(|&(_, len)| len == PART_BYTES), "{parts:?}");
        assert!(last.1 > 0 && last.1 <= PART_BYTES, "{parts:?}");
        let indexes: Vec<usize> = parts.iter().map(|p| p.0).collect();
        assert_eq!(indexes, (0..parts.len()).collect::<Vec<_>>());
        assert!(flaky.tried.lock().unwrap().contains("completion"));
        assert!(!*flaky.aborted.lock().unwrap());
    }

    #[tokio::test]
    async fn a_part_refused_for_good_fails_the_file_and_aborts_its_upload() {
        let flaky = Arc::new(FirstTryFails {
            refuse: Some(1),
            ..Default::default()
        });
        let output = Output {
            store: Arc::clone(&flaky.inner) as Arc<dyn ObjectStore>,
            parts: Some(Arc::clone(&flaky) as Arc<dyn MultipartStore>),
        };
        let shape = Arc::new(TableShape::test_t());
        let schema = history_schema(&shape);
        let props = writer_properties(&crate::config::CompactConfig::default());
        let mut file =
            ParquetFile::create(&output, "h.parquet".into(), Arc::clone(&schema), props).unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        let failed = async {
            for start in (1..=20_000u64).step_by(1000) {
                let changes: Vec<TypedChange> = (start..start + 1000)
                    .map(|seq| TypedChange {
                        op_name: "insert",
                        op: ChangeOp::Upsert,
                        seq,
                        lsn: "0/1".into(),
                        key: Some(format!(r#"{{"id":{seq}}}"#).into()),
                        old_key: None,
                        cells: vec![
                            Cell::Int(seq as i64),
                            Cell::Str(
                                std::iter::repeat_with(|| rng.alphanumeric())
                                    .take(2000)
                                    .collect::<String>()
                                    .into(),
                            ),
                        ],
                        old: None,
                        unchanged: None,
                    })
                    .collect();
                let columns = history_columns(&shape, &changes);
                let batch = RecordBatch::try_new(Arc::clone(&schema), columns).unwrap();
                file.write(&batch).await?;
            }
            file.finish().await.map(drop)
        }
        .await;
        // Our error, not a wrapped text: the store's refusal, as such.
        let e = failed.unwrap_err();
        assert!(
            matches!(&e, Error::Store { cause, .. } if matches!(**cause, object_store::Error::PermissionDenied { .. })),
            "{e:?}"
        );
        assert!(*flaky.aborted.lock().unwrap(), "the upload was not aborted");
        let listed: Vec<_> = flaky.inner.list(None).collect().await;
        assert!(listed.is_empty(), "{listed:?}");
    }
}
