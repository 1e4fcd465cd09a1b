//! Benchmarks of the per-change hot path, from pgoutput bytes to envelope
//! lines. Every input is built by hand as Postgres sends it (pgoutput
//! protocol v1, text-format tuples, the session settings waltail sets) for a
//! table
//!
//! ```sql
//! CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text, status text,
//!     total numeric(12,2), items jsonb, placed_at timestamptz, tags text[]);
//! ```
//!
//! Throughput is reported in elements, one element being one change (row):
//!
//! * `pgoutput_decode/{insert,update}`: `source::pgoutput::decode` of one
//!   Insert (or Update without old tuple) message into a `LogicalMessage`.
//! * `row_to_json/orders`: rendering one decoded row as a JSON object,
//!   `source::types::write_json` per column value (plus the `"name":` keys
//!   and separators), into a reused buffer.
//! * `source_decoder/begin_100_inserts_commit`: `source::stream::Decoder::handle`
//!   over Begin, 100 Inserts, Commit, each wrapped as
//!   `ReplicationMessage::XLogData`: decoding, row rendering, row hashing and
//!   `Change` construction end to end (the Relation is cached beforehand).
//! * `batch_build/100_changes`: `batch::Batcher::push` of 100 pre-rendered
//!   `envelope::Change`s with `batch_size` 100, so each iteration fills and
//!   cuts one batch: envelope lines, idempotency keys, row and table sets.
//! * `batch_build/1000_reads`: the same for a backfill's object, 1,000
//!   `read` events of different rows in one batch.
//!
//! Run with `cargo bench --bench hot_path` (append e.g.
//! `-- --warm-up-time 1 --measurement-time 3` for a quicker run, or a filter
//! such as `-- source_decoder`).

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use waltail::archive::envelope::{self, Change};
use waltail::batch::{Batch, Batcher, Cut};
use waltail::source::pgoutput::{self, ColumnValue, LogicalMessage};
use waltail::source::replication::ReplicationMessage;
use waltail::source::stream::{Decoder, SourceEvent};
use waltail::source::types;

const REL_ID: u32 = 16_421;
const FINAL_LSN: u64 = 0x16_B374_D848;
const END_LSN: u64 = 0x16_B374_F0A0;
/// 2024-02-23 09:20:00 UTC, in microseconds since 2000-01-01.
const COMMIT_TS: i64 = 762_002_400_000_000;
const CHANGES_PER_TXN: usize = 100;
/// `read` events per object, backfill's default (`backfill.batch_size`).
const READS_PER_OBJECT: usize = 1000;

/// (flags, name, type oid, type modifier) of `public.orders`, as in its
/// Relation message. `numeric(12,2)` has typmod ((12 << 16) | 2) + 4.
const COLUMNS: [(u8, &str, u32, i32); 7] = [
    (1, "id", types::INT8, -1),
    (0, "customer", types::TEXT, -1),
    (0, "status", types::TEXT, -1),
    (0, "total", types::NUMERIC, ((12 << 16) | 2) + 4),
    (0, "items", types::JSONB, -1),
    (0, "placed_at", types::TIMESTAMPTZ, -1),
    (0, "tags", types::TEXT_ARRAY, -1),
];

// ---- pgoutput wire encoding (protocol v1, big-endian) ----

fn put_cstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(0);
}

/// TupleData with every column in text format (`'t'`, Int32 length, bytes).
fn put_text_tuple(out: &mut Vec<u8>, values: &[String]) {
    out.extend_from_slice(&(values.len() as u16).to_be_bytes());
    for v in values {
        out.push(b't');
        out.extend_from_slice(&(v.len() as i32).to_be_bytes());
        out.extend_from_slice(v.as_bytes());
    }
}

fn relation_msg() -> Bytes {
    let mut o = vec![b'R'];
    o.extend_from_slice(&REL_ID.to_be_bytes());
    put_cstr(&mut o, "public");
    put_cstr(&mut o, "orders");
    o.push(b'd'); // REPLICA IDENTITY DEFAULT (the primary key)
    o.extend_from_slice(&(COLUMNS.len() as u16).to_be_bytes());
    for (flags, name, oid, typmod) in COLUMNS {
        o.push(flags);
        put_cstr(&mut o, name);
        o.extend_from_slice(&oid.to_be_bytes());
        o.extend_from_slice(&typmod.to_be_bytes());
    }
    Bytes::from(o)
}

fn begin_msg() -> Bytes {
    let mut o = vec![b'B'];
    o.extend_from_slice(&FINAL_LSN.to_be_bytes());
    o.extend_from_slice(&COMMIT_TS.to_be_bytes());
    o.extend_from_slice(&774_129u32.to_be_bytes());
    Bytes::from(o)
}

fn commit_msg() -> Bytes {
    let mut o = vec![b'C', 0];
    o.extend_from_slice(&FINAL_LSN.to_be_bytes());
    o.extend_from_slice(&END_LSN.to_be_bytes());
    o.extend_from_slice(&COMMIT_TS.to_be_bytes());
    Bytes::from(o)
}

/// The text output of one `orders` row, varied by `i` (jsonb as the server
/// prints it, timestamptz with `TimeZone=UTC`, a text[] with a quoted element).
fn order_values(i: usize, status: &str) -> Vec<String> {
    const CUSTOMERS: [&str; 4] = [
        "Acme Corp",
        "Müller & Söhne GmbH",
        "O'Brien \"Bob\" Ltd",
        "北京贸易有限公司",
    ];
    let qty = i % 5 + 1;
    vec![
        (1_000_000 + i).to_string(),
        CUSTOMERS[i % CUSTOMERS.len()].to_string(),
        status.to_string(),
        format!("{}.{:02}", 19 * qty + i % 100, (i * 37) % 100),
        format!(
            r#"[{{"qty": {qty}, "sku": "A-{:04}", "price": 19.95}}, {{"qty": 1, "sku": "GIFT-WRAP", "price": 2.50, "note": "for mum\n"}}]"#,
            i % 1000
        ),
        format!(
            "2024-02-23 09:{:02}:{:02}.{:06}+00",
            i / 60 % 60,
            i % 60,
            (i * 7919) % 1_000_000
        ),
        r#"{priority,"gift wrap",web}"#.to_string(),
    ]
}

fn insert_msg(i: usize) -> Bytes {
    let mut o = vec![b'I'];
    o.extend_from_slice(&REL_ID.to_be_bytes());
    o.push(b'N');
    put_text_tuple(&mut o, &order_values(i, "placed"));
    Bytes::from(o)
}

/// An Update that keeps the key: with REPLICA IDENTITY DEFAULT the server
/// sends only the new tuple.
fn update_msg(i: usize) -> Bytes {
    let mut o = vec![b'U'];
    o.extend_from_slice(&REL_ID.to_be_bytes());
    o.push(b'N');
    put_text_tuple(&mut o, &order_values(i, "shipped"));
    Bytes::from(o)
}

fn xlog(data: Bytes) -> ReplicationMessage {
    ReplicationMessage::XLogData {
        wal_start: FINAL_LSN,
        wal_end: END_LSN,
        server_clock: COMMIT_TS,
        data,
    }
}

/// Runs one transaction through a fresh decoder and returns its changes.
fn decoded_changes() -> Vec<Change> {
    let mut decoder =
        Decoder::new(0, &std::env::temp_dir().join("waltail-bench-spill")).expect("decoder");
    let mut events = Vec::new();
    decoder
        .handle(xlog(relation_msg()), &mut events)
        .expect("relation");
    decoder.handle(xlog(begin_msg()), &mut events).unwrap();
    for i in 0..CHANGES_PER_TXN {
        decoder.handle(xlog(insert_msg(i)), &mut events).unwrap();
    }
    decoder.handle(xlog(commit_msg()), &mut events).unwrap();
    // Schema, Begin, the changes, Commit.
    assert_eq!(events.len(), CHANGES_PER_TXN + 3);
    events
        .into_iter()
        .filter_map(|e| match e {
            SourceEvent::Change(c) => Some(c),
            _ => None,
        })
        .collect()
}

/// Checks once, outside the measurements, that the inputs take the paths a
/// real stream takes (typed JSON values, not the raw-text fallbacks).
fn check_rendering(changes: &[Change]) {
    for c in changes {
        let row: serde_json::Value =
            serde_json::from_slice(c.data.as_deref().expect("insert has data")).unwrap();
        assert!(row["id"].is_i64(), "{row}");
        assert!(row["total"].is_number(), "{row}");
        assert!(row["items"].is_array(), "{row}");
        assert!(row["tags"].is_array(), "{row}");
        let ts = row["placed_at"].as_str().unwrap();
        assert!(ts.contains('T') && ts.ends_with("+00:00"), "{row}");
    }
}

fn bench_pgoutput_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("pgoutput_decode");
    g.throughput(Throughput::Elements(1));
    let insert = insert_msg(1);
    assert!(matches!(
        pgoutput::decode(insert.clone()),
        Ok(LogicalMessage::Insert { .. })
    ));
    g.bench_function("insert", |b| {
        b.iter(|| pgoutput::decode(black_box(insert.clone())).unwrap())
    });
    let update = update_msg(1);
    assert!(matches!(
        pgoutput::decode(update.clone()),
        Ok(LogicalMessage::Update { old: None, .. })
    ));
    g.bench_function("update", |b| {
        b.iter(|| pgoutput::decode(black_box(update.clone())).unwrap())
    });
    g.finish();
}

fn bench_row_to_json(c: &mut Criterion) {
    let LogicalMessage::Insert { new, .. } = pgoutput::decode(insert_msg(1)).unwrap() else {
        unreachable!("an Insert message");
    };
    let values: Vec<&[u8]> = new
        .0
        .iter()
        .map(|v| match v {
            ColumnValue::Text(t) => t.as_ref(),
            other => panic!("expected text, got {other:?}"),
        })
        .collect();
    let keys: Vec<Vec<u8>> = COLUMNS
        .iter()
        .map(|(_, name, _, _)| {
            let mut k = Vec::new();
            types::write_json_str(&mut k, name);
            k.push(b':');
            k
        })
        .collect();
    let render = |out: &mut Vec<u8>| {
        out.clear();
        out.push(b'{');
        for (i, ((_, _, oid, _), text)) in COLUMNS.iter().zip(&values).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&keys[i]);
            types::write_json(out, *oid, black_box(text));
        }
        out.push(b'}');
    };
    let mut out = Vec::with_capacity(512);
    render(&mut out);
    let row: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert!(row["total"].is_number() && row["items"].is_array(), "{row}");

    let mut g = c.benchmark_group("row_to_json");
    g.throughput(Throughput::Elements(1));
    g.bench_function("orders", |b| {
        b.iter(|| {
            render(&mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

fn bench_source_decoder(c: &mut Criterion) {
    check_rendering(&decoded_changes());
    let begin = begin_msg();
    let commit = commit_msg();
    let inserts: Vec<Bytes> = (0..CHANGES_PER_TXN).map(insert_msg).collect();
    let mut decoder =
        Decoder::new(0, &std::env::temp_dir().join("waltail-bench-spill")).expect("decoder");
    let mut events = Vec::with_capacity(CHANGES_PER_TXN + 2);
    decoder
        .handle(xlog(relation_msg()), &mut events)
        .expect("relation");

    let mut g = c.benchmark_group("source_decoder");
    g.throughput(Throughput::Elements(CHANGES_PER_TXN as u64));
    g.bench_function("begin_100_inserts_commit", |b| {
        b.iter(|| {
            events.clear();
            decoder.handle(xlog(begin.clone()), &mut events).unwrap();
            for data in &inserts {
                decoder.handle(xlog(data.clone()), &mut events).unwrap();
            }
            decoder.handle(xlog(commit.clone()), &mut events).unwrap();
            black_box(events.len())
        })
    });
    g.finish();
}

/// Pushes `changes` through `batcher`, numbered on from `seq`: they must
/// fill exactly one batch, which is returned.
fn fill(batcher: &mut Batcher, changes: &[Change], seq: &mut u64) -> Batch {
    let mut cut = None;
    for change in changes {
        *seq += 1;
        cut = batcher.push(*seq, black_box(change));
    }
    match cut {
        Some(Cut::Ready(batch)) => batch,
        other => panic!("expected a full batch, got {other:?}"),
    }
}

fn bench_batch_build(c: &mut Criterion) {
    let changes = decoded_changes();
    let namespace = envelope::pipeline_namespace("bench");
    let batcher = || {
        Batcher::new(
            CHANGES_PER_TXN,
            Duration::from_secs(60),
            namespace,
            Vec::new(),
        )
    };
    let (mut streamed, mut seq) = (batcher(), 0u64);
    let batch = fill(&mut streamed, &changes, &mut seq);
    assert_eq!(batch.changes(), CHANGES_PER_TXN as u64);
    for line in batch.body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        serde_json::from_slice::<serde_json::Value>(line).unwrap();
    }

    let mut g = c.benchmark_group("batch_build");
    g.throughput(Throughput::Elements(CHANGES_PER_TXN as u64));
    g.bench_function("100_changes", |b| {
        b.iter(|| fill(&mut streamed, &changes, &mut seq))
    });

    // A backfill's object: 1,000 `read` events of 1,000 different rows.
    let reads: Vec<Change> = (0..READS_PER_OBJECT as u64 / CHANGES_PER_TXN as u64)
        .flat_map(|round| {
            changes.iter().map(move |c| Change {
                op: envelope::Op::Read,
                rows: envelope::RowSet::one(c.rows.as_slice()[0] ^ round),
                ..c.clone()
            })
        })
        .collect();
    let (mut reader, mut read_seq) = (batcher().with_read_batch_size(READS_PER_OBJECT), 0u64);
    let batch = fill(&mut reader, &reads, &mut read_seq);
    assert_eq!(batch.rows.len(), READS_PER_OBJECT);
    g.throughput(Throughput::Elements(READS_PER_OBJECT as u64));
    g.bench_function("1000_reads", |b| {
        b.iter(|| fill(&mut reader, &reads, &mut read_seq))
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_pgoutput_decode,
    bench_row_to_json,
    bench_source_decoder,
    bench_batch_build
);
criterion_main!(benches);
