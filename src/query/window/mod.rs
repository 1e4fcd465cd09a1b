//! `lag`, `lead` and `row_number` over a key's versions, computed a batch
//! at a time rather than a partition at a time.
//!
//! The query a history is read for most is each key's versions in order:
//! the gap to the version before (`lag`), the one after (`lead`), the n-th
//! (`row_number`). DataFusion 55 runs such a window with one state per
//! window partition: for every key it makes a batch of that key's rows, a
//! state and an evaluator for each function, and joins the results again.
//! With a handful of versions per key, that costs several times the work
//! itself (see docs/performance.md#query). Over input sorted by the
//! partition keys these three functions need only the rows next to each
//! one, so [`KeyWindowExec`] computes them with array kernels over each
//! batch (with a few rows carried across batch boundaries), whatever the
//! number of keys.
//!
//! [`KeyWindowRule`] replaces a logical `Window` whose every function is
//! one of these (offsets literal and at most [`MAX_OFFSET`], `RESPECT
//! NULLS`, no `FILTER`), all over the same `PARTITION BY` and `ORDER BY`,
//! keys of a type compared exactly (see [`exact_key`]), with a
//! [`KeyWindow`] node; [`KeyWindowPlanner`] plans it as a [`KeyWindowExec`]
//! that requires what DataFusion's window operator requires (its input
//! hash-partitioned on the keys and sorted by them and then the order),
//! so DataFusion adds the same sort and repartitioning. When the order is
//! one integer, date or timestamp, the sort is by one number per row
//! instead ([`order`]: the key's number, then the value), which DataFusion
//! sorts several times faster. Any other window is left to DataFusion.
//! Memory: an input batch and at most [`MAX_OFFSET`] rows on each side of
//! it, whatever a partition's size; with the sort by number, also the rows
//! of keys whose numbers collide (see [`collide`]), until they are read.

mod collide;
mod exec;
mod hashed;
mod order;
mod walk;

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{DFSchemaRef, ScalarValue};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::logical_expr::expr::{NullTreatment, WindowFunction, WindowFunctionParams};
use datafusion::logical_expr::{
    ExprSchemable, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
    Window, WindowFunctionDefinition,
};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use datafusion::physical_expr::PhysicalSortExpr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};
use datafusion::prelude::Expr;

use self::exec::{KeyWindowExec, Shift};
use self::hashed::HashedWindowExec;
use self::order::{KeyOrderExec, orderable};

/// The largest `lag`/`lead` offset computed here: the rows carried from
/// one batch to the next. A larger one is left to DataFusion.
pub(crate) const MAX_OFFSET: i64 = 1024;

/// What the rule found in a `Window`'s function: its kind and, for
/// `lag`/`lead`, the value's expression; `None` for anything else.
fn shift_of(expr: &Expr, input: &LogicalPlan) -> Option<(Shift, Option<Expr>)> {
    let Expr::WindowFunction(w) = expr else {
        return None;
    };
    let WindowFunction {
        fun: WindowFunctionDefinition::WindowUDF(udf),
        params:
            WindowFunctionParams {
                args,
                filter: None,
                null_treatment,
                distinct: false,
                ..
            },
    } = w.as_ref()
    else {
        return None;
    };
    if null_treatment.is_some_and(|n| n != NullTreatment::RespectNulls) {
        return None;
    }
    let literal = |e: &Expr| match e {
        Expr::Literal(v, _) => Some(v.clone()),
        _ => None,
    };
    match (udf.name(), args.as_slice()) {
        ("row_number", []) => Some((Shift::RowNumber, None)),
        (name @ ("lag" | "lead"), [value, rest @ ..]) if rest.len() <= 2 => {
            let offset = match rest.first() {
                None => 1,
                Some(e) => match literal(e)?.cast_to(&DataType::Int64).ok()? {
                    ScalarValue::Int64(Some(n)) => n,
                    _ => return None,
                },
            };
            if !(0..=MAX_OFFSET).contains(&offset) {
                return None;
            }
            let data_type = value.get_type(input.schema()).ok()?;
            let default = match rest.get(1) {
                None => ScalarValue::try_from(&data_type).ok()?,
                Some(e) => literal(e)?.cast_to(&data_type).ok()?,
            };
            let offset = if name == "lag" { -offset } else { offset };
            Some((Shift::Row { offset, default }, Some(value.clone())))
        }
        _ => None,
    }
}

/// Whether rows of a partition key of this type are compared here as
/// DataFusion's window compares them: exactly, nulls equal. The types a
/// table's key or a text key has; floating point keys (NaN and -0.0 have
/// their own rules), intervals, dictionaries and nested types are left to
/// DataFusion.
fn exact_key(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Boolean
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
            | Decimal32(..)
            | Decimal64(..)
            | Decimal128(..)
            | Decimal256(..)
            | Date32
            | Date64
            | Time32(_)
            | Time64(_)
            | Timestamp(..)
            | Utf8
            | LargeUtf8
            | Utf8View
            | Binary
            | LargeBinary
            | BinaryView
            | FixedSizeBinary(_)
    )
}

/// The window's functions if the operator computes all of them.
fn supported(window: &Window) -> bool {
    let input = window.input.as_ref();
    let mut spec: Option<(&[Expr], &[datafusion::logical_expr::SortExpr])> = None;
    for expr in &window.window_expr {
        if shift_of(expr, input).is_none() {
            return false;
        }
        let Expr::WindowFunction(w) = expr else {
            return false;
        };
        let here = (
            w.params.partition_by.as_slice(),
            w.params.order_by.as_slice(),
        );
        match spec {
            None => spec = Some(here),
            Some(s) if s == here => {}
            Some(_) => return false,
        }
    }
    let Some((partition_by, _)) = spec else {
        return false;
    };
    partition_by
        .iter()
        .all(|e| e.get_type(input.schema()).is_ok_and(|t| exact_key(&t)))
}

/// `builder` with the rule and the planner of these windows.
pub(crate) fn install(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder
        .with_optimizer_rule(Arc::new(KeyWindowRule))
        .with_query_planner(Arc::new(WithKeyWindows))
}

/// Replaces a `Window` the operator computes with a [`KeyWindow`].
#[derive(Debug, Default)]
pub(crate) struct KeyWindowRule;

impl OptimizerRule for KeyWindowRule {
    fn name(&self) -> &str {
        "waltail_key_window"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> DfResult<Transformed<LogicalPlan>> {
        match plan {
            LogicalPlan::Window(window) if supported(&window) => {
                let node = KeyWindow {
                    input: window.input.as_ref().clone(),
                    window_expr: window.window_expr,
                    schema: window.schema,
                };
                Ok(Transformed::yes(LogicalPlan::Extension(Extension {
                    node: Arc::new(node),
                })))
            }
            other => Ok(Transformed::no(other)),
        }
    }
}

/// A `Window` of `lag`, `lead` and `row_number` over one `PARTITION BY`
/// and `ORDER BY`: the input's columns, then one per function.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct KeyWindow {
    input: LogicalPlan,
    window_expr: Vec<Expr>,
    schema: DFSchemaRef,
}

impl PartialOrd for KeyWindow {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.input.partial_cmp(&other.input) {
            Some(Ordering::Equal) => self.window_expr.partial_cmp(&other.window_expr),
            o => o,
        }
    }
}

impl UserDefinedLogicalNodeCore for KeyWindow {
    fn name(&self) -> &str {
        "KeyWindow"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        self.window_expr.clone()
    }

    fn prevent_predicate_push_down_columns(&self) -> std::collections::HashSet<String> {
        // As for DataFusion's window: nothing is pushed below it (a filter
        // on the input would change which rows are next to which).
        self.schema
            .columns()
            .into_iter()
            .map(|c| c.flat_name())
            .collect()
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "KeyWindow: ")?;
        for (i, e) in self.window_expr.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }

    fn with_exprs_and_inputs(
        &self,
        exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> DfResult<Self> {
        let input = inputs.swap_remove(0);
        // The input may have lost columns no one reads: the schema again.
        let window = Window::try_new(exprs, Arc::new(input))?;
        Ok(KeyWindow {
            input: Arc::unwrap_or_clone(window.input),
            window_expr: window.window_expr,
            schema: window.schema,
        })
    }

    fn necessary_children_exprs(&self, output_columns: &[usize]) -> Option<Vec<Vec<usize>>> {
        // The input's columns read above; DataFusion adds those the
        // functions read.
        let n = self.input.schema().fields().len();
        Some(vec![
            output_columns.iter().copied().filter(|&i| i < n).collect(),
        ])
    }
}

/// Plans a [`KeyWindow`] as a [`KeyWindowExec`].
#[derive(Debug, Default)]
pub(crate) struct KeyWindowPlanner;

#[async_trait]
impl ExtensionPlanner for KeyWindowPlanner {
    async fn plan_extension(
        &self,
        planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn datafusion::catalog::Session,
        planning_ctx: &datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<KeyWindow>() else {
            return Ok(None);
        };
        let input_schema = logical_inputs[0].schema();
        let physical =
            |e: &Expr| planner.create_physical_expr(e, input_schema, session, planning_ctx);
        let Some(Expr::WindowFunction(first)) = node.window_expr.first() else {
            return Err(DataFusionError::Internal(
                "a KeyWindow without functions".into(),
            ));
        };
        let partition_by = first
            .params
            .partition_by
            .iter()
            .map(physical)
            .collect::<DfResult<Vec<_>>>()?;
        let order_by = first
            .params
            .order_by
            .iter()
            .map(|s| {
                Ok(PhysicalSortExpr {
                    expr: physical(&s.expr)?,
                    options: arrow::compute::SortOptions {
                        descending: !s.asc,
                        nulls_first: s.nulls_first,
                    },
                })
            })
            .collect::<DfResult<Vec<_>>>()?;
        let mut functions = Vec::with_capacity(node.window_expr.len());
        for expr in &node.window_expr {
            let (shift, value) = shift_of(expr, logical_inputs[0]).ok_or_else(|| {
                DataFusionError::Internal(format!("KeyWindow cannot compute {expr}"))
            })?;
            functions.push((shift, value.as_ref().map(physical).transpose()?));
        }
        let schema: SchemaRef = Arc::new(node.schema.as_arrow().clone());
        let mut input = Arc::clone(&physical_inputs[0]);
        let mut order_column = None;
        let orderable = match order_by.as_slice() {
            [order] => orderable(&order.expr.data_type(&input.schema())?),
            _ => false,
        };
        // One order of an integer type and offsets of a few rows: walked
        // without a sort (see [`hashed`]).
        if orderable
            && hashed_enabled()
            && functions.iter().all(|(s, _)| match s {
                Shift::Row { offset, .. } => offset.abs() <= hashed::MAX_OFFSET,
                Shift::RowNumber => true,
            })
        {
            return Ok(Some(Arc::new(HashedWindowExec::new(
                input,
                schema,
                partition_by,
                order_by[0].clone(),
                functions,
                session.config_options().execution.target_partitions,
            ))));
        }
        // One order of an integer type: sorted by one number (see [`order`]).
        if let [order] = order_by.as_slice()
            && orderable
        {
            order_column = Some(input.schema().fields().len());
            input = Arc::new(KeyOrderExec::new(
                input,
                partition_by.clone(),
                Arc::clone(&order.expr),
                order.options,
            ));
        }
        Ok(Some(Arc::new(KeyWindowExec::new(
            input,
            schema,
            partition_by,
            order_by,
            functions,
            order_column,
        ))))
    }
}

#[cfg(not(test))]
fn hashed_enabled() -> bool {
    true
}

/// Tests turn the walk without a sort off, to test the sort by key.
#[cfg(test)]
pub(super) static TEST_HASHED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

#[cfg(test)]
fn hashed_enabled() -> bool {
    TEST_HASHED.load(std::sync::atomic::Ordering::Relaxed)
}

/// A query planner that plans [`KeyWindow`] nodes too.
#[derive(Debug, Default)]
pub(crate) struct WithKeyWindows;

#[async_trait]
impl QueryPlanner for WithKeyWindows {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn datafusion::catalog::Session,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::with_extension_planners(vec![Arc::new(KeyWindowPlanner)])
            .create_physical_plan(logical_plan, session)
            .await
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use datafusion::catalog::MemTable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    use super::*;

    /// k1, k2, s, x, t, f.
    type Row = (
        Option<String>,
        Option<i64>,
        i64,
        Option<i64>,
        Option<String>,
        f64,
    );

    /// 600 rows in batches of 7: keys with nulls and few values (so each
    /// partition spans batches), a unique order (`ordered`: rising with
    /// the rows, as a history's seqs do; else scattered), values with
    /// nulls.
    fn table(ordered: bool) -> MemTable {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k1", DataType::Utf8, true),
            Field::new("k2", DataType::Int64, true),
            Field::new("s", DataType::Int64, false),
            Field::new("x", DataType::Int64, true),
            Field::new("t", DataType::Utf8View, true),
            Field::new("f", DataType::Float64, true),
        ]));
        let mut state = 42u64;
        let mut next = move |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % m
        };
        let rows: Vec<Row> = (0..600)
            .map(|i| {
                let k1 = match next(9) {
                    0 => None,
                    v => Some(format!("key-{v}")),
                };
                let k2 = match next(40) {
                    0 => None,
                    v => Some(v as i64),
                };
                let x = (next(5) != 0).then(|| next(1000) as i64);
                let t = (next(4) != 0).then(|| format!("a rather longer text {}", next(50)));
                let s = if ordered { i } else { (i * 7919) % 600 };
                (k1, k2, s, x, t, next(3) as f64)
            })
            .collect();
        let batches = rows
            .chunks(7)
            .map(|c| {
                RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![
                        Arc::new(c.iter().map(|r| r.0.clone()).collect::<StringArray>())
                            as ArrayRef,
                        Arc::new(c.iter().map(|r| r.1).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| Some(r.2)).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| r.3).collect::<Int64Array>()),
                        Arc::new(c.iter().map(|r| r.4.clone()).collect::<StringViewArray>()),
                        Arc::new(
                            c.iter()
                                .map(|r| Some(r.5))
                                .collect::<arrow::array::Float64Array>(),
                        ),
                    ],
                )
                .unwrap()
            })
            .collect::<Vec<_>>();
        // Three input partitions, so the keys are repartitioned.
        let parts = batches.chunks(29).map(|c| c.to_vec()).collect();
        MemTable::try_new(schema, parts).unwrap()
    }

    fn contexts(ordered: bool) -> (SessionContext, SessionContext) {
        let config = || {
            SessionConfig::new()
                .with_batch_size(5)
                .with_target_partitions(3)
        };
        let reference = SessionContext::new_with_config(config());
        let ours = SessionContext::new_with_state(
            install(
                SessionStateBuilder::new()
                    .with_config(config())
                    .with_default_features(),
            )
            .build(),
        );
        for ctx in [&reference, &ours] {
            ctx.register_table("t", Arc::new(table(ordered))).unwrap();
        }
        (reference, ours)
    }

    async fn text(ctx: &SessionContext, sql: &str) -> String {
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
    }

    async fn plan(ctx: &SessionContext, sql: &str) -> String {
        text(ctx, &format!("EXPLAIN {sql}")).await
    }

    /// Windows the operator takes: over one key, two, none; keys of text
    /// up to 15 bytes, longer, null, and all three mixed; a `lead` held
    /// back and a `lag` of 1,024 kept across batches; an order of two
    /// columns (sorted by the keys, not by the key order column).
    const KEY_WINDOWS: [&str; 9] = [
        "SELECT s, lag(s) OVER (PARTITION BY t ORDER BY s) AS a, \
         lead(x, 2) OVER (PARTITION BY t ORDER BY s) AS b, \
         row_number() OVER (PARTITION BY t ORDER BY s) AS c FROM t ORDER BY s",
        "SELECT s, lag(s) OVER w AS a, row_number() OVER w AS b FROM t \
         WINDOW w AS (PARTITION BY CASE WHEN s % 2 = 0 THEN k1 ELSE t END ORDER BY s) \
         ORDER BY s",
        "SELECT s, k1, x, lag(x) OVER (PARTITION BY k1 ORDER BY s) AS a, \
         lead(x) OVER (PARTITION BY k1 ORDER BY s) AS b, \
         row_number() OVER (PARTITION BY k1 ORDER BY s) AS c FROM t ORDER BY s",
        "SELECT s, lag(x, 3, -1) OVER w AS a, lead(x, 2, 7) OVER w AS b, \
         lag(t) OVER w AS c, lead(t, 4, 'none') OVER w AS d, row_number() OVER w AS e \
         FROM t WINDOW w AS (PARTITION BY k1, k2 ORDER BY s DESC) ORDER BY s",
        "SELECT s, lag(x, 2) OVER (ORDER BY s DESC) AS a, lead(s, 0) OVER (ORDER BY s) AS b, \
         row_number() OVER (ORDER BY s) AS c FROM t ORDER BY s",
        "SELECT s, lead(k1, 5) OVER (PARTITION BY k2 ORDER BY x, s) AS a, \
         lag(s, 1024) OVER (PARTITION BY k2 ORDER BY x, s) AS b FROM t ORDER BY s",
        "SELECT s, lag(s, 1024) OVER (PARTITION BY k2 ORDER BY s) AS a, \
         lead(s, 3) OVER (PARTITION BY k2 ORDER BY s) AS b FROM t ORDER BY s",
        "SELECT count(*), sum(gap), max(gap) FROM (SELECT s - lag(s) OVER \
         (PARTITION BY upper(k1) ORDER BY s) AS gap FROM t) g WHERE gap IS NOT NULL",
        "SELECT k2, max(n) FROM (SELECT k2, row_number() OVER (PARTITION BY k2 ORDER BY s) AS n \
         FROM t WHERE x > 100) g GROUP BY k2 ORDER BY k2",
    ];

    /// Each query answers as DataFusion's own window answers it, and runs
    /// through the walk without a sort where it can (rows in order or not),
    /// else through the sort by key; the sort by key answers every one.
    #[tokio::test]
    async fn lag_lead_and_row_number_answer_as_datafusion_does() {
        use std::sync::atomic::Ordering;

        for ordered in [true, false] {
            let (reference, ours) = contexts(ordered);
            for hashed in [true, false] {
                TEST_HASHED.store(hashed, Ordering::Relaxed);
                for sql in KEY_WINDOWS {
                    let what = format!("ordered {ordered}, hashed {hashed}: {sql}");
                    assert_eq!(
                        text(&ours, sql).await,
                        text(&reference, sql).await,
                        "{what}"
                    );
                    let p = plan(&ours, sql).await;
                    assert!(!p.contains("WindowAggExec"), "{what}\n{p}");
                    let one_order = !sql.contains("ORDER BY x, s");
                    let walked = hashed && one_order && !sql.contains("1024");
                    assert_eq!(p.contains("HashedWindowExec"), walked, "{what}\n{p}");
                    assert_eq!(p.contains("KeyWindowExec"), !walked, "{what}\n{p}");
                    // One integer order: sorted by the key order column alone.
                    assert_eq!(
                        p.contains("KeyOrderExec"),
                        !walked && one_order,
                        "{what}\n{p}"
                    );
                }
            }
            TEST_HASHED.store(true, Ordering::Relaxed);
        }
    }

    /// Keys that share a number (all of them, or two to four groups of
    /// them) answer as they do apart: each key's rows are put together
    /// again, also across batches (of 5 rows here) and with rows held back
    /// for a `lead` or kept for a `lag` of 1,024.
    #[tokio::test]
    async fn keys_that_share_a_number_answer_as_apart() {
        use std::sync::atomic::Ordering;

        let (reference, ours) = contexts(false);
        TEST_HASHED.store(false, Ordering::Relaxed);
        let numbered = KEY_WINDOWS.iter().filter(|q| !q.contains("ORDER BY x, s"));
        for bits in [0, 1, 3] {
            order::TEST_NUMBER_BITS.store(bits, Ordering::Relaxed);
            for sql in numbered.clone() {
                assert_eq!(
                    text(&ours, sql).await,
                    text(&reference, sql).await,
                    "{bits} {sql}"
                );
            }
        }
        order::TEST_NUMBER_BITS.store(order::NUMBER_BITS, Ordering::Relaxed);
        TEST_HASHED.store(true, Ordering::Relaxed);
    }

    /// What the operator does not compute stays with DataFusion, with the
    /// same answers.
    #[tokio::test]
    async fn other_windows_stay_with_datafusion() {
        let (reference, ours) = contexts(false);
        let queries = [
            "SELECT s, lag(x) IGNORE NULLS OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, sum(x) OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x, 1025) OVER (PARTITION BY k1 ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x) OVER (PARTITION BY f ORDER BY s) AS a FROM t ORDER BY s",
            "SELECT s, lag(x) OVER (PARTITION BY k1 ORDER BY s) AS a, \
             rank() OVER (PARTITION BY k1 ORDER BY s) AS b FROM t ORDER BY s",
        ];
        for sql in queries {
            assert_eq!(text(&ours, sql).await, text(&reference, sql).await, "{sql}");
            let p = plan(&ours, sql).await;
            assert!(!p.contains("KeyWindowExec"), "{sql}\n{p}");
            assert!(!p.contains("HashedWindowExec"), "{sql}\n{p}");
        }
    }
}
