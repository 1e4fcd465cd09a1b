//! What a plan's statistics say of a column's values: the smallest and
//! the largest, and the rows they count. The grouping rules size their
//! work by it (see [`super::fanout`] and [`super::densecount`]).

use std::cmp::Ordering;
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::error::Result as DfResult;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, StatisticsArgs, StatisticsContext};

/// A column's smallest and largest values by the statistics, and the rows
/// of the inputs that gave them.
#[derive(Debug, PartialEq)]
pub(crate) struct Bounds {
    pub min: ScalarValue,
    pub max: ScalarValue,
    pub rows: Option<usize>,
}

/// The bounds of column `index` of `plan`. Of a union, over the inputs
/// whose statistics give them: the archive's tables are unions of the
/// compacted files, whose statistics do, and the changes not compacted
/// yet, whose do not (a rule that uses the bounds must count values
/// outside them too). `None` if no input gives them.
pub(crate) fn bounds(plan: &Arc<dyn ExecutionPlan>, index: usize) -> DfResult<Option<Bounds>> {
    if plan.is::<UnionExec>() {
        let mut all: Option<Bounds> = None;
        for input in plan.children() {
            let Some(b) = bounds(input, index)? else {
                continue;
            };
            all = match all {
                None => Some(b),
                Some(a) => {
                    let (Some(low), Some(high)) =
                        (a.min.partial_cmp(&b.min), a.max.partial_cmp(&b.max))
                    else {
                        return Ok(None);
                    };
                    Some(Bounds {
                        min: if low == Ordering::Greater {
                            b.min
                        } else {
                            a.min
                        },
                        max: if high == Ordering::Less { b.max } else { a.max },
                        rows: a.rows.zip(b.rows).map(|(x, y)| x + y),
                    })
                }
            };
        }
        return Ok(all);
    }
    let stats = StatisticsContext::new().compute(plan.as_ref(), &StatisticsArgs::new())?;
    Ok(stats.column_statistics.get(index).and_then(|s| {
        Some(Bounds {
            min: s.min_value.get_value()?.clone(),
            max: s.max_value.get_value()?.clone(),
            rows: stats.num_rows.get_value().copied(),
        })
    }))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::{ParquetReadOptions, SessionContext};
    use parquet::arrow::ArrowWriter;

    use super::*;

    /// Tables `t1 (a)` of 3 and 9, `t2 (a)` of -2, 5 and 4, each a Parquet
    /// file (whose statistics give the bounds).
    async fn session(dir: &std::path::Path) -> SessionContext {
        let ctx = SessionContext::new();
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        for (name, values) in [("t1", vec![3, 9]), ("t2", vec![-2, 5, 4])] {
            let path = dir.join(format!("{name}.parquet"));
            let file = std::fs::File::create(&path).unwrap();
            let mut writer = ArrowWriter::try_new(file, Arc::clone(&schema), None).unwrap();
            let column = Arc::new(Int64Array::from(values));
            let batch = RecordBatch::try_new(Arc::clone(&schema), vec![column]).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
            ctx.register_parquet(name, path.to_str().unwrap(), ParquetReadOptions::default())
                .await
                .unwrap();
        }
        ctx
    }

    /// The plan of `sql`, from its first union down if it has one.
    async fn plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
        let mut node = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let mut at = Arc::clone(&node);
        loop {
            if at.is::<UnionExec>() {
                node = at;
                break;
            }
            match at.children().first() {
                Some(child) => at = Arc::clone(child),
                None => break,
            }
        }
        node
    }

    #[tokio::test]
    async fn a_union_is_bounded_by_its_inputs_that_say() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = session(dir.path()).await;
        let b = |min, max, rows| Bounds {
            min: ScalarValue::Int64(Some(min)),
            max: ScalarValue::Int64(Some(max)),
            rows: Some(rows),
        };
        let union = plan(&ctx, "SELECT a FROM t1 UNION ALL SELECT a FROM t2").await;
        assert!(union.is::<UnionExec>());
        assert_eq!(bounds(&union, 0).unwrap(), Some(b(-2, 9, 5)));
        let single = plan(&ctx, "SELECT a FROM t1").await;
        assert_eq!(bounds(&single, 0).unwrap(), Some(b(3, 9, 2)));
        // An input whose values the statistics do not bound (a computed
        // column) is left out of the union's; alone, it has none.
        let computed = "SELECT a * 100 AS a FROM t2";
        let mixed = plan(&ctx, &format!("SELECT a FROM t1 UNION ALL {computed}")).await;
        assert!(mixed.is::<UnionExec>());
        assert_eq!(
            bounds(&mixed, 0).unwrap().map(|b| (b.min, b.max)),
            Some((ScalarValue::Int64(Some(3)), ScalarValue::Int64(Some(9))))
        );
        assert_eq!(bounds(&plan(&ctx, computed).await, 0).unwrap(), None);
    }
}
