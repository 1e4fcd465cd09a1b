//! The archive format, in one place for the three that touch it: the
//! streaming writer, `compact` and `query`.
//!
//! - [`envelope`]: one JSON line per change (the output contract's fields and
//!   their order), written by the pipeline and read back by the readers.
//! - [`key`]: where an object or a schema record lives, formatted by the
//!   writer and parsed by the listings.
//! - [`codec`]: how an object's bytes are encoded, named by its key's suffix.
//! - [`schema`]: a table's columns and types, one record per shape.
//!
//! Nothing here talks to Postgres or a store, so every module above can use
//! it and it uses none of them.

pub mod codec;
pub mod envelope;
pub mod key;
pub mod schema;
