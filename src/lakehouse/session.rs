//! A DataFusion session over the archive's store, so compact (and query)
//! read Parquet from S3 or the local folder with the destination's own
//! credentials: the store the sink built is registered under one URL.

use std::sync::Arc;

use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::SessionContext;
use object_store::ObjectStore;

/// The URL the archive's store is registered under in a session.
pub const ARCHIVE_URL: &str = "waltail://archive/";

/// A session whose `waltail://archive/<key>` URLs read `store`.
pub fn session(store: Arc<dyn ObjectStore>) -> SessionContext {
    let ctx = SessionContext::new();
    let url = ObjectStoreUrl::parse(ARCHIVE_URL).expect("a valid URL");
    ctx.register_object_store(url.as_ref(), store);
    ctx
}

/// The session URL of an object key. Keys keep `%` from percent-encoded
/// names (`public.quo%22te`) literally, so it is escaped here: DataFusion
/// decodes URL paths back to object keys.
pub fn table_url(key: &str) -> String {
    format!("{ARCHIVE_URL}{}", key.replace('%', "%25"))
}
