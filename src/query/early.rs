//! A statement at the prompt run on the last statement's snapshot while the
//! next snapshot is taken.
//!
//! Every statement takes its own snapshot (schema records, Delta logs, the
//! listing of the NDJSON tail), and at the prompt that check was a fifth to
//! a third of a repeated statement's time, paid before the statement began. When the
//! archive has not changed, which is the usual case between two statements
//! typed by a person, the answer on the last snapshot is the answer. So a
//! query runs on the last snapshot's tables at once, holding its result in
//! memory, while the check runs; the result is printed only if the check
//! finds the same snapshot, and is dropped otherwise (the statement then
//! runs again on the new tables, as without this).
//!
//! Only a single query is run early: a `SET` or a `CREATE VIEW` changes the
//! session and must run once, after the check. A result larger than
//! [`EARLY_RESULT_BYTES`] is given up (the statement runs again after the
//! check, printing as it goes), so memory stays bounded. Any error is
//! given up too: the run after the check reports it with the snapshot it
//! belongs to.

use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result as DfResult;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::execution::TaskContext;
use datafusion::execution::context::SQLOptions;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{ExecutionPlan, execute_stream};
use datafusion::prelude::{DataFrame, SessionContext};
use datafusion::sql::parser::Statement;
use futures::StreamExt;

/// The most result an early run holds before it gives up.
pub(crate) const EARLY_RESULT_BYTES: usize = 16 << 20;

/// A query's result, got on the last snapshot.
pub(crate) struct Early {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    pub plan: Duration,
    pub run: Duration,
}

impl Early {
    /// The result as a stream, for the printer.
    pub(crate) fn into_stream(self) -> SendableRecordBatchStream {
        Box::pin(RecordBatchStreamAdapter::new(
            self.schema,
            futures::stream::iter(self.batches.into_iter().map(Ok)),
        ))
    }
}

/// Whether `statement` may run early: a query, which reads and changes
/// nothing in the session.
pub(crate) fn may_run_early(statement: &Statement) -> bool {
    matches!(statement, Statement::Statement(s)
        if matches!(**s, datafusion::sql::sqlparser::ast::Statement::Query(_)))
}

/// The plan that runs `frame`, and the context to run it in. Made apart
/// from running it so that `--timing` counts it as planning: it reads
/// each file's statistics and applies the plan's rules, a large part of a
/// short query's time.
pub(crate) async fn physical(
    frame: DataFrame,
) -> DfResult<(Arc<dyn ExecutionPlan>, Arc<TaskContext>)> {
    let task = Arc::new(frame.task_ctx());
    Ok((frame.create_physical_plan().await?, task))
}

/// Runs `statement` in `ctx` (the last statement's session and tables) and
/// holds its result; `None` if it failed or its result grew past
/// [`EARLY_RESULT_BYTES`].
pub(crate) async fn run(ctx: &SessionContext, statement: Statement) -> Option<Early> {
    let planning = Instant::now();
    let plan = ctx.state().statement_to_plan(statement).await.ok()?;
    SQLOptions::new()
        .with_allow_dml(false)
        .verify_plan(&plan)
        .ok()?;
    let frame = ctx.execute_logical_plan(plan).await.ok()?;
    let (physical, task) = physical(frame).await.ok()?;
    let plan = planning.elapsed();
    let running = Instant::now();
    let mut stream = execute_stream(physical, task).ok()?;
    let schema = stream.schema();
    let mut batches = Vec::new();
    let mut bytes = 0;
    while let Some(batch) = stream.next().await {
        let batch = batch.ok()?;
        bytes += batch.get_array_memory_size();
        if bytes > EARLY_RESULT_BYTES {
            return None;
        }
        batches.push(batch);
    }
    Some(Early {
        schema,
        batches,
        plan,
        run: running.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use datafusion::sql::parser::DFParserBuilder;
    use datafusion::sql::sqlparser::dialect::GenericDialect;

    use super::*;

    fn statement(sql: &str) -> Statement {
        DFParserBuilder::new(sql)
            .with_dialect(&GenericDialect {})
            .build()
            .and_then(|mut p| p.parse_statements())
            .unwrap()
            .pop_front()
            .unwrap()
    }

    #[test]
    fn only_queries_run_early() {
        assert!(may_run_early(&statement("SELECT 1")));
        assert!(may_run_early(&statement(
            "WITH x AS (SELECT 1 AS a) SELECT a FROM x"
        )));
        for sql in [
            "SET datafusion.execution.batch_size = 10",
            "CREATE VIEW v AS SELECT 1",
            "EXPLAIN ANALYZE SELECT 1",
            "SHOW TABLES",
        ] {
            assert!(!may_run_early(&statement(sql)), "{sql}");
        }
    }

    #[tokio::test]
    async fn a_result_past_the_bound_is_given_up() {
        let ctx = SessionContext::new();
        let early = run(&ctx, statement("SELECT 1 AS a, 'x' AS b")).await;
        let early = early.expect("a small result is held");
        assert_eq!(early.batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
        // Over 16 MiB of result (4,000,000 eight-byte values).
        let big = run(&ctx, statement("SELECT * FROM generate_series(1, 4000000)")).await;
        assert!(big.is_none());
        assert!(run(&ctx, statement("SELECT nope")).await.is_none());
    }
}
