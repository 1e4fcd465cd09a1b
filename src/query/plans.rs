//! For the tests of what shapes a query's plan: a statement's physical plan
//! and its answer, both as text.

use datafusion::physical_plan::displayable;
use datafusion::prelude::SessionContext;

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
