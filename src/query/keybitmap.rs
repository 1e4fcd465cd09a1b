//! The keys of a hash join's build side as a bitmap, checked on the probe
//! side before the join looks each row up.
//!
//! A join of a filtered side (the latest view's rows of some accounts) to
//! the history probes every change, and most find nothing: DataFusion's
//! join hashes each row's key and looks it up in its table, for 2% of
//! them to match. When the join is on one integer key and the build side's
//! keys span a range of at most [`MAX_BITS`], `KeyCollectExec` ([`KeyCollect`]) on the
//! build side notes the keys as they pass into the join's table, and
//! `KeyBitmapExec` ([`KeyBitmap`]) on the probe side keeps only the rows whose key is
//! one of them (one bit read per row) before the join sees them. The join
//! takes all of its build side before it reads its probe side, so the
//! bitmap is whole by then; a probe side read before it is (which
//! DataFusion does not do) passes its rows on as they are. The join's
//! answer is the same: the rows taken out are those no build row matches.

use std::sync::{Arc, Mutex, OnceLock};

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::compute::{cast, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type};
use datafusion::common::NullEquality;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result as DfResult;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::logical_expr::JoinType;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::metrics::BaselineMetrics;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::query::operator::{BatchStep, StepExec, integer};

/// The widest range of keys a bitmap covers: 2^26 bits, 8 MiB.
const MAX_BITS: u64 = 1 << 26;

/// The build side's keys, once it has passed whole: `None` inside when
/// they span more than [`MAX_BITS`] (nothing is checked then).
type Published = Arc<OnceLock<Option<Bitmap>>>;

/// Keys from `low` on, one bit each.
#[derive(Debug)]
struct Bitmap {
    low: i64,
    bits: Vec<u64>,
}

impl Bitmap {
    fn of(keys: &[i64]) -> Option<Bitmap> {
        let (Some(&low), Some(&high)) = (keys.iter().min(), keys.iter().max()) else {
            return Some(Bitmap {
                low: 0,
                bits: Vec::new(),
            });
        };
        let span = (high as i128 - low as i128 + 1) as u128;
        if span > u128::from(MAX_BITS) {
            return None;
        }
        let mut bits = vec![0u64; (span as usize).div_ceil(64)];
        for &k in keys {
            let at = (k - low) as usize;
            bits[at / 64] |= 1 << (at % 64);
        }
        Some(Bitmap { low, bits })
    }

    fn has(&self, key: i64) -> bool {
        // Below `low` wraps to a place past the end: one comparison.
        let at = key.wrapping_sub(self.low) as u64;
        self.bits
            .get((at / 64) as usize)
            .is_some_and(|word| word & (1 << (at % 64)) != 0)
    }

    /// Which of `keys` it has, a bit each; null keys (by `nulls`, their
    /// validity) are kept when `nulls_match`, and dropped otherwise.
    fn check(&self, keys: &[i64], nulls: Option<&NullBuffer>, nulls_match: bool) -> BooleanBuffer {
        let found = BooleanBuffer::collect_bool(keys.len(), |i| self.has(keys[i]));
        match (nulls, nulls_match) {
            (None, _) => found,
            (Some(valid), false) => &found & valid.inner(),
            (Some(valid), true) => &found | &!valid.inner(),
        }
    }
}

/// A join key's values as `Int64`, if its type converts exactly.
fn integers(values: &dyn Array) -> DfResult<Option<arrow::array::Int64Array>> {
    use DataType::*;
    match values.data_type() {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 => Ok(Some(
            cast(values, &Int64)?.as_primitive::<Int64Type>().clone(),
        )),
        _ => Ok(None),
    }
}

/// See the module doc.
#[derive(Debug, Default)]
pub(crate) struct KeyBitmapRule;

impl PhysicalOptimizerRule for KeyBitmapRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            let [(left_key, right_key)] = join.on() else {
                return Ok(Transformed::no(node));
            };
            let left = join.left();
            let right = join.right();
            if *join.join_type() != JoinType::Inner
                || *join.partition_mode() != PartitionMode::CollectLeft
                || left.output_partitioning().partition_count() != 1
                || !integer(&left_key.data_type(&left.schema())?)
                || !integer(&right_key.data_type(&right.schema())?)
            {
                return Ok(Transformed::no(node));
            }
            let published: Published = Arc::new(OnceLock::new());
            let collect = Arc::new(StepExec::new(
                Arc::clone(left),
                Arc::clone(left_key),
                Arc::new(KeyCollect {
                    published: Arc::clone(&published),
                }),
            ));
            let check = Arc::new(StepExec::new(
                Arc::clone(right),
                Arc::clone(right_key),
                Arc::new(KeyBitmap {
                    published,
                    nulls_match: join.null_equality() == NullEquality::NullEqualsNull,
                }),
            ));
            let new = join
                .builder()
                .with_new_children(vec![collect, check])?
                .reset_state()
                .build_exec()?;
            Ok(Transformed::yes(new))
        })
        .data()
    }

    fn name(&self) -> &str {
        "waltail_key_bitmap"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Passes the build side on, noting its keys; publishes them as a bitmap
/// when it has passed whole. A [`StepExec`] with it shows as
/// `KeyCollectExec`.
#[derive(Debug)]
struct KeyCollect {
    published: Published,
}

impl BatchStep for KeyCollect {
    fn name(&self) -> &'static str {
        "KeyCollectExec"
    }

    fn renewed(&self) -> Arc<dyn BatchStep> {
        // A new plan: a bitmap no probe side waits for.
        Arc::new(KeyCollect {
            published: Arc::new(OnceLock::new()),
        })
    }

    fn stream(
        &self,
        input: SendableRecordBatchStream,
        key: Arc<dyn PhysicalExpr>,
        baseline: BaselineMetrics,
    ) -> BoxStream<'static, DfResult<RecordBatch>> {
        let published = Arc::clone(&self.published);
        // The keys seen; `None` once one is not an integer.
        let keys: Arc<Mutex<Option<Vec<i64>>>> = Arc::new(Mutex::new(Some(Vec::new())));
        let noted = Arc::clone(&keys);
        input
            .map(move |batch| {
                let note = |batch: RecordBatch| -> DfResult<RecordBatch> {
                    let timer = baseline.elapsed_compute().timer();
                    let values = key.evaluate(&batch)?.into_array(batch.num_rows())?;
                    let mut keys = noted.lock().expect("no panic while noting keys");
                    match (keys.as_mut(), integers(values.as_ref())?) {
                        (Some(keys), Some(values)) => keys.extend(values.iter().flatten()),
                        _ => *keys = None,
                    }
                    timer.done();
                    baseline.record_output(batch.num_rows());
                    Ok(batch)
                };
                Some(batch.and_then(note))
            })
            // At the end, the bitmap, and no batch.
            .chain(futures::stream::once(async move {
                let keys = keys.lock().expect("no panic while noting keys").take();
                let _ = published.set(keys.and_then(|k| Bitmap::of(&k)));
                None
            }))
            .filter_map(futures::future::ready)
            .boxed()
    }
}

/// Keeps the probe side's rows whose key the build side has (see the
/// module doc). A [`StepExec`] with it shows as `KeyBitmapExec`.
#[derive(Debug)]
struct KeyBitmap {
    published: Published,
    /// Whether a null key matches a null one (then rows of null keys stay).
    nulls_match: bool,
}

impl BatchStep for KeyBitmap {
    fn name(&self) -> &'static str {
        "KeyBitmapExec"
    }

    fn renewed(&self) -> Arc<dyn BatchStep> {
        // A new plan: a bitmap never published, so nothing is checked.
        Arc::new(KeyBitmap {
            published: Arc::new(OnceLock::new()),
            nulls_match: self.nulls_match,
        })
    }

    fn stream(
        &self,
        input: SendableRecordBatchStream,
        key: Arc<dyn PhysicalExpr>,
        baseline: BaselineMetrics,
    ) -> BoxStream<'static, DfResult<RecordBatch>> {
        let published = Arc::clone(&self.published);
        let nulls_match = self.nulls_match;
        input
            .map(move |batch| {
                let batch = batch?;
                let Some(Some(bitmap)) = published.get() else {
                    return Ok(batch);
                };
                let timer = baseline.elapsed_compute().timer();
                let values = key.evaluate(&batch)?.into_array(batch.num_rows())?;
                let Some(values) = integers(values.as_ref())? else {
                    return Ok(batch);
                };
                let keep = bitmap.check(values.values(), values.nulls(), nulls_match);
                let out = filter_record_batch(&batch, &BooleanArray::new(keep, None))?;
                timer.done();
                baseline.record_output(out.num_rows());
                Ok(out)
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::query::plans::{plan_and_answer, without_and_with};

    #[test]
    fn a_bitmap_has_its_keys_and_no_other() {
        let keys = [-5, 0, 63, 64, 1_000];
        let bitmap = Bitmap::of(&keys).unwrap();
        for k in -70..1_100 {
            assert_eq!(bitmap.has(k), keys.contains(&k), "{k}");
        }
        assert!(!bitmap.has(i64::MIN) && !bitmap.has(i64::MAX));
        assert!(!Bitmap::of(&[]).unwrap().has(0));
        assert!(Bitmap::of(&[0, MAX_BITS as i64 - 1]).is_some());
        assert!(Bitmap::of(&[0, MAX_BITS as i64]).is_none());
        assert!(Bitmap::of(&[i64::MIN, i64::MAX]).is_none());
        // Keys at the ends of i64: a difference that wraps is still out.
        let high = Bitmap::of(&[i64::MAX - 3, i64::MAX]).unwrap();
        assert!(high.has(i64::MAX) && high.has(i64::MAX - 3) && !high.has(i64::MAX - 1));
        assert!(!high.has(i64::MIN) && !high.has(i64::MIN + 2) && !high.has(0));
        let low = Bitmap::of(&[i64::MIN, i64::MIN + 2]).unwrap();
        assert!(low.has(i64::MIN) && low.has(i64::MIN + 2) && !low.has(i64::MIN + 1));
        assert!(!low.has(i64::MAX) && !low.has(-1) && !low.has(0));
    }

    #[test]
    fn a_check_keeps_null_keys_only_when_nulls_match() {
        let bitmap = Bitmap::of(&[1, 3]).unwrap();
        let keys = arrow::array::Int64Array::from(vec![Some(1), None, Some(2), Some(3), None]);
        let kept = |nulls_match| -> Vec<bool> {
            bitmap
                .check(keys.values(), keys.nulls(), nulls_match)
                .iter()
                .collect()
        };
        assert_eq!(kept(false), [true, false, false, true, false]);
        assert_eq!(kept(true), [true, true, false, true, true]);
        // No validity: every key is checked as it is.
        assert_eq!(
            bitmap
                .check(&[0, 1, 3, 4], None, false)
                .iter()
                .collect::<Vec<_>>(),
            [false, true, true, false]
        );
    }

    /// `l (id, account, name)`: 300 rows, ids -300..=597 by 3; `h (id,
    /// amount)`: 3,000 rows, ids -1,000..1,000 and nulls, and a few far
    /// outside the range; in two sessions, one with the rule.
    fn sessions() -> (SessionContext, SessionContext) {
        let latest = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, true),
                Field::new("account", DataType::Int64, false),
                Field::new("name", DataType::Utf8, false),
            ])),
            vec![
                Arc::new(Int64Array::from_iter(
                    (0..300).map(|i| (i != 7).then_some(i * 3 - 300)),
                )),
                Arc::new(Int64Array::from_iter_values((0..300).map(|i| i % 50))),
                Arc::new(StringArray::from_iter_values(
                    (0..300).map(|i| format!("n{}", i % 40)),
                )),
            ],
        )
        .unwrap();
        let history = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, true),
                Field::new("amount", DataType::Int64, false),
                Field::new("name", DataType::Utf8, false),
            ])),
            vec![
                Arc::new(Int64Array::from_iter((0..3_000).map(|i| match i % 97 {
                    0 => None,
                    1 => Some(i64::MAX - i),
                    _ => Some((i * 7) % 2_000 - 1_000),
                }))),
                Arc::new(Int64Array::from_iter_values(0..3_000)),
                Arc::new(StringArray::from_iter_values(
                    (0..3_000).map(|i| format!("n{}", i % 60)),
                )),
            ],
        )
        .unwrap();
        let (plain, with) = without_and_with(Arc::new(KeyBitmapRule));
        for ctx in [&plain, &with] {
            ctx.register_batch("l", latest.clone()).unwrap();
            ctx.register_batch("h", history.clone()).unwrap();
        }
        (plain, with)
    }

    /// Inner joins on one integer key check the probe side's keys against
    /// the build side's, with the answers of the plan without the rule
    /// (null keys, keys outside the build side's range, a filtered build
    /// side, a build side whose keys span too much to check); joins that
    /// are not inner, or on text, keep their plans.
    #[tokio::test]
    async fn the_probe_side_keeps_the_rows_whose_key_the_build_side_has() {
        let (plain, ctx) = sessions();
        let checked = [
            "SELECT l.account, count(*), sum(h.amount) FROM l JOIN h ON h.id = l.id \
             GROUP BY l.account ORDER BY l.account",
            "SELECT l.account, count(*), sum(h.amount) FROM l JOIN h ON h.id = l.id \
             WHERE l.account < 5 GROUP BY l.account ORDER BY l.account",
            "SELECT count(*), sum(x.amount) FROM h x JOIN h y ON x.id = y.id WHERE y.amount < 500",
        ];
        for sql in checked {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            assert!(plan.contains("KeyBitmapExec"), "{sql}: {plan}");
            assert!(plan.contains("KeyCollectExec"), "{sql}: {plan}");
            let (_, plain_answer) = plan_and_answer(&plain, sql).await;
            assert_eq!(answer, plain_answer, "{sql}");
            assert!(answer.lines().count() > 4, "{answer}");
        }
        // The probe side's rows that reach the join: those of the build
        // side's keys only (of 3,000).
        let (_, analyzed) = plan_and_answer(&ctx, &format!("EXPLAIN ANALYZE {}", checked[1])).await;
        let passed: usize = analyzed
            .split("KeyBitmapExec: id@0, metrics=[output_rows=")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{analyzed}"));
        assert!(passed > 0 && passed < 300, "{passed}: {analyzed}");
        let kept = [
            "SELECT count(*) FROM l LEFT JOIN h ON h.id = l.id",
            "SELECT count(*) FROM l JOIN h ON h.name = l.name",
        ];
        for sql in kept {
            let (plan, answer) = plan_and_answer(&ctx, sql).await;
            let (plain_plan, plain_answer) = plan_and_answer(&plain, sql).await;
            assert_eq!(plan, plain_plan, "{sql}");
            assert_eq!(answer, plain_answer, "{sql}");
        }
    }
}
