//! The archive format, in one place for the three that touch it: the
//! streaming writer, `compact` and `query`.
//!
//! - [`envelope`]: one JSON line per change (the output contract's fields and
//!   their order), written by the pipeline and read back by the readers.
//! - [`key`]: where an object or a schema record lives, formatted by the
//!   writer and parsed by the listings.
//! - [`codec`]: how an object's bytes are encoded, named by its key's suffix.
//! - [`schema`]: a table's columns and types, one record per shape.
//! - [`listing`]: what an archive holds (its objects by seq range and date,
//!   its schema records), and reading an object back, for `compact` and
//!   `query` alike.
//!
//! Only `listing` reads a store (through `object_store`); nothing here talks
//! to Postgres or imports a stage, so every module above can use it.

pub mod codec;
pub mod envelope;
pub(crate) mod key;
#[cfg(feature = "lakehouse")]
pub(crate) mod listing;
pub mod schema;
