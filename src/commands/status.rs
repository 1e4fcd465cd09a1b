//! `waltail status`: where the pipeline stands, from its local state and
//! from Postgres: confirmed position, next seq, last object, recent rate,
//! parked batches, backfills, the slot and how far it lags behind the
//! server's WAL (flagged when over `telemetry.slot_lag_warn_bytes`).
//! Read-only; works while `waltail run` is running.

use std::process::ExitCode;

use indicatif::HumanBytes;
use serde_json::{Value, json};

use crate::checkpoint::{Backfill, ParkStatus};
use crate::config::Config;
use crate::error::Report;
use crate::lsn;
use crate::source;
use crate::{Error, Result};

/// The rate is computed over the samples of this last stretch of time.
const RATE_WINDOW_SECS: i64 = 60;

/// Gathers the status; prints it as text, or as one JSON object with `json`.
pub(crate) async fn status(config: &Config, json: bool) -> Result<ExitCode> {
    let path = config.state_file();
    let cp = super::open_state(config)?;
    let cursor = cp.cursor()?;
    let parked = cp.parked()?;
    let held = parked
        .iter()
        .filter(|p| p.status == ParkStatus::Held)
        .count();
    let progress = cp.progress()?;
    let now = chrono::Utc::now().timestamp();
    let last = progress.last();
    let rate = last.and_then(|last| {
        let first = progress
            .iter()
            .find(|p| p.at >= last.at - RATE_WINDOW_SECS)?;
        (last.at > first.at)
            .then(|| (last.next_seq - first.next_seq) as f64 / (last.at - first.at) as f64)
    });
    let slot = slot_status(config).await;
    let threshold = config.slot_lag_warn_bytes;
    let lag_warning = threshold > 0
        && slot["lag_bytes"]
            .as_i64()
            .is_some_and(|lag| lag > 0 && lag as u64 > threshold);
    // Backfills in progress, and the last few finished ones.
    let backfills = cp.recent_backfills(5)?;

    let report = json!({
        "pipeline": config.pipeline,
        "state": path.display().to_string(),
        "destination": config.destination.describe(),
        "confirmed_lsn": cursor.map(|c| lsn::format(c.confirmed_lsn)),
        "next_seq": cursor.map(|c| c.next_seq),
        "last_object": last.and_then(|p| p.last_key.clone()),
        "last_sample_age_s": last.map(|p| now - p.at),
        "changes_per_s": rate,
        "parked": parked.len() - held,
        "held": held,
        "backfills": backfills.iter().map(Backfill::to_json).collect::<Vec<_>>(),
        "slot": slot,
        "slot_lag_warn_bytes": threshold,
        "lag_warning": lag_warning,
    });
    if json {
        println!("{report}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("pipeline     {}", config.pipeline);
    println!("destination  {}", config.destination.describe());
    println!("state        {}", path.display());
    match cursor {
        Some(c) => println!(
            "confirmed    {} (next seq {})",
            lsn::format(c.confirmed_lsn),
            c.next_seq
        ),
        None => println!("confirmed    nothing yet"),
    }
    match last {
        Some(p) => println!(
            "last object  {} (sampled {} s ago)",
            p.last_key.as_deref().unwrap_or("none yet"),
            now - p.at
        ),
        None => println!("last object  none yet"),
    }
    match rate {
        Some(r) => println!("recent rate  {r:.0} changes/s (last {RATE_WINDOW_SECS} s)"),
        None => println!("recent rate  unknown (no recent samples: is `waltail run` running?)"),
    }
    println!(
        "parked       {} parked, {held} held{}",
        parked.len() - held,
        if parked.is_empty() {
            ""
        } else {
            "  (see `waltail parked list`)"
        }
    );
    for b in &backfills {
        let share = match b.estimate {
            0 => String::new(),
            n => format!(" ({:.0}%)", 100.0 * b.rows_read as f64 / n as f64),
        };
        println!(
            "backfill     {}.{}: {}, {} of ~{} rows{share}{}",
            b.schema,
            b.table,
            b.status,
            b.rows_read,
            b.estimate,
            b.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        );
    }
    print_slot(&config.source.slot, &report["slot"]);
    if lag_warning {
        println!(
            "WARNING      the slot lags more than telemetry.slot_lag_warn_bytes ({}): Postgres keeps \
             this WAL until waltail confirms it. Is `waltail run` running, and writing (parked \
             batches, PUT retries in its log)? A long transaction also holds it",
            HumanBytes(threshold)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_slot(name: &str, slot: &Value) {
    if let Some(err) = slot["error"].as_str() {
        println!("slot         {name}: cannot ask Postgres: {err}");
        return;
    }
    if slot["exists"] == false {
        println!("slot         {name}: MISSING (run `waltail run`, or see its message)");
        return;
    }
    let active = match slot["active_pid"].as_i64() {
        Some(pid) => format!("active (walsender pid {pid})"),
        None => "inactive (no `waltail run` connected)".to_string(),
    };
    println!(
        "slot         {name}: {active}, confirmed {}{}",
        slot["confirmed_flush_lsn"].as_str().unwrap_or("-"),
        slot["wal_status"]
            .as_str()
            .map(|s| format!(", wal_status {s}"))
            .unwrap_or_default()
    );
    let lag = slot["lag_bytes"].as_i64().unwrap_or(0);
    let seconds = slot["flush_lag_s"]
        .as_f64()
        .map(|s| format!(", {s:.1} s behind"))
        .unwrap_or_default();
    println!(
        "server WAL   {}, lag {}{seconds}",
        slot["server_wal_lsn"].as_str().unwrap_or("-"),
        HumanBytes(lag.max(0) as u64)
    );
}

/// The slot as Postgres sees it; `{"error": ...}` when Postgres cannot be asked.
async fn slot_status(config: &Config) -> Value {
    let result = async {
        let client = source::connect_sql(&config.source).await?;
        let row = client
            .query_opt(
                "SELECT s.active_pid, s.confirmed_flush_lsn::text, pg_current_wal_lsn()::text,
                        (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint,
                        (SELECT extract(epoch FROM r.flush_lag)::float8
                         FROM pg_stat_replication r WHERE r.pid = s.active_pid),
                        to_jsonb(s) ->> 'wal_status'
                 FROM pg_replication_slots s WHERE s.slot_name = $1",
                &[&config.source.slot],
            )
            .await
            .map_err(|e| Error::postgres("reading the slot", e))?;
        Ok::<Value, Error>(match row {
            None => json!({ "exists": false }),
            Some(r) => json!({
                "exists": true,
                "active_pid": r.get::<_, Option<i32>>(0),
                "confirmed_flush_lsn": r.get::<_, Option<String>>(1),
                "server_wal_lsn": r.get::<_, Option<String>>(2),
                "lag_bytes": r.get::<_, Option<i64>>(3),
                "flush_lag_s": r.get::<_, Option<f64>>(4),
                "wal_status": r.get::<_, Option<String>>(5),
            }),
        })
    }
    .await;
    result.unwrap_or_else(|e| json!({ "error": Report(&e).to_string() }))
}
