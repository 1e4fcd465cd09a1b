//! The HTTP server on `telemetry.listen`: the probes (`/healthz`,
//! `/readyz`) and `/metrics` from [`crate::telemetry`], everything else the
//! [`crate::console`]'s. One module owns the server so that neither of the
//! two it serves imports the other.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};

use crate::console::Console;
use crate::telemetry::METRICS;

/// Answers the probes and metrics here; everything else is the console's.
async fn answer(
    req: Request<hyper::body::Incoming>,
    console: &Console,
    peer: SocketAddr,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, METRICS.render()),
        "/healthz" => (StatusCode::OK, "ok\n".to_string()),
        "/readyz" if METRICS.ready.get() == 1 => (StatusCode::OK, "ready\n".to_string()),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not streaming\n".to_string(),
        ),
        _ => return Ok(console.answer(req, peer).await),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    let content_type = if req.uri().path() == "/metrics" {
        crate::telemetry::METRICS_CONTENT_TYPE
    } else {
        "text/plain"
    };
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    Ok(resp)
}

/// Serves `/metrics`, `/healthz`, `/readyz` and the console on `listener`
/// until the task is dropped.
pub(crate) async fn serve(listener: tokio::net::TcpListener, console: Console) {
    let console = Arc::new(console);
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let console = console.clone();
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let service = hyper::service::service_fn(move |req| {
                let console = console.clone();
                async move { answer(req, &console, peer).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await;
        });
    }
}
