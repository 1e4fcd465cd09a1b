//! The web console at `/` on the telemetry listener: the pipeline's state,
//! the first changes of this process as they are captured and delivered, and
//! the parked batches with a Replay button.
//!
//! One page (`index.html` with inline CSS, and `console.js`), embedded in the
//! binary: no CDN, no build step. The page polls a small JSON API:
//!
//! - `GET /api/state`: position, counters, slot lag, the event journal;
//! - `GET /api/parked`: parked and held batches (never their bytes);
//! - `POST /api/parked/<id>/replay`: marks a parked batch for replay in the
//!   local state, exactly as `waltail parked replay <id>` does against a
//!   running pipeline; the pipeline notices within half a second (it polls
//!   the state's `PRAGMA data_version`) and delivers it, then the batches
//!   held behind it.
//!
//! Nothing here reveals the configuration beyond the pipeline name, the slot
//! name and the destination as `describe()` prints it (bucket and prefix, or
//! a path): no URL, password or key.
//!
//! A console on 127.0.0.1 must not be drivable from a web page on another
//! site. So every console request must name this server in `Host` (a DNS
//! rebinding page names its own host), and the replay `POST` must carry
//! `X-Waltail: 1` (a cross-site form cannot set it, and a cross-site `fetch`
//! setting it needs a CORS preflight that this server never grants) and an
//! `Origin`, if any, equal to the page's own. The page is served with a CSP
//! that forbids framing (no clickjacking of the button) and renders every
//! value as text, never as markup.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::archive::envelope::{Change, Op, TableRef};
use crate::checkpoint::{Checkpoint, ParkStatus};
use crate::config::Config;
use crate::error::Report;
use crate::lsn;
use crate::telemetry::METRICS;

const INDEX_HTML: &str = include_str!("index.html");
const CONSOLE_JS: &str = include_str!("console.js");

/// Changes kept from the start of the process: the spec's "first event as
/// it is captured and delivered", enough to see a new pipeline work.
pub(crate) const FIRST_EVENTS: usize = 20;
/// The latest changes kept beside them, so a long-running pipeline shows
/// something current too.
pub(crate) const RECENT_EVENTS: usize = 10;
/// Parked batches listed by `/api/parked`; a listing of thousands polled
/// every second would cost more than it tells (`waltail parked list` shows all).
const PARKED_SHOWN: usize = 200;
/// The header the page's `fetch` sets on a replay request.
const CSRF_HEADER: &str = "x-waltail";

/// What became of a change, as far as this process knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Read from Postgres and numbered; its batch is not written yet.
    Captured,
    /// In the archive under its batch's key.
    Delivered,
    /// Its batch failed every attempt and waits for a replay.
    Parked,
    /// Its batch waits behind a parked batch on the same rows.
    Held,
    /// Already archived by an earlier run (re-sent by the server after a
    /// restart and skipped).
    ArchivedBefore,
}

impl Fate {
    fn as_str(self) -> &'static str {
        match self {
            Fate::Captured => "captured",
            Fate::Delivered => "delivered",
            Fate::Parked => "parked",
            Fate::Held => "held",
            Fate::ArchivedBefore => "archived before",
        }
    }
}

struct Event {
    seq: u64,
    op: Op,
    table: Arc<TableRef>,
    commit_lsn: u64,
    /// Unix milliseconds.
    captured_at: i64,
    fate: Fate,
    key: Option<String>,
    settled_at: Option<i64>,
}

impl Event {
    fn json(&self) -> Value {
        json!({
            "seq": self.seq,
            "op": self.op.as_str(),
            "table": self.table.name,
            "commit_lsn": lsn::format(self.commit_lsn),
            "captured_at_ms": self.captured_at,
            "status": self.fate.as_str(),
            "key": self.key,
            "settled_at_ms": self.settled_at,
        })
    }
}

struct Entries {
    first: Vec<Event>,
    recent: VecDeque<Event>,
    captured: u64,
    last_key: String,
}

impl Entries {
    const fn new() -> Entries {
        Entries {
            first: Vec::new(),
            recent: VecDeque::new(),
            captured: 0,
            last_key: String::new(),
        }
    }
}

/// A small bounded record of changes for the console: the first
/// [`FIRST_EVENTS`] of the process and the latest [`RECENT_EVENTS`], each
/// with what became of it. Fed by the pipeline; off (every call returns at
/// once) unless the console is served, so the hot path pays nothing then.
pub(crate) struct Journal {
    on: AtomicBool,
    entries: Mutex<Entries>,
}

/// The process's journal: one pipeline runs per process (like [`METRICS`]).
pub(crate) static JOURNAL: Journal = Journal::new();

impl Journal {
    pub(crate) const fn new() -> Journal {
        Journal {
            on: AtomicBool::new(false),
            entries: Mutex::new(Entries::new()),
        }
    }

    /// Starts recording (the console is being served).
    pub(crate) fn enable(&self) {
        self.on.store(true, Relaxed);
    }

    /// The journal only feeds a display: a panic elsewhere while holding the
    /// lock leaves nothing inconsistent that matters, so poisoning is ignored.
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change was read from Postgres and got `seq`.
    pub(crate) fn captured(&self, seq: u64, change: &Change) {
        if !self.on.load(Relaxed) {
            return;
        }
        let event = Event {
            seq,
            op: change.op,
            table: change.table.clone(),
            commit_lsn: change.commit_lsn,
            captured_at: chrono::Utc::now().timestamp_millis(),
            fate: Fate::Captured,
            key: None,
            settled_at: None,
        };
        let mut e = self.lock();
        e.captured += 1;
        if e.first.len() < FIRST_EVENTS {
            e.first.push(event);
        } else {
            if e.recent.len() == RECENT_EVENTS {
                e.recent.pop_front();
            }
            e.recent.push_back(event);
        }
    }

    /// The batch holding seqs `first_seq..=last_seq` came to `fate`
    /// (under `key`, when it has one).
    pub(crate) fn settled(&self, first_seq: u64, last_seq: u64, fate: Fate, key: Option<&str>) {
        if !self.on.load(Relaxed) {
            return;
        }
        let now = chrono::Utc::now().timestamp_millis();
        let mut guard = self.lock();
        let e = &mut *guard;
        if fate == Fate::Delivered
            && let Some(key) = key
        {
            e.last_key.clear();
            e.last_key.push_str(key);
        }
        for ev in e.first.iter_mut().chain(e.recent.iter_mut()) {
            if (first_seq..=last_seq).contains(&ev.seq) {
                ev.fate = fate;
                ev.key = key.map(str::to_string);
                ev.settled_at = Some(now);
            }
        }
    }

    /// The journal as the console shows it.
    fn snapshot(&self) -> Value {
        let e = self.lock();
        json!({
            "captured": e.captured,
            "first": e.first.iter().map(Event::json).collect::<Vec<_>>(),
            "recent": e.recent.iter().map(Event::json).collect::<Vec<_>>(),
            "last_key": (!e.last_key.is_empty()).then(|| e.last_key.clone()),
        })
    }
}

impl Default for Journal {
    fn default() -> Self {
        Journal::new()
    }
}

/// The console's view of the configuration: only what it may show, plus
/// where the state is.
pub(crate) struct Console {
    pipeline: String,
    slot: String,
    destination: String,
    state_file: PathBuf,
    /// The address actually bound (port resolved when 0 was asked for).
    listen: SocketAddr,
    slot_lag_warn_bytes: u64,
}

type Reply = Response<Full<Bytes>>;

impl Console {
    /// The console of `config`'s pipeline, served on `listen`; starts the
    /// process's event journal.
    pub(crate) fn new(config: &Config, listen: SocketAddr) -> Console {
        JOURNAL.enable();
        Console {
            pipeline: config.pipeline.clone(),
            slot: config.source.slot.clone(),
            destination: config.destination.describe(),
            state_file: config.state_file(),
            listen,
            slot_lag_warn_bytes: config.slot_lag_warn_bytes,
        }
    }

    /// Answers one request to the console (any path but the probes).
    pub(crate) async fn answer<B>(&self, req: Request<B>, peer: SocketAddr) -> Reply {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !host_allowed(self.listen, host) {
            return refuse(
                StatusCode::FORBIDDEN,
                &format!(
                    "this console answers requests for http://{}/ only (Host was {host:?})",
                    self.listen
                ),
            );
        }
        let path = req.uri().path();
        let method = req.method();
        if let Some(id) = path
            .strip_prefix("/api/parked/")
            .and_then(|rest| rest.strip_suffix("/replay"))
        {
            if method != Method::POST {
                let mut resp = refuse(StatusCode::METHOD_NOT_ALLOWED, "use POST");
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("POST"));
                return resp;
            }
            if let Err(why) = same_origin(req.headers(), host) {
                tracing::warn!(%peer, why, "refused a replay request to the console");
                return refuse(StatusCode::FORBIDDEN, why);
            }
            let Ok(id) = id.parse::<u64>() else {
                return refuse(StatusCode::NOT_FOUND, "a batch id is a number");
            };
            return self.replay(id, peer).await;
        }
        match (method, path) {
            (&Method::GET, "/") => page(INDEX_HTML, "text/html; charset=utf-8"),
            (&Method::GET, "/console.js") => page(CONSOLE_JS, "text/javascript; charset=utf-8"),
            (&Method::GET, "/api/state") => self.state().await,
            (&Method::GET, "/api/parked") => self.parked().await,
            (_, "/" | "/console.js" | "/api/state" | "/api/parked") => {
                let mut resp = refuse(StatusCode::METHOD_NOT_ALLOWED, "use GET");
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET"));
                resp
            }
            _ => refuse(
                StatusCode::NOT_FOUND,
                "try / (the console), /metrics, /healthz or /readyz",
            ),
        }
    }

    /// Runs `f` on the local state off the async threads (SQLite blocks).
    async fn with_state<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Checkpoint) -> crate::Result<T> + Send + 'static,
    ) -> Result<T, Reply> {
        let path = self.state_file.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut cp = Checkpoint::open(&path)?;
            f(&mut cp)
        })
        .await;
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("cannot read the local state: {}", Report(&e)),
            )),
            Err(e) => Err(refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("reading the local state failed: {e}"),
            )),
        }
    }

    async fn state(&self) -> Reply {
        let read = self
            .with_state(|cp| {
                let parked = cp.parked_listing()?;
                let held = parked
                    .iter()
                    .filter(|p| p.status == ParkStatus::Held)
                    .count();
                let backfills: Vec<_> = cp
                    .recent_backfills(5)?
                    .iter()
                    .map(crate::checkpoint::Backfill::to_json)
                    .collect();
                Ok((cp.cursor()?, parked.len() - held, held, backfills))
            })
            .await;
        let (cursor, parked, held, backfills) = match read {
            Ok(v) => v,
            Err(resp) => return resp,
        };
        let lag = METRICS.slot_lag_bytes.get().max(0) as u64;
        json_reply(
            StatusCode::OK,
            &json!({
                "pipeline": self.pipeline,
                "slot": self.slot,
                "destination": self.destination,
                "ready": METRICS.ready.get() == 1,
                "confirmed_lsn": cursor.map(|c| lsn::format(c.confirmed_lsn)),
                "next_seq": cursor.map(|c| c.next_seq),
                "changes_received": METRICS.changes_received.get(),
                "changes_archived": METRICS.changes_archived.get(),
                "objects_written": METRICS.objects_written.get(),
                "bytes_written": METRICS.bytes_written.get(),
                "put_retries": METRICS.put_retries.get(),
                "parked": parked,
                "held": held,
                "slot_lag_bytes": lag,
                "slot_lag_warn_bytes": self.slot_lag_warn_bytes,
                "slot_lag_warning": self.slot_lag_warn_bytes > 0 && lag > self.slot_lag_warn_bytes,
                "events": JOURNAL.snapshot(),
                "backfills": backfills,
            }),
        )
    }

    async fn parked(&self) -> Reply {
        let parked = match self.with_state(|cp| cp.parked_listing()).await {
            Ok(v) => v,
            Err(resp) => return resp,
        };
        let batches: Vec<Value> = parked
            .iter()
            .take(PARKED_SHOWN)
            .map(|p| {
                json!({
                    "id": p.first_seq,
                    "first_seq": p.first_seq,
                    "last_seq": p.last_seq,
                    "key": p.key,
                    "tables": p.tables,
                    "status": p.status.as_str(),
                    "attempts": p.attempts,
                    "last_error": p.last_error,
                    "parked_at": p.parked_at,
                })
            })
            .collect();
        json_reply(
            StatusCode::OK,
            &json!({ "total": parked.len(), "batches": batches }),
        )
    }

    /// Marks batch `id` for replay, as `waltail parked replay <id>` does.
    async fn replay(&self, id: u64, peer: SocketAddr) -> Reply {
        let result = self
            .with_state(move |cp| {
                let status = cp
                    .parked_listing()?
                    .into_iter()
                    .find(|p| p.first_seq == id)
                    .map(|p| p.status);
                if status == Some(ParkStatus::Parked) {
                    cp.request_replay(Some(id))?;
                }
                Ok(status)
            })
            .await;
        match result {
            Err(resp) => resp,
            Ok(None) => refuse(
                StatusCode::NOT_FOUND,
                &format!("no parked batch with id {id} (delivered already?)"),
            ),
            Ok(Some(ParkStatus::Held)) => refuse(
                StatusCode::CONFLICT,
                &format!(
                    "batch {id} is held behind a parked batch on the same rows: replay that one, this one follows it"
                ),
            ),
            Ok(Some(_)) => {
                tracing::info!(id, %peer, "replay requested from the console");
                json_reply(
                    StatusCode::ACCEPTED,
                    &json!({ "id": id, "status": "replay requested" }),
                )
            }
        }
    }
}

/// Whether `host` (the request's Host header) names this server: the bound
/// address itself, `localhost` when bound to loopback, and, when bound to
/// every interface, any IP literal on the port. Never another DNS name: a
/// DNS-rebinding page reaches 127.0.0.1 under its own name.
fn host_allowed(listen: SocketAddr, host: &str) -> bool {
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, after)) => (ip, after.strip_prefix(':')),
            None => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        },
    };
    let port_ok = match port {
        Some(p) => p.parse::<u16>() == Ok(listen.port()),
        None => listen.port() == 80,
    };
    if !port_ok {
        return false;
    }
    let ip = listen.ip();
    if name.eq_ignore_ascii_case("localhost") {
        return ip.is_loopback() || ip.is_unspecified();
    }
    match name.parse::<IpAddr>() {
        Ok(named) => ip.is_unspecified() || named == ip,
        Err(_) => false,
    }
}

/// A state-changing request must come from the console's own page (or from
/// a non-browser client, which sends no Origin): `X-Waltail: 1`, and an
/// Origin, when present, equal to `http://<host>`.
fn same_origin(headers: &HeaderMap, host: &str) -> Result<(), &'static str> {
    if headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()) != Some("1") {
        return Err("a replay request needs the header X-Waltail: 1 (the console's page sets it)");
    }
    match headers.get(header::ORIGIN) {
        None => Ok(()),
        Some(origin) => {
            let expected = format!("http://{host}");
            if origin
                .to_str()
                .is_ok_and(|o| o.eq_ignore_ascii_case(&expected))
            {
                Ok(())
            } else {
                Err("a replay request from another site's page is refused")
            }
        }
    }
}

/// Headers every console response carries: no caching of live data, no
/// sniffing, no framing, and a policy that lets the page load only itself.
fn secure(resp: &mut Reply, content_type: &'static str) {
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; \
             base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
}

fn page(body: &'static str, content_type: &'static str) -> Reply {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    secure(&mut resp, content_type);
    resp
}

fn json_reply(status: StatusCode, body: &Value) -> Reply {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    secure(&mut resp, "application/json");
    resp
}

fn refuse(status: StatusCode, why: &str) -> Reply {
    json_reply(status, &json!({ "error": why }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::envelope::RowSet;

    fn change(table: &Arc<TableRef>) -> Change {
        Change {
            op: Op::Insert,
            table: table.clone(),
            data: None,
            old: None,
            commit_lsn: 0x1_0000_0010,
            commit_ts: 0,
            index: 0,
            rows: RowSet::one(1),
        }
    }

    #[test]
    fn journal_keeps_the_first_and_the_latest_changes_with_their_fate() {
        let j = Journal::new();
        let t = Arc::new(TableRef::new("public", "t"));
        j.captured(1, &change(&t));
        assert_eq!(j.snapshot()["captured"], 0, "off until enabled");
        j.enable();
        for seq in 1..=100 {
            j.captured(seq, &change(&t));
        }
        j.settled(1, 5, Fate::Delivered, Some("k-1-5"));
        j.settled(6, 6, Fate::Parked, Some("k-6-6"));
        j.settled(95, 100, Fate::Delivered, Some("k-95-100"));
        let s = j.snapshot();
        assert_eq!(s["captured"], 100);
        let first = s["first"].as_array().unwrap();
        let recent = s["recent"].as_array().unwrap();
        assert_eq!(first.len(), FIRST_EVENTS);
        assert_eq!(recent.len(), RECENT_EVENTS);
        assert_eq!(first[0]["seq"], 1);
        assert_eq!(first[0]["status"], "delivered");
        assert_eq!(first[0]["key"], "k-1-5");
        assert_eq!(first[0]["table"], "public.t");
        assert_eq!(first[0]["commit_lsn"], "1/10");
        assert_eq!(first[5]["status"], "parked");
        assert_eq!(first[6]["status"], "captured");
        assert_eq!(recent[0]["seq"], 91);
        assert_eq!(recent[3]["status"], "captured");
        assert_eq!(recent[9]["status"], "delivered");
        assert_eq!(s["last_key"], "k-95-100");
    }

    #[test]
    fn hosts_that_name_this_server_only() {
        let lo: SocketAddr = "127.0.0.1:9187".parse().unwrap();
        assert!(host_allowed(lo, "127.0.0.1:9187"));
        assert!(host_allowed(lo, "localhost:9187"));
        assert!(host_allowed(lo, "LocalHost:9187"));
        assert!(!host_allowed(lo, "127.0.0.1:9188"));
        assert!(!host_allowed(lo, "127.0.0.1"));
        assert!(!host_allowed(lo, "evil.example:9187"), "DNS rebinding");
        assert!(!host_allowed(lo, "10.0.0.1:9187"));
        assert!(!host_allowed(lo, ""));
        let v6: SocketAddr = "[::1]:9187".parse().unwrap();
        assert!(host_allowed(v6, "[::1]:9187"));
        assert!(host_allowed(v6, "localhost:9187"));
        assert!(!host_allowed(v6, "[::1"));
        let any: SocketAddr = "0.0.0.0:9187".parse().unwrap();
        assert!(host_allowed(any, "10.0.0.1:9187"));
        assert!(host_allowed(any, "localhost:9187"));
        assert!(!host_allowed(any, "metrics.internal:9187"));
        let lan: SocketAddr = "10.0.0.1:80".parse().unwrap();
        assert!(host_allowed(lan, "10.0.0.1"));
        assert!(!host_allowed(lan, "localhost"));
    }

    #[test]
    fn replay_requests_need_the_header_and_a_matching_origin() {
        let mut h = HeaderMap::new();
        assert!(same_origin(&h, "127.0.0.1:9187").is_err(), "no header");
        h.insert(CSRF_HEADER, HeaderValue::from_static("1"));
        assert!(same_origin(&h, "127.0.0.1:9187").is_ok(), "curl: no Origin");
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:9187"),
        );
        assert!(same_origin(&h, "127.0.0.1:9187").is_ok());
        assert!(same_origin(&h, "localhost:9187").is_err());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(same_origin(&h, "127.0.0.1:9187").is_err());
        h.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(same_origin(&h, "127.0.0.1:9187").is_err());
    }
}
