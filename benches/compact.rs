//! Benchmarks of `waltail compact`'s per-change work, on lines like those
//! `scripts/bench-compact.sh` generates (the same table and mix: inserts,
//! updates, one in ten leaving `note` out as unchanged TOAST does, deletes
//! keyed by their old row):
//!
//! ```sql
//! CREATE TABLE public.bench (id bigint PRIMARY KEY, account integer,
//!     amount numeric(12,2), status text, note text, updated_at timestamptz);
//! ```
//!
//! Throughput is in elements, one element being one change:
//!
//! * `compact_parse/bench_lines`: `lakehouse::read::type_line` of one archive
//!   line into a typed change (JSON parse, cell typing, the row key's JSON).
//! * `compact_history/encode`: `history::history_columns` of 8,192 typed
//!   changes into Arrow arrays (`columns::ChangeColumns`, which compact's
//!   parse appends each change to) plus their encoding as one zstd Parquet
//!   row group (the writer properties compact uses), into memory.
//! * `compact_history/spool_rows`: `spool::change_rows` of the same 8,192
//!   changes given their batch (`columns::change_batch`, as the archive
//!   reader builds it): the latest view's spool rows the
//!   history's encoding task builds and orders by partition for a table
//!   spooled change by change.
//! * `compact_merge/spooled_rows`: `latest::merge_bucket` of 65,536 spooled
//!   changes (the bench lines, each under a key of its own) into a latest
//!   view of one bucket: the spool's read-back and one hash lookup per
//!   change (the view points into the spooled batches).
//!
//! Run with `cargo bench --bench compact` (append e.g.
//! `-- --warm-up-time 1 --measurement-time 3` for a quicker run).

use std::hint::black_box;
use std::sync::Arc;

use arrow::array::RecordBatch;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use parquet::arrow::ArrowWriter;
use waltail::archive::schema::{RecordColumn, SchemaRecord};
use waltail::compact::latest::{MergeInput, merge_bucket};
use waltail::compact::parquet_file::writer_properties;
use waltail::compact::spool::{self, Spool};
use waltail::config::CompactConfig;
use waltail::lakehouse::change::TypedChange;
use waltail::lakehouse::columns::change_batch;
use waltail::lakehouse::layout::{history_columns, history_schema};
use waltail::lakehouse::line::Shapes;
use waltail::lakehouse::read::type_line;
use waltail::lakehouse::typing::TableShape;
use waltail::lsn;

// What the binary runs with: compact's costs include its allocations.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const LINES: usize = 8192;

fn shape() -> Arc<TableShape> {
    let col =
        |name: &str, type_name: &str, type_oid: u32, type_modifier: i32, key: bool| RecordColumn {
            name: name.into(),
            type_name: type_name.into(),
            type_oid,
            type_modifier,
            key,
        };
    let record = SchemaRecord {
        table: "public.bench".into(),
        version: 1,
        columns: vec![
            col("id", "bigint", 20, -1, true),
            col("account", "integer", 23, -1, false),
            col("amount", "numeric(12,2)", 1700, ((12 << 16) | 2) + 4, false),
            col("status", "text", 25, -1, false),
            col("note", "text", 25, -1, false),
            col("updated_at", "timestamp with time zone", 1184, -1, false),
        ],
        replica_identity: "default".into(),
    };
    Arc::new(TableShape::from_records("public.bench", &[record]))
}

/// `LINES` archive lines over a quarter as many keys, as the bench script
/// writes them (its generator, in Rust, with a fixed seed).
fn lines() -> Vec<String> {
    let mut rng = fastrand::Rng::with_seed(42);
    let keys = LINES as u64 / 4;
    let mut alive = vec![false; keys as usize + 1];
    (1..=LINES as u64)
        .map(|seq| {
            let k = if seq <= keys { seq } else { rng.u64(1..=keys) };
            let ts = format!(
                "2026-11-01T{:02}:{:02}:{:02}.{:06}+00:00",
                (seq / 3600) % 24,
                (seq / 60) % 60,
                seq % 60,
                seq % 1_000_000
            );
            let row = format!(
                r#""id":{k},"account":{},"amount":{:.2},"status":"s{}""#,
                k % 9973,
                rng.u32(0..=9_999_999) as f64 / 100.0,
                seq % 7
            );
            let note = format!(r#","note":"note {k} {}""#, seq % 13);
            let (op, data, old) = if !alive[k as usize] {
                alive[k as usize] = true;
                ("insert", format!(r#"{{{row}{note},"updated_at":"{ts}"}}"#), "null".to_string())
            } else if rng.f64() < 0.12 {
                alive[k as usize] = false;
                ("delete", "null".to_string(), format!(r#"{{"id":{k}}}"#))
            } else {
                let note = if rng.f64() < 0.1 { "" } else { note.as_str() };
                ("update", format!(r#"{{{row}{note},"updated_at":"{ts}"}}"#), "null".to_string())
            };
            format!(
                r#"{{"op":"{op}","table":"public.bench","data":{data},"old":{old},"seq":{seq},"idempotency_key":"{seq:08x}-0000-5000-8000-000000000000","commit_lsn":"{}"}}"#,
                lsn::display(((seq >> 20) << 32) | ((seq * 64) & 0xFFFF_FFFF))
            )
        })
        .collect()
}

fn typed(shapes: &Shapes, lines: &[String]) -> Vec<TypedChange> {
    lines
        .iter()
        .map(|l| {
            type_line(shapes, l.as_bytes())
                .expect("a valid line")
                .change
                .expect("a compacted table")
                .1
        })
        .collect()
}

fn bench_parse(c: &mut Criterion) {
    let shape = shape();
    let shapes = Shapes::new([Arc::clone(&shape)]);
    let lines = lines();
    // Checks the input is what it claims before timing it.
    let changes = typed(&shapes, &lines);
    assert!(changes.iter().any(|c| c.op_name == "delete"));
    assert!(changes.iter().any(|c| c.unchanged.is_some()));
    let mut g = c.benchmark_group("compact_parse");
    g.throughput(Throughput::Elements(LINES as u64));
    g.bench_function("bench_lines", |b| {
        b.iter(|| {
            for line in &lines {
                black_box(type_line(&shapes, line.as_bytes()).expect("a valid line"));
            }
        })
    });
    g.finish();
}

fn bench_history(c: &mut Criterion) {
    let shape = shape();
    let shapes = Shapes::new([Arc::clone(&shape)]);
    let changes = typed(&shapes, &lines());
    let schema = history_schema(&shape);
    let props = writer_properties(&CompactConfig::default());
    let mut g = c.benchmark_group("compact_history");
    g.throughput(Throughput::Elements(LINES as u64));
    g.bench_function("encode", |b| {
        b.iter(|| {
            let batch =
                RecordBatch::try_new(Arc::clone(&schema), history_columns(&shape, &changes))
                    .expect("the history schema");
            let mut out = Vec::with_capacity(1 << 20);
            let mut w = ArrowWriter::try_new(&mut out, Arc::clone(&schema), Some(props.clone()))
                .expect("a writer");
            w.write(&batch).expect("encoded");
            w.close().expect("closed");
            black_box(out.len())
        })
    });
    let batch = change_batch(&shape, &changes);
    let spool_schema = spool::spool_schema(&shape);
    g.bench_function("spool_rows", |b| {
        b.iter(|| {
            let rows = spool::change_rows(&shape, &spool_schema, &batch);
            black_box(rows.expect("spool rows"))
        })
    });
    g.finish();
}

/// Changes spooled for the merge benchmark.
const SPOOLED: usize = 65_536;

fn bench_merge(c: &mut Criterion) {
    let shape = shape();
    let shapes = Shapes::new([Arc::clone(&shape)]);
    let changes = typed(&shapes, &lines());
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let mut spool = Spool::new(1 << 30).expect("a spool");
    for n in 0..SPOOLED {
        let mut change = changes[n % LINES].clone();
        change.seq = n as u64 + 1;
        change.key = Some(format!(r#"{{"id":{n}}}"#).into());
        change.old_key = None;
        rt.block_on(spool.push(&shape, &Arc::new(change)))
            .expect("spooled");
    }
    rt.block_on(spool.finish()).expect("written");
    let input = MergeInput {
        ctx: waltail::lakehouse::session::session(Arc::new(object_store::memory::InMemory::new())),
        shape: Arc::clone(&shape),
        previous: Vec::new(),
        previous_buckets: 1,
        spool: Arc::new(spool),
        buckets: 1,
        moved: Default::default(),
    };
    let deletes = changes.iter().filter(|c| c.op_name == "delete").count();
    let mut g = c.benchmark_group("compact_merge");
    g.throughput(Throughput::Elements(SPOOLED as u64));
    g.bench_function("spooled_rows", |b| {
        b.iter(|| {
            let view = rt.block_on(merge_bucket(&input, 0, None)).expect("merged");
            // Every key has one change: the deletes leave no row.
            assert_eq!(view.len(), SPOOLED - deletes * (SPOOLED / LINES));
            black_box(view.len())
        })
    });
    g.finish();
}

criterion_group!(benches, bench_parse, bench_history, bench_merge);
criterion_main!(benches);
