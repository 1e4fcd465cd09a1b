//! The pipeline's side of a backfill: the watermarks it meets in the
//! stream open and close chunk windows ([`Windows`] holds their state), a
//! high watermark emits the chunk's stored rows as `read` events in its
//! place, and a low watermark's transaction is held until those events
//! are written (see `source::backfill` for the whole scheme).

use std::sync::Arc;

use super::*;

impl Pipeline<'_> {
    /// A backfill watermark of this pipeline (see `source::backfill`): a low
    /// one opens a chunk's window in its lane (closing the lane's previous
    /// one, whose chunk was given up), a high one emits the chunk's rows not
    /// changed inside the window as `read` events of its own transaction.
    pub(super) async fn watermark(
        &mut self,
        content: &[u8],
        commit_lsn: u64,
        commit_ts: i64,
    ) -> Result<()> {
        let Ok(mark) = serde_json::from_slice::<Watermark>(content) else {
            tracing::debug!("ignoring a waltail message that is not a watermark");
            return Ok(());
        };
        if mark.pipeline != self.pipeline {
            return Ok(());
        }
        let lane = mark.lane;
        match mark.mark {
            Mark::Low | Mark::Abort => {
                // `backfill --cancel` closes every lane's window: a task
                // waiting for one of these chunks must not wait for a high
                // watermark the stream will now ignore.
                let closing: Vec<u32> = if mark.mark == Mark::Abort && mark.chunk == CANCEL_CHUNK {
                    self.windows.lanes()
                } else {
                    vec![lane]
                };
                for lane in closing {
                    if let Some(w) = self.windows.close(lane) {
                        tracing::debug!(chunk = w.chunk, lane, "backfill chunk given up");
                        // Its rows are not emitted: not kept in memory either.
                        self.backfill.handoff().take(w.chunk);
                        self.hold_low(w.low_end, 0);
                        if mark.mark == Mark::Abort {
                            self.report_chunk(lane, w.chunk);
                        }
                    }
                }
                if mark.mark == Mark::Abort {
                    // Passed: the backfill task may go on (see its driver).
                    self.report_chunk(lane, mark.chunk);
                    return Ok(());
                }
                let Some(chunk) = self.checkpoint.chunk(mark.chunk)? else {
                    tracing::warn!(
                        chunk = mark.chunk,
                        "a backfill watermark for a chunk the local state does not know; ignored"
                    );
                    return Ok(());
                };
                let table = backfill::table_ref(&chunk.schema, &chunk.table);
                self.windows.open(lane, mark.chunk, table.name.clone());
            }
            Mark::High => {
                let open = self.windows.is_open(lane, mark.chunk);
                let chunk = self.checkpoint.chunk(mark.chunk)?;
                if !open {
                    // Windows overlap, so the cursor may be confirmed past
                    // this chunk's low watermark (its `read` events were
                    // written) but not past its high one, whose window is
                    // then not opened again after a restart. The chunk is
                    // done in the state: its rows go out again as before,
                    // so the changes after it keep their seqs.
                    if let Some(chunk) = chunk.filter(|c| c.done && c.stored) {
                        tracing::info!(
                            chunk = chunk.id,
                            lane,
                            "a backfill chunk done before the restart: its read events go out again with their seqs"
                        );
                        let rows = self.chunk_rows(chunk.id)?;
                        let skipped = self.checkpoint.chunk_skipped(chunk.id)?;
                        self.emit_chunk(&chunk, &rows, &skipped, commit_lsn, commit_ts)
                            .await?;
                    }
                    return Ok(());
                }
                let (Some(chunk), true) =
                    (chunk.as_ref(), chunk.as_ref().is_some_and(|c| c.stored))
                else {
                    tracing::warn!(
                        chunk = mark.chunk,
                        "a backfill chunk's rows are missing from the local state; the chunk is read again"
                    );
                    self.windows.sent(lane, 0, Vec::new());
                    return Ok(());
                };
                let started = std::time::Instant::now();
                let rows = self.chunk_rows(chunk.id)?;
                let loaded = started.elapsed();
                let skipped = self
                    .windows
                    .skipped(lane, rows.iter().map(|(hash, _)| hash));
                let sent = self
                    .emit_chunk(chunk, &rows, &skipped, commit_lsn, commit_ts)
                    .await?;
                tracing::debug!(
                    chunk = chunk.id,
                    lane,
                    sent,
                    loaded = ?loaded,
                    took = ?started.elapsed(),
                    "backfill chunk emitted"
                );
                self.windows.sent(lane, sent, skipped);
            }
        }
        Ok(())
    }

    /// A stored chunk's rows: as its reader handed them over, or from its
    /// file (after a restart, or when the hand-over no longer holds them).
    fn chunk_rows(&mut self, chunk: i64) -> Result<Arc<ChunkBody>> {
        match self.backfill.handoff().take(chunk) {
            Some(rows) => Ok(rows),
            None => Ok(Arc::new(self.checkpoint.chunk_rows(chunk)?)),
        }
    }

    /// Emits a stored chunk's `rows` as `read` events, but those at the
    /// places `skipped` (ascending); returns how many went out.
    async fn emit_chunk(
        &mut self,
        chunk: &Chunk,
        rows: &ChunkBody,
        skipped: &[u32],
        commit_lsn: u64,
        commit_ts: i64,
    ) -> Result<u64> {
        let table = backfill::table_ref(&chunk.schema, &chunk.table);
        if let Some(members) = &chunk.members {
            self.schema(TableSchema {
                table: table.clone(),
                members: members.clone(),
            })
            .await?;
        }
        let mut sent = 0;
        let mut skipped = skipped.iter().peekable();
        // One change, its data's buffer used again for every row.
        let mut change = envelope::Change {
            op: envelope::Op::Read,
            table,
            data: Some(Vec::new()),
            old: None,
            commit_lsn,
            commit_ts,
            index: 0,
            rows: envelope::RowSet::default(),
        };
        for (ord, (hash, data)) in rows.iter().enumerate() {
            if skipped.next_if(|&&s| s as usize == ord).is_some() {
                continue;
            }
            sent += 1;
            let buffer = change.data.as_mut().expect("set above");
            buffer.clear();
            buffer.extend_from_slice(data);
            change.index = ord as u32;
            change.rows = envelope::RowSet::one(hash);
            self.push_change(&change)?;
        }
        Ok(sent)
    }

    /// Tells the backfill task the stream has passed this chunk of `lane`.
    pub(super) fn report_chunk(&self, lane: u32, chunk: i64) {
        self.chunks_done
            .send_if_modified(|passed| passed.pass(lane, chunk));
    }

    /// Sets how far a low watermark's transaction waits: until seq `until`
    /// is written (0: no longer than its own changes).
    pub(super) fn hold_low(&mut self, low_end: Option<u64>, until: u64) {
        if let Some(p) = self
            .txns
            .iter_mut()
            .find(|p| Some(p.end_lsn) == low_end && p.until == u64::MAX)
        {
            p.until = until.max(p.last_seq);
        }
        self.advance();
    }
}
