//! The type registry: the OIDs of the built-in types that [`super::write_json`]
//! renders by type, and which array type holds which element type. The
//! OIDs are fixed in every Postgres release (`pg_type.oid` of the built-in
//! types), so they are constants rather than catalog lookups; user-defined
//! types are resolved through the catalog ([`crate::source::catalog`]).

/// `bool`: JSON `true` / `false`.
pub const BOOL: u32 = 16;
/// `bytea`: a base64 JSON string.
pub const BYTEA: u32 = 17;
/// `"char"`, the one-byte internal type: a JSON string.
pub const CHAR: u32 = 18;
/// `name`, the catalogs' identifier type: a JSON string.
pub const NAME: u32 = 19;
/// `int8` (`bigint`): a JSON number.
pub const INT8: u32 = 20;
/// `int2` (`smallint`): a JSON number.
pub const INT2: u32 = 21;
/// `int4` (`integer`): a JSON number.
pub const INT4: u32 = 23;
/// `text`: a JSON string.
pub const TEXT: u32 = 25;
/// `oid`: a JSON number.
pub const OID: u32 = 26;
/// `json`: embedded as JSON, its whitespace kept (newlines made spaces).
pub const JSON: u32 = 114;
/// `float4` (`real`): a JSON number; NaN and the infinities a string.
pub const FLOAT4: u32 = 700;
/// `float8` (`double precision`): a JSON number; NaN and the infinities a string.
pub const FLOAT8: u32 = 701;
/// `bpchar` (`char(n)`): a JSON string, blank padding kept.
pub const BPCHAR: u32 = 1042;
/// `varchar`: a JSON string.
pub const VARCHAR: u32 = 1043;
/// `date`: a JSON string, `2024-03-01`.
pub const DATE: u32 = 1082;
/// `time`: a JSON string, `12:34:56.789`.
pub const TIME: u32 = 1083;
/// `timestamp`: an ISO 8601 JSON string without offset.
pub const TIMESTAMP: u32 = 1114;
/// `timestamptz`: an ISO 8601 JSON string in UTC, `+00:00`.
pub const TIMESTAMPTZ: u32 = 1184;
/// `timetz`: a JSON string, `12:34:56+02`.
pub const TIMETZ: u32 = 1266;
/// `numeric`: a JSON number up to 15 significant digits (a double reads
/// it back exactly), else a JSON string.
pub const NUMERIC: u32 = 1700;
/// `uuid`: a JSON string.
pub const UUID: u32 = 2950;
/// `jsonb`: embedded as JSON.
pub const JSONB: u32 = 3802;

/// `json[]`: a JSON array of [`JSON`]'s values.
pub const JSON_ARRAY: u32 = 199;
/// `bool[]`: a JSON array of [`BOOL`]'s values.
pub const BOOL_ARRAY: u32 = 1000;
/// `bytea[]`: a JSON array of [`BYTEA`]'s values.
pub const BYTEA_ARRAY: u32 = 1001;
/// `"char"[]`: a JSON array of [`CHAR`]'s values.
pub const CHAR_ARRAY: u32 = 1002;
/// `name[]`: a JSON array of [`NAME`]'s values.
pub const NAME_ARRAY: u32 = 1003;
/// `int2[]`: a JSON array of [`INT2`]'s values.
pub const INT2_ARRAY: u32 = 1005;
/// `int4[]`: a JSON array of [`INT4`]'s values.
pub const INT4_ARRAY: u32 = 1007;
/// `text[]`: a JSON array of [`TEXT`]'s values.
pub const TEXT_ARRAY: u32 = 1009;
/// `bpchar[]`: a JSON array of [`BPCHAR`]'s values.
pub const BPCHAR_ARRAY: u32 = 1014;
/// `varchar[]`: a JSON array of [`VARCHAR`]'s values.
pub const VARCHAR_ARRAY: u32 = 1015;
/// `int8[]`: a JSON array of [`INT8`]'s values.
pub const INT8_ARRAY: u32 = 1016;
/// `float4[]`: a JSON array of [`FLOAT4`]'s values.
pub const FLOAT4_ARRAY: u32 = 1021;
/// `float8[]`: a JSON array of [`FLOAT8`]'s values.
pub const FLOAT8_ARRAY: u32 = 1022;
/// `oid[]`: a JSON array of [`OID`]'s values.
pub const OID_ARRAY: u32 = 1028;
/// `timestamp[]`: a JSON array of [`TIMESTAMP`]'s values.
pub const TIMESTAMP_ARRAY: u32 = 1115;
/// `date[]`: a JSON array of [`DATE`]'s values.
pub const DATE_ARRAY: u32 = 1182;
/// `time[]`: a JSON array of [`TIME`]'s values.
pub const TIME_ARRAY: u32 = 1183;
/// `timestamptz[]`: a JSON array of [`TIMESTAMPTZ`]'s values.
pub const TIMESTAMPTZ_ARRAY: u32 = 1185;
/// `numeric[]`: a JSON array of [`NUMERIC`]'s values.
pub const NUMERIC_ARRAY: u32 = 1231;
/// `timetz[]`: a JSON array of [`TIMETZ`]'s values.
pub const TIMETZ_ARRAY: u32 = 1270;
/// `uuid[]`: a JSON array of [`UUID`]'s values.
pub const UUID_ARRAY: u32 = 2951;
/// `jsonb[]`: a JSON array of [`JSONB`]'s values.
pub const JSONB_ARRAY: u32 = 3807;

/// The element type of a supported array type, or `None` if `oid` is not one.
pub fn array_element_type(oid: u32) -> Option<u32> {
    Some(match oid {
        JSON_ARRAY => JSON,
        BOOL_ARRAY => BOOL,
        BYTEA_ARRAY => BYTEA,
        CHAR_ARRAY => CHAR,
        NAME_ARRAY => NAME,
        INT2_ARRAY => INT2,
        INT4_ARRAY => INT4,
        TEXT_ARRAY => TEXT,
        BPCHAR_ARRAY => BPCHAR,
        VARCHAR_ARRAY => VARCHAR,
        INT8_ARRAY => INT8,
        FLOAT4_ARRAY => FLOAT4,
        FLOAT8_ARRAY => FLOAT8,
        OID_ARRAY => OID,
        TIMESTAMP_ARRAY => TIMESTAMP,
        DATE_ARRAY => DATE,
        TIME_ARRAY => TIME,
        TIMESTAMPTZ_ARRAY => TIMESTAMPTZ,
        NUMERIC_ARRAY => NUMERIC,
        TIMETZ_ARRAY => TIMETZ,
        UUID_ARRAY => UUID,
        JSONB_ARRAY => JSONB,
        _ => return None,
    })
}

/// Every type OID below this is built into Postgres (FirstNormalObjectId);
/// user-defined types (enums, domains, composites, extension types) are above.
pub const FIRST_NORMAL_OID: u32 = 16384;

/// The array type of a supported element type (the inverse of [`array_element_type`]).
pub fn array_type_of(elem: u32) -> Option<u32> {
    const ARRAYS: [u32; 22] = [
        JSON_ARRAY,
        BOOL_ARRAY,
        BYTEA_ARRAY,
        CHAR_ARRAY,
        NAME_ARRAY,
        INT2_ARRAY,
        INT4_ARRAY,
        TEXT_ARRAY,
        BPCHAR_ARRAY,
        VARCHAR_ARRAY,
        INT8_ARRAY,
        FLOAT4_ARRAY,
        FLOAT8_ARRAY,
        OID_ARRAY,
        TIMESTAMP_ARRAY,
        DATE_ARRAY,
        TIME_ARRAY,
        TIMESTAMPTZ_ARRAY,
        NUMERIC_ARRAY,
        TIMETZ_ARRAY,
        UUID_ARRAY,
        JSONB_ARRAY,
    ];
    ARRAYS
        .into_iter()
        .find(|&a| array_element_type(a) == Some(elem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_types_invert_element_types() {
        assert_eq!(array_type_of(INT4), Some(INT4_ARRAY));
        assert_eq!(array_type_of(TEXT), Some(TEXT_ARRAY));
        assert_eq!(array_type_of(12345), None);
    }
}
