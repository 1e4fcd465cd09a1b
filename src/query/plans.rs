//! For the tests of what shapes a query's plan: a statement's physical plan
//! and its answer, both as text, in sessions with and without a rule.

use std::sync::Arc;

use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::displayable;
use datafusion::prelude::{SessionConfig, SessionContext};

/// Two sessions of two cores: DataFusion's own, and one with `rule` too.
pub(crate) fn without_and_with(
    rule: Arc<dyn PhysicalOptimizerRule + Send + Sync>,
) -> (SessionContext, SessionContext) {
    let builder = || {
        SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_default_features()
    };
    (
        SessionContext::new_with_state(builder().build()),
        SessionContext::new_with_state(builder().with_physical_optimizer_rule(rule).build()),
    )
}

/// The physical plan of `sql` in `ctx`, and its answer.
pub(crate) async fn plan_and_answer(ctx: &SessionContext, sql: &str) -> (String, String) {
    let df = ctx.sql(sql).await.unwrap();
    let plan = df.clone().create_physical_plan().await.unwrap();
    let batches = df.collect().await.unwrap();
    (
        displayable(plan.as_ref()).indent(true).to_string(),
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string(),
    )
}

/// [`without_and_with`] `rule`, each with `batch` as table `t`: one
/// Parquet file in the folder returned (keep it while the sessions run).
pub(crate) async fn parquet_sessions(
    rule: Arc<dyn PhysicalOptimizerRule + Send + Sync>,
    batch: &arrow::array::RecordBatch,
) -> (SessionContext, SessionContext, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.parquet");
    let file = std::fs::File::create(&path).unwrap();
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
    let (plain, with) = without_and_with(rule);
    for ctx in [&plain, &with] {
        ctx.register_parquet(
            "t",
            path.to_str().unwrap(),
            datafusion::prelude::ParquetReadOptions::default(),
        )
        .await
        .unwrap();
    }
    (plain, with, dir)
}
