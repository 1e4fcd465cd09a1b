//! Compression of archive objects (`destination.compression`): none (the
//! product page's plain `.ndjson`), gzip (`.ndjson.gz`) or zstd
//! (`.ndjson.zst`). The key says which, so an archive may mix them (the
//! setting changed between runs) and every reader, `compact`, `query`,
//! DuckDB's `read_ndjson_auto`, Spark, Athena, decodes each object by its
//! name; S3 objects also carry the matching `Content-Encoding`.
//!
//! Encoding is deterministic (gzip with no name and no time in its header,
//! a fixed level for each codec), so a batch sent again after a crash is the
//! same object, byte for byte, as the product's idempotency promises. The
//! codec a batch was first sent with is recorded with its intent, so a
//! batch re-formed after the setting changed keeps its key.

use std::io::{Read, Write};

use crate::error::ErrorKind;
use crate::{Error, Result};

/// The level gzip encodes at: zlib's default, the usual size/speed balance.
const GZIP_LEVEL: u32 = 6;
/// The level zstd encodes at: its default, smaller than gzip's 6 at several
/// times its speed.
const ZSTD_LEVEL: i32 = 3;
/// An object that decodes to more than this is refused rather than read
/// into memory: the writer's objects are at most
/// `delivery.max_batch_bytes` (256 MiB at most) before encoding.
pub const MAX_DECODED_BYTES: u64 = 1 << 30;

/// How an archive object's NDJSON is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Plain NDJSON, `.ndjson`: readable by anything, the largest objects.
    None,
    /// gzip, `.ndjson.gz`: the codec every reader (Athena, Spark) decodes.
    Gzip,
    /// zstd, `.ndjson.zst`: smaller and faster than gzip where readers have it.
    Zstd,
}

impl Codec {
    /// The setting's values, as `destination.compression` spells them.
    pub const NAMES: [&'static str; 3] = ["none", "gzip", "zstd"];

    /// The codec of a `destination.compression` value.
    pub fn from_name(name: &str) -> Option<Codec> {
        match name {
            "none" => Some(Codec::None),
            "gzip" => Some(Codec::Gzip),
            "zstd" => Some(Codec::Zstd),
            _ => None,
        }
    }

    /// As `destination.compression` spells it (and the state records it).
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Gzip => "gzip",
            Codec::Zstd => "zstd",
        }
    }

    /// What the object key ends with after `.ndjson`.
    pub fn suffix(self) -> &'static str {
        match self {
            Codec::None => "",
            Codec::Gzip => ".gz",
            Codec::Zstd => ".zst",
        }
    }

    /// The HTTP `Content-Encoding` of an object (none for plain NDJSON).
    pub fn content_encoding(self) -> Option<&'static str> {
        match self {
            Codec::None => None,
            Codec::Gzip => Some("gzip"),
            Codec::Zstd => Some("zstd"),
        }
    }

    /// An archive key's codec and the key without the codec's suffix
    /// (ending in `.ndjson` when it is an archive object).
    pub fn of_key(key: &str) -> (Codec, &str) {
        if let Some(stem) = key.strip_suffix(".gz") {
            (Codec::Gzip, stem)
        } else if let Some(stem) = key.strip_suffix(".zst") {
            (Codec::Zstd, stem)
        } else {
            (Codec::None, key)
        }
    }

    /// `body` encoded (the same bytes every time for the same body). An
    /// encoder's failure is an error, never an empty object.
    pub fn encode(self, body: Vec<u8>) -> Result<Vec<u8>> {
        let encoded = match self {
            Codec::None => return Ok(body),
            Codec::Gzip => {
                let mut out = flate2::write::GzEncoder::new(
                    Vec::with_capacity(body.len() / 4),
                    flate2::Compression::new(GZIP_LEVEL),
                );
                out.write_all(&body).and_then(|()| out.finish())
            }
            Codec::Zstd => zstd::bulk::compress(&body, ZSTD_LEVEL),
        };
        encoded.map_err(|e| Error::bug(format!("{} encoding of a batch failed: {e}", self.name())))
    }

    /// The NDJSON of the object `key` whose stored bytes are `body`.
    pub fn decode(key: &str, body: bytes::Bytes) -> Result<bytes::Bytes> {
        let (codec, _) = Codec::of_key(key);
        let mut out = Vec::new();
        let read = match codec {
            Codec::None => return Ok(body),
            Codec::Gzip => flate2::read::MultiGzDecoder::new(&body[..])
                .take(MAX_DECODED_BYTES + 1)
                .read_to_end(&mut out),
            Codec::Zstd => zstd::stream::read::Decoder::new(&body[..])
                .and_then(|d| d.take(MAX_DECODED_BYTES + 1).read_to_end(&mut out)),
        };
        let what = || format!("the archive object {key}");
        read.map_err(|e| {
            Error::io(
                format!(
                    "cannot decode {} ({}): the object is damaged",
                    what(),
                    codec.name()
                ),
                e,
            )
        })?;
        if out.len() as u64 > MAX_DECODED_BYTES {
            return Err(Error::fatal(
                format!("{} decodes to more than {MAX_DECODED_BYTES} bytes", what()),
                "no object waltail writes is that large; move it out of the archive",
            )
            .with_kind(ErrorKind::Archive));
        }
        Ok(out.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_codec_round_trips_deterministically_by_its_key() {
        let body: Vec<u8> = (0..2000)
            .flat_map(|i| format!("{{\"op\":\"insert\",\"seq\":{i}}}\n").into_bytes())
            .collect();
        for codec in [Codec::None, Codec::Gzip, Codec::Zstd] {
            let key = format!("p/2026/12/03/w-1-2000.ndjson{}", codec.suffix());
            let encoded = codec.encode(body.clone()).unwrap();
            assert_eq!(
                encoded,
                codec.encode(body.clone()).unwrap(),
                "{codec:?} is not deterministic"
            );
            if codec != Codec::None {
                assert!(
                    encoded.len() * 4 < body.len(),
                    "{codec:?}: {}",
                    encoded.len()
                );
            }
            assert_eq!(Codec::of_key(&key), (codec, "p/2026/12/03/w-1-2000.ndjson"));
            assert_eq!(Codec::from_name(codec.name()), Some(codec));
            let decoded = Codec::decode(&key, encoded.into()).unwrap();
            assert_eq!(&decoded[..], &body[..]);
        }
        // gzip with no file name and no time: the standard header, so the
        // same on every machine.
        let gz = Codec::Gzip.encode(b"x\n".to_vec()).unwrap();
        assert_eq!(&gz[..10], &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
    }

    #[test]
    fn a_damaged_object_is_an_error_that_names_it() {
        let err = Codec::decode("p/w-1-2.ndjson.gz", bytes::Bytes::from_static(b"not gzip"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("p/w-1-2.ndjson.gz") && err.contains("damaged"),
            "{err}"
        );
        let mut zst = Codec::Zstd.encode(b"{\"a\":1}\n".repeat(100)).unwrap();
        zst.truncate(zst.len() - 3);
        assert!(Codec::decode("w-1-2.ndjson.zst", zst.into()).is_err());
    }
}
