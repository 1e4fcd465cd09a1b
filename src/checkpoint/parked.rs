//! The parking lot's side of the state: batches that failed every attempt
//! (parked) and those held behind them, with their bytes, so they count as
//! durable for confirmation and survive a restart until `waltail parked
//! replay` delivers them (see [`crate::delivery::parking`] for the rules).

use rusqlite::params;

use super::Checkpoint;
use crate::row_identity;
use crate::{Error, Result};

/// Where a parked-table batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParkStatus {
    /// Failed every attempt; waits for `waltail parked replay`.
    Parked,
    /// Touches a row of a parked batch; released after it, in seq order.
    Held,
    /// An operator asked for a replay; the running pipeline delivers it.
    Replay,
}

impl ParkStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ParkStatus::Parked => "parked",
            ParkStatus::Held => "held",
            ParkStatus::Replay => "replay",
        }
    }

    fn parse(s: &str) -> ParkStatus {
        match s {
            "held" => ParkStatus::Held,
            "replay" => ParkStatus::Replay,
            _ => ParkStatus::Parked,
        }
    }
}

/// A parked or held batch as stored.
#[derive(Debug, Clone)]
pub(crate) struct Parked {
    pub first_seq: u64,
    pub last_seq: u64,
    pub key: String,
    pub body: Vec<u8>,
    pub rows: Vec<u64>,
    pub tables: String,
    pub status: ParkStatus,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub parked_at: String,
}

impl Parked {
    /// The tables the batch touches (kept by name, comma-separated).
    pub(crate) fn tables(&self) -> Vec<std::sync::Arc<crate::archive::envelope::TableRef>> {
        self.table_names()
            .map(|name| {
                std::sync::Arc::new(crate::archive::envelope::TableRef::from_name(
                    name.to_string(),
                ))
            })
            .collect()
    }

    /// The identities of the tables the batch touches (see
    /// [`row_identity::Holds`]).
    pub(crate) fn table_hashes(&self) -> Vec<u64> {
        self.table_names().map(row_identity::table).collect()
    }

    /// The names in `tables`, as [`crate::batch::Batch::table_names`]
    /// joined them.
    fn table_names(&self) -> impl Iterator<Item = &str> {
        self.tables.split(',').filter(|name| !name.is_empty())
    }
}

fn rows_to_blob(rows: &[u64]) -> Vec<u8> {
    rows.iter().flat_map(|r| r.to_le_bytes()).collect()
}

fn rows_from_blob(blob: &[u8]) -> Vec<u64> {
    blob.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

const PARKED_COLUMNS: &str =
    "first_seq, last_seq, key, body, rows, tables, status, attempts, last_error, parked_at";

fn parked_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Parked> {
    Ok(Parked {
        first_seq: r.get::<_, i64>(0)? as u64,
        last_seq: r.get::<_, i64>(1)? as u64,
        key: r.get(2)?,
        body: r.get(3)?,
        rows: rows_from_blob(&r.get::<_, Vec<u8>>(4)?),
        tables: r.get(5)?,
        status: ParkStatus::parse(&r.get::<_, String>(6)?),
        attempts: r.get::<_, i64>(7)? as u32,
        last_error: r.get(8)?,
        parked_at: r.get(9)?,
    })
}

impl Checkpoint {
    /// Stores a batch as parked or held and marks its intent done (it is
    /// durable here; restarts skip its seqs), in one transaction.
    pub(crate) fn park(&mut self, p: &Parked) -> Result<()> {
        let path = self.path.display().to_string();
        let err = |source| Error::State {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        tx.execute(
            &format!(
                "INSERT INTO parked ({PARKED_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                 ON CONFLICT (first_seq) DO UPDATE SET status = excluded.status,
                     attempts = excluded.attempts, last_error = excluded.last_error,
                     parked_at = excluded.parked_at"
            ),
            params![
                p.first_seq as i64,
                p.last_seq as i64,
                p.key,
                p.body,
                rows_to_blob(&p.rows),
                p.tables,
                p.status.as_str(),
                p.attempts as i64,
                p.last_error,
                p.parked_at
            ],
        )
        .map_err(err)?;
        // A batch held before its PUT may have no intent yet.
        tx.execute(
            "INSERT INTO intents (first_seq, last_seq, done) VALUES (?1, ?2, 1)
             ON CONFLICT (first_seq) DO UPDATE SET done = 1",
            params![p.first_seq as i64, p.last_seq as i64],
        )
        .map_err(err)?;
        tx.commit().map_err(err)
    }

    /// Every parked, held or replay-requested batch, in seq order.
    pub(crate) fn parked(&self) -> Result<Vec<Parked>> {
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {PARKED_COLUMNS} FROM parked ORDER BY first_seq"
            ))
            .map_err(self.err())?;
        let rows = stmt.query_map([], parked_row).map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }

    /// Forgets a parked or held batch once it is written.
    pub(crate) fn unpark(&mut self, first_seq: u64) -> Result<()> {
        self.conn
            .execute(
                "DELETE FROM parked WHERE first_seq = ?1",
                [first_seq as i64],
            )
            .map(|_| ())
            .map_err(self.err())
    }

    /// Asks the running pipeline to replay parked batches (`None`: all of
    /// them). Returns how many were marked.
    pub(crate) fn request_replay(&mut self, first_seq: Option<u64>) -> Result<usize> {
        let n = match first_seq {
            Some(id) => self.conn.execute(
                "UPDATE parked SET status = 'replay' WHERE first_seq = ?1 AND status = 'parked'",
                [id as i64],
            ),
            None => self.conn.execute(
                "UPDATE parked SET status = 'replay' WHERE status = 'parked'",
                [],
            ),
        };
        n.map_err(self.err())
    }

    /// A number that changes whenever another connection (e.g. `waltail
    /// parked replay`) has committed to this database: cheap to poll.
    pub(crate) fn data_version(&self) -> Result<i64> {
        self.conn
            .query_row("PRAGMA data_version", [], |r| r.get(0))
            .map_err(self.err())
    }
}

impl Checkpoint {
    /// Like [`Checkpoint::parked`], without the batches' bytes and rows (left
    /// empty): for listings polled often, such as the console's.
    pub(crate) fn parked_listing(&self) -> Result<Vec<Parked>> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT first_seq, last_seq, key, X'', X'', tables, status, attempts, last_error, parked_at
                 FROM parked ORDER BY first_seq",
            )
            .map_err(self.err())?;
        let rows = stmt.query_map([], parked_row).map_err(self.err())?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.err())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::archive::codec::Codec;

    /// A parked batch of seqs `first_seq..first_seq + 9` touching `rows`
    /// of `public.t` (the parking lot's tests use it too).
    pub(crate) fn parked(first_seq: u64, rows: &[u64], status: ParkStatus) -> Parked {
        Parked {
            first_seq,
            last_seq: first_seq + 9,
            key: format!("k{first_seq}"),
            body: b"{}\n".to_vec(),
            rows: rows.to_vec(),
            tables: "public.t".into(),
            status,
            attempts: 5,
            last_error: Some("boom".into()),
            parked_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    #[test]
    fn parked_batches_round_trip_and_mark_their_intent_done() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::open(&dir.path().join("p.sqlite")).unwrap();
        cp.record_intent(1, 10, Codec::None).unwrap();
        cp.park(&parked(1, &[7, 8], ParkStatus::Parked)).unwrap();
        assert!(cp.open_intents(1).unwrap()[0].done);
        let got = cp.parked().unwrap();
        assert_eq!(got[0].rows, vec![7, 8]);
        assert_eq!(got[0].last_error.as_deref(), Some("boom"));
        assert_eq!(cp.request_replay(None).unwrap(), 1);
        assert_eq!(cp.parked().unwrap()[0].status, ParkStatus::Replay);
        cp.unpark(1).unwrap();
        assert!(cp.parked().unwrap().is_empty());
    }

    #[test]
    fn parked_listing_leaves_out_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::open(&dir.path().join("p.sqlite")).unwrap();
        cp.park(&parked(1, &[7], ParkStatus::Parked)).unwrap();
        cp.park(&parked(11, &[7], ParkStatus::Held)).unwrap();
        let listed = cp.parked_listing().unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].key.as_str(), listed[0].attempts), ("k1", 5));
        assert_eq!(listed[1].status, ParkStatus::Held);
        assert!(
            listed
                .iter()
                .all(|p| p.body.is_empty() && p.rows.is_empty())
        );
    }
}
