//! The latest view: one row per key, the version with the highest seq,
//! written as `[prefix/]latest/<schema>/<table>/<generation>-<bucket>-<part>.parquet`
//! with the data columns and `_seq`, `_lsn`, `_key`.
//!
//! A run merges the previous generation (read back through DataFusion) with
//! its new changes, applied in seq order: an upsert replaces the row and
//! takes the previous version's value for every column it left out
//! (unchanged TOAST); an update that moves the key drops the old key's row;
//! a delete drops the row; a truncate drops every row. It then writes a new
//! generation under new names; one commit to the view's Delta log removes
//! the previous generation's files and adds the new ones, so a reader of
//! the log sees one generation or the other, never a mix. The removed files
//! stay for time travel until vacuum deletes them.
//!
//! Buckets: a table's keys are split into `n` buckets by the hash of the
//! key ([`super::spool::bucket_of`], `n` a power of two recorded in the
//! table's Delta configuration), and the view is merged and written bucket by bucket (two at
//! a time, see `compact::write::MERGERS`), as files
//! `<generation>-<bucket>-<part>.parquet`: memory holds the rows of two
//! buckets, not the table's. `n` grows (doubling) with the table; bucket
//! `b` of `n` then draws its previous rows from bucket `b % n_before`.
//! An update that moves a row to a key of another bucket is applied in
//! both: the old key's bucket drops the row, the new key's bucket takes the
//! values it left out (unchanged TOAST) from the old row, replaying the old
//! bucket up to that change when it comes later in the merge.
//!
//! A view does not copy values: its sources are the Arrow batches it is
//! merged from (the previous generation's, a round's spooled ones), and a
//! row is where its values are (a source and a row; per column when an
//! upsert left columns out). Applying a change is a hash lookup; values
//! are copied once, gathered (`interleave`) into the batches written. The
//! sources stay whole until then, superseded versions too: the bucket
//! count sizes a bucket for every version the run brings (see
//! `compact::write::bucket_count`). Gathering a view's rows into a new source
//! after each spool round, to hold less, was 8% of compact's CPU on the
//! benchmark (merge phase 1.5 -> 1.2 s without). Building a
//! value per row instead (read back, moved into the map, converted back to
//! Arrow) made the merge 2.5 times slower.

mod merge;
mod view;

pub use self::merge::{MergeInput, merge_bucket};
pub use self::view::{LatestTarget, LatestView, WrittenFile, file_bucket};
