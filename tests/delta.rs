//! The Delta tables `compact::commit` commits, read by readers we did not
//! write: DuckDB's Delta extension and the `deltalake` package (PyPI, see
//! scripts/duckdb.sh and tests/readers/delta.py). Every column kind compact
//! writes, the protocol each table needs, a replace (remove + add) and time
//! travel to the version before it.

mod common;

use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, Int16Array, Int64Array, StringArray,
    TimestampMicrosecondArray,
};
use arrow::record_batch::RecordBatch;
use common::read_delta;
use object_store::ObjectStore;
use parquet::arrow::ArrowWriter;
use serde_json::{Value, json};
use waltail::compact::commit::Commit;
use waltail::config::DestinationConfig;
use waltail::lakehouse::delta::{self, DataFile, Location, Role};
use waltail::lakehouse::layout::latest_schema;
use waltail::lakehouse::typing::{Column, Kind, TableShape};

fn shape() -> TableShape {
    let col = |name: &str, kind| Column {
        name: name.into(),
        kind,
    };
    TableShape {
        table: "public.t".into(),
        columns: vec![
            col("id", Kind::Int64),
            col("small", Kind::Int16),
            col(
                "amount",
                Kind::Decimal {
                    precision: 10,
                    scale: 2,
                },
            ),
            col("at", Kind::TimestampTz),
            col("local", Kind::Timestamp),
            col("day", Kind::Date),
            col("doc", Kind::Text),
            col("flag", Kind::Bool),
        ],
        key: vec![0],
    }
}

/// Rows `ids` of the latest view as one Parquet file; returns its size.
fn write_file(path: &Path, shape: &TableShape, ids: &[i64]) -> u64 {
    let n = ids.len();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids.to_vec())),
        Arc::new(Int16Array::from(vec![7i16; n])),
        Arc::new(
            Decimal128Array::from(
                ids.iter()
                    .map(|i| (i * 100 + 5) as i128)
                    .collect::<Vec<_>>(),
            )
            .with_precision_and_scale(10, 2)
            .unwrap(),
        ),
        Arc::new(
            TimestampMicrosecondArray::from(vec![1_764_633_600_000_000i64; n]).with_timezone("UTC"),
        ),
        Arc::new(TimestampMicrosecondArray::from(
            vec![1_764_633_600_000_000i64; n],
        )),
        Arc::new(Date32Array::from(vec![20_424; n])),
        Arc::new(StringArray::from(
            ids.iter().map(|i| format!("doc {i}")).collect::<Vec<_>>(),
        )),
        Arc::new(BooleanArray::from(vec![true; n])),
        Arc::new(Int64Array::from(
            ids.iter().map(|i| i + 1000).collect::<Vec<_>>(),
        )),
        Arc::new(StringArray::from(vec!["0/16B3748"; n])),
        Arc::new(StringArray::from(
            ids.iter()
                .map(|i| format!("{{\"id\":{i}}}"))
                .collect::<Vec<_>>(),
        )),
    ];
    let batch = RecordBatch::try_new(latest_schema(shape), columns).unwrap();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    std::fs::metadata(path).unwrap().len()
}

/// The Delta location of an archive in the folder `root`.
fn folder(root: &Path) -> Location {
    let dest = DestinationConfig::File {
        path: root.to_path_buf(),
        prefix: None,
    };
    let store: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(root).unwrap());
    Location::new(&dest, &store).unwrap()
}

fn row(id: i64) -> Value {
    json!([
        id,
        7,
        format!("{}.05", id),
        "2025-12-02T00:00:00.000000+00:00",
        "2025-12-02T00:00:00.000000",
        "2025-12-02",
        format!("doc {id}"),
        true,
        id + 1000,
        "0/16B3748",
        format!("{{\"id\":{id}}}")
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replaced_latest_view_is_read_whole_and_as_it_was_by_duckdb_and_deltalake() {
    let dir = tempfile::tempdir().unwrap();
    let loc = folder(dir.path());
    let shape = shape();
    let app = delta::app_id("p", "public.t");
    let table = dir.path().join("latest/public/t");
    let file = |name: &str, ids: &[i64]| DataFile {
        path: name.into(),
        size: write_file(&table.join(name), &shape, ids),
        rows: ids.len() as u64,
        date: None,
    };
    let commit = |seq, adds, removes| Commit {
        shape: &shape,
        role: Role::Latest,
        app_id: &app,
        seq,
        adds,
        removes,
        buckets: 1,
        info: vec![],
        txns: vec![],
    };
    let v0 = commit(
        10,
        vec![file("a.parquet", &[1, 2]), file("b.parquet", &[3])],
        vec![],
    );
    waltail::compact::commit::commit(&loc, "public/t", None, v0)
        .await
        .unwrap();
    let before = delta::load(&loc, Role::Latest, "public/t", &app)
        .await
        .unwrap()
        .unwrap();
    let v1 = commit(
        20,
        vec![file("c.parquet", &[1, 2, 4])],
        vec!["a.parquet".into()],
    );
    assert_eq!(
        waltail::compact::commit::commit(&loc, "public/t", Some(&before), v1)
            .await
            .unwrap(),
        1
    );

    for engine in ["duckdb", "deltalake"] {
        let (header, rows) = read_delta(engine, &table, None);
        assert_eq!(rows, [row(1), row(2), row(3), row(4)], "{engine}");
        assert_eq!(header["version"], 1, "{engine}");
        assert_eq!(
            header["columns"],
            json!([
                "id", "small", "amount", "at", "local", "day", "doc", "flag", "_seq", "_lsn",
                "_key"
            ]),
            "{engine}"
        );
        let (_, rows) = read_delta(engine, &table, Some(0));
        assert_eq!(rows, [row(1), row(2), row(3)], "{engine} at version 0");
    }
    // `timestamp without time zone` is Delta's timestamp_ntz: the one
    // column that needs reader 3 / writer 7.
    let (header, _) = read_delta("deltalake", &table, None);
    assert_eq!(header["protocol"], json!([3, 7]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_history_partitioned_by_date_is_read_with_its_dates_by_duckdb_and_deltalake() {
    use waltail::lakehouse::layout::history_schema;
    let dir = tempfile::tempdir().unwrap();
    let loc = folder(dir.path());
    let mut shape = shape();
    shape.columns.truncate(1);
    let app = delta::app_id("p", "public.t");
    let table = dir.path().join("parquet/public/t");
    let mut adds = Vec::new();
    for (date, seq) in [("2026-12-01", 1i64), ("2026-12-02", 2)] {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(vec![seq * 10])),
            Arc::new(StringArray::from(vec!["insert"])),
            Arc::new(Int64Array::from(vec![seq])),
            Arc::new(StringArray::from(vec!["0/1"])),
            Arc::new(StringArray::from(vec![Some("{}")])),
            Arc::new(StringArray::from(vec![None::<&str>])),
            Arc::new(StringArray::from(vec![None::<&str>])),
        ];
        let batch = RecordBatch::try_new(history_schema(&shape), columns).unwrap();
        let name = format!("date={date}/{seq}-{seq}-abcd0123.parquet");
        let path = table.join(&name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), batch.schema(), None)
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        adds.push(DataFile {
            path: name,
            size: std::fs::metadata(&path).unwrap().len(),
            rows: 1,
            date: Some(date.into()),
        });
    }
    let commit = Commit {
        shape: &shape,
        role: Role::History,
        app_id: &app,
        seq: 2,
        adds,
        removes: vec![],
        buckets: 1,
        info: vec![],
        txns: vec![],
    };
    waltail::compact::commit::commit(&loc, "public/t", None, commit)
        .await
        .unwrap();
    for engine in ["duckdb", "deltalake"] {
        let (header, rows) = read_delta(engine, &table, None);
        assert_eq!(
            rows,
            [
                json!([10, "insert", 1, "0/1", "{}", null, null, "2026-12-01"]),
                json!([20, "insert", 2, "0/1", "{}", null, null, "2026-12-02"]),
            ],
            "{engine}"
        );
        assert_eq!(header["columns"][7], "date", "{engine}");
    }
    // No timestamp without time zone: the lowest protocol.
    let (header, _) = read_delta("deltalake", &table, None);
    assert_eq!(header["protocol"], json!([1, 2]));
}
