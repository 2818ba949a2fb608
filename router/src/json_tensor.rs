//! JSON ⇄ tensors for TF Serving's REST API, with the rules and error texts of TF Serving's
//! `util/json_tensor.cc`:
//! - a Predict body is an object with an optional `signature_name` and exactly one of
//!   `instances` (row format: a non-empty list, one element per row; with several inputs each
//!   element is an object naming every input) or `inputs` (columnar: one value, or an object
//!   of input name → value);
//! - a value's shape is read from its nesting (the first element of each list), every list at
//!   a level must have that length and every leaf sit at the same depth; its type is the
//!   signature's dtype for that input (JSON numbers must fit it: an int32 input takes only
//!   integers within int32);
//! - `{"b64": "..."}` is a binary string;
//! - answers: `{"predictions": [...]}` (row: one element per row, an object per row when
//!   there are several outputs, all outputs sharing their first dimension) or
//!   `{"outputs": ...}` (columnar); a DT_STRING output whose name ends in `_bytes` is written
//!   as `{"b64": ...}`; floats as TF Serving writes them (six significant digits unless that
//!   does not round-trip, NaN and ±Infinity spelled out).
//!
//! As TF Serving's parser (rapidjson with `kParseNanAndInfFlag | kParseStopWhenDoneFlag`
//! behind a UTF-8 stream that skips a byte-order mark): `NaN` and `Infinity` are numbers
//! (json_nonfinite.rs), text after the document is ignored, a leading BOM is skipped, and a
//! key given twice keeps its first value (rapidjson's lookups find the first), but for a
//! feature named twice in a `:classify`/`:regress` example, which keeps its last (TF Serving
//! walks the example's members and assigns each in turn).
//!
//! Differences: object keys are read in name order, so an error about a row names its inputs
//! in name order; a parse error's words are serde_json's (its offset is counted as
//! rapidjson counts it, in the client's bytes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use base64::Engine as _;
use bytes::Bytes;
use serde::de::DeserializeSeed as _;
use serde_json::Value;

use prost::Message;

use crate::codec::{self, dtype_name};
use crate::json_nonfinite;
use crate::proto::mpspool::tfs::{tensor_shape_proto::Dim, TensorProto, TensorShapeProto};
use crate::proto::tensorflow::serving::{
    feature, input, BytesList, ClassificationResult, ExampleList, ExampleListWithContext, Feature,
    FloatList, Input, Int64List, RegressionResult,
};
use crate::signature::{shape_text, TensorSpec};
use crate::status::{Code, ServingError};

const BASE64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// How a Predict body gave its inputs, which decides how the answer is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Row,
    Columnar,
}

/// A parsed Predict body: the signature it names ("" for the default) and its body, whose
/// tensors need the signature's dtypes to be read.
pub struct PredictBody {
    pub signature_name: String,
    document: serde_json::Map<String, Value>,
}

/// TF Serving's `JsonValueToDebugString`: compact JSON, cut at 256 bytes. Written only as
/// far as that needs, as TF Serving's `JsonWriterWithLimit` stops: writing a whole document
/// of 2 million rows for an error that quotes its first 256 bytes took seconds and hundreds
/// of MB outside the request budget (found by a REST hunt).
fn debug_string<T: serde::Serialize + ?Sized>(value: &T) -> String {
    const LIMIT: usize = 256;
    // Enough for 256 bytes once the non-finite numbers' markers (~45 bytes each, 3 once
    // restored) are written back as the client spelled them.
    let mut prefix = Prefix {
        bytes: Vec::new(),
        room: 32 * LIMIT,
    };
    // An error here is the prefix full: what it holds is what is wanted.
    let _ = serde_json::to_writer(&mut prefix, value);
    let mut text = json_nonfinite::restore(String::from_utf8_lossy(&prefix.bytes).into_owned());
    if text.len() > LIMIT {
        let mut cut = LIMIT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// A writer that keeps the first `room` bytes written and then refuses more.
struct Prefix {
    bytes: Vec<u8>,
    room: usize,
}

impl std::io::Write for Prefix {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let take = buf.len().min(self.room - self.bytes.len());
        self.bytes.extend_from_slice(&buf[..take]);
        if take < buf.len() {
            return Err(std::io::Error::other("the prefix is full"));
        }
        Ok(take)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "Null",
        Value::Bool(false) => "False",
        Value::Bool(true) => "True",
        Value::Object(_) => "Object",
        Value::Array(_) => "Array",
        Value::String(_) if json_nonfinite::number(value).is_some() => "Number",
        Value::String(_) => "String",
        Value::Number(_) => "Number",
    }
}

fn invalid(message: impl Into<String>) -> ServingError {
    ServingError::invalid_argument(message)
}

fn type_error(value: &Value, dtype: i32) -> ServingError {
    invalid(format!(
        "JSON Value: {} Type: {} is not of expected type: {}",
        debug_string(value),
        type_name(value),
        dtype_name(dtype)
    ))
}

fn format_error<T: serde::Serialize + ?Sized>(value: &T, what: &str) -> ServingError {
    invalid(format!("JSON Value: {} {what}", debug_string(value)))
}

/// A status as TF Serving's `Status::ToString` prints it inside another message.
fn nested(error: &ServingError) -> String {
    format!("{}: {}", error.code.name(), error.message)
}

/// What serde_json allocates for a JSON document, roughly, per piece: a `Value` is 32 bytes
/// and an array's vector may have room for twice its length; an object is a B-tree whose
/// first node has room for 11 entries (about 640 bytes with one). Strings: their own bytes.
const VALUE_COST: usize = 64;
const OBJECT_COST: usize = 640;

/// The most building the document of a `len`-byte body could take, without reading it: a
/// byte starts at most one object.
pub fn most_parse_cost(len: usize) -> usize {
    len.saturating_mul(1 + OBJECT_COST)
        .saturating_add(VALUE_COST)
}

/// What building a body's document would take, by its pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseCost {
    pub body_bytes: usize,
    pub values: usize,
    pub objects: usize,
}

impl ParseCost {
    /// The document's bytes, roughly: the body's own (strings) and each piece's.
    pub fn bytes(&self) -> usize {
        self.body_bytes
            .saturating_add(self.values.saturating_mul(VALUE_COST))
            .saturating_add(self.objects.saturating_mul(OBJECT_COST))
    }

    /// RESOURCE_EXHAUSTED when this document alone would take more than `budget` bytes.
    pub fn check(&self, budget: usize) -> Result<(), ServingError> {
        let cost = self.bytes();
        if cost <= budget {
            return Ok(());
        }
        Err(ServingError::new(
            crate::status::Code::ResourceExhausted,
            format!(
                "parsing this JSON body ({} bytes: {} values, {} objects) would take \
                 about {} MiB of memory, more than the {} MiB allowed (4 times \
                 --max-message-bytes, at least 256); send fewer values per request, or use \
                 gRPC",
                self.body_bytes,
                self.values,
                self.objects,
                cost >> 20,
                budget >> 20
            ),
        ))
    }
}

/// What the document of `body` would take to build: `{"a":1},` repeated costs ~90 times its
/// size, `[0,0,...]` ~30 (measured: a 96 MiB body took the front door to 8.7 GB). One pass
/// over the bytes, strings skipped, counting objects and values (a comma or an array's
/// opening each start one).
pub fn parse_cost(body: &[u8]) -> ParseCost {
    let (mut objects, mut values) = (0usize, 1usize);
    let (mut in_string, mut escaped) = (false, false);
    // Outside strings only a non-finite token has an N or an I; its marker is a string.
    let mut markers = 0usize;
    let mut strings = 0usize;
    for &byte in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
            continue;
        }
        match byte {
            b'"' => {
                in_string = true;
                strings += 1;
            }
            b'{' => objects += 1,
            b',' | b'[' => values += 1,
            b'N' | b'I' => markers += 1,
            _ => {}
        }
    }
    // A raw string's marker holds its bytes in hex: at most twice the string, and more.
    let raw = if json_nonfinite::may_hold_raw_strings(body) {
        body.len()
            .saturating_add(strings.saturating_mul(json_nonfinite::raw_added_bytes()))
    } else {
        0
    };
    ParseCost {
        body_bytes: body
            .len()
            .saturating_add(markers.saturating_mul(json_nonfinite::most_added_bytes()))
            .saturating_add(raw),
        values,
        objects,
    }
}

/// Parses the body as a JSON object (TF Serving's `ParseJson` + `FillSignature`).
pub fn parse_predict(body: &[u8]) -> Result<PredictBody, ServingError> {
    parse_body(body, Place::Value)
}

/// `parse_predict`, or with `Place::Document` a `:classify`/`:regress` body, whose example
/// objects keep a key's last value (see `Place`).
fn parse_body(body: &[u8], place: Place) -> Result<PredictBody, ServingError> {
    let document = parse_object(body, place)?;
    let signature_name = match document.get("signature_name") {
        None => String::new(),
        Some(name @ Value::String(_)) if json_nonfinite::number(name).is_none() => {
            json_nonfinite::string_text(name)
                .unwrap_or_default()
                .into_owned()
        }
        Some(_) => {
            return Err(format_error(
                &document,
                "not formatted correctly. 'signature_name' key must be a string value.",
            ))
        }
    };
    Ok(PredictBody {
        signature_name,
        document,
    })
}

fn parse_object(body: &[u8], place: Place) -> Result<serde_json::Map<String, Value>, ServingError> {
    let whole = body.len();
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    if body.is_empty() {
        return Err(invalid("JSON Parse error: The document is empty"));
    }
    let text = json_nonfinite::rewrite(body);
    // The first document only, as rapidjson's kParseStopWhenDoneFlag: no `end()` check.
    let mut parser = serde_json::Deserializer::from_slice(&text);
    let value = FirstWins(place)
        .deserialize(&mut parser)
        .map_err(|error: serde_json::Error| {
            // In the client's bytes, as rapidjson counts them: its stream skips a BOM but
            // counts it, and reads the non-finite tokens in place.
            let at = offset_of(&text, error.line(), error.column());
            let offset = whole - body.len() + json_nonfinite::original_offset(body, at);
            invalid(format!("JSON Parse error: {error} at offset: {offset}"))
        })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(format_error(&other, "Is not object")),
    }
}

/// A document as serde_json's `Value`, except that an object's key given twice keeps its
/// first value: rapidjson keeps both and its lookups (`FindMember`) find the first, where
/// serde_json's own map keeps the last. The exception is an example object of a
/// `:classify`/`:regress` body: TF Serving walks all its members and assigns each feature in
/// turn (`MakeExampleFromJsonObject`), so there the last one stays.
struct FirstWins(Place);

/// Where a value sits, for the one place where a key's last value wins.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Anywhere else: its objects keep a key's first value.
    Value,
    /// A `:classify`/`:regress` body: its `context` is an example, its `examples` a list.
    Document,
    /// The `examples` list: its objects are examples.
    Examples,
    /// An example object: a feature named twice keeps its last value.
    Example,
}

impl<'de> serde::de::DeserializeSeed<'de> for FirstWins {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, parser: D) -> Result<Value, D::Error> {
        parser.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for FirstWins {
    type Value = Value;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // What serde_json's own Value does (its parser yields no non-finite float).
        Ok(serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, parser: D) -> Result<Value, D::Error> {
        self.deserialize(parser)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut items: A) -> Result<Value, A::Error> {
        let inside = match self.0 {
            Place::Examples => Place::Example,
            _ => Place::Value,
        };
        let mut values = Vec::new();
        while let Some(value) = items.next_element_seed(FirstWins(inside))? {
            values.push(value);
        }
        Ok(Value::Array(values))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut entries: A) -> Result<Value, A::Error> {
        let mut map = serde_json::Map::new();
        while let Some(key) = entries.next_key::<String>()? {
            let inside = match (self.0, key.as_str()) {
                (Place::Document, "context") => Place::Example,
                (Place::Document, "examples") => Place::Examples,
                _ => Place::Value,
            };
            let value = entries.next_value_seed(FirstWins(inside))?;
            if self.0 == Place::Example {
                map.insert(key, value);
            } else {
                map.entry(key).or_insert(value);
            }
        }
        Ok(Value::Object(map))
    }
}

/// The byte offset of serde_json's (line, column) position, as rapidjson reports errors.
fn offset_of(body: &[u8], line: usize, column: usize) -> usize {
    let mut offset = 0;
    for (n, text) in body.split(|&b| b == b'\n').enumerate() {
        if n + 1 == line {
            return offset + column.saturating_sub(1).min(text.len());
        }
        offset += text.len() + 1;
    }
    body.len()
}

impl PredictBody {
    /// The request's tensors, read against the signature's inputs (TF Serving's
    /// `FillPredictRequestFromJson` after the signature is known).
    pub fn tensors(
        &self,
        inputs: &HashMap<String, TensorSpec>,
    ) -> Result<(BTreeMap<String, TensorProto>, Format), ServingError> {
        if inputs.is_empty() {
            let name = if self.signature_name.is_empty() {
                "DEFAULT"
            } else {
                &self.signature_name
            };
            return Err(invalid(format!(
                "Failed to get input map for signature: {name}"
            )));
        }
        let dtypes: BTreeMap<&str, i32> =
            inputs.iter().map(|(k, v)| (k.as_str(), v.dtype)).collect();
        let instances = self.document.get("instances");
        let columns = self.document.get("inputs");
        let whole = || &self.document;
        match (instances, columns) {
            (Some(_), Some(_)) => Err(format_error(
                whole(),
                "Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist ",
            )),
            (Some(Value::Array(rows)), None) => {
                if rows.is_empty() {
                    return Err(format_error(whole(), "No values in 'instances' array"));
                }
                Ok((rows_to_tensors(rows, &dtypes)?, Format::Row))
            }
            (Some(_), None) => Err(format_error(
                whole(),
                "Expecting 'instances' to be an list/array",
            )),
            (None, Some(value)) => Ok((columns_to_tensors(value, &dtypes)?, Format::Columnar)),
            (None, None) => Err(invalid("Missing 'inputs' or 'instances' key")),
        }
    }
}

/// `absl::Base64Unescape`, which TF Serving decodes `{"b64": ...}` with: standard alphabet,
/// ASCII whitespace anywhere skipped, the padding optional ("=" or "." as the pad), the unused
/// bits of the last character not checked. The base64 crate refused what TF Serving takes:
/// unpadded text (Go's RawStdEncoding, Java's withoutPadding), a trailing newline (`base64`
/// piped in), MIME line breaks (Python's encodebytes). None where absl fails.
fn base64_unescape(text: &str) -> Option<Vec<u8>> {
    let sextet = |c: u8| -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    };
    let is_space = |c: u8| matches!(c, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r');
    let is_pad = |c: u8| c == b'=' || c == b'.';
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3 + 2);
    let (mut bits, mut count, mut at) = (0u32, 0usize, 0usize);
    while let Some(&c) = bytes.get(at) {
        if is_pad(c) {
            break; // the data ends at its first pad character
        }
        at += 1;
        if is_space(c) {
            continue;
        }
        bits = (bits << 6) | sextet(c)?;
        count += 1;
        if count == 4 {
            out.extend_from_slice(&bits.to_be_bytes()[1..]);
            (bits, count) = (0, 0);
        }
    }
    let expected_pads = match count {
        0 => 0,
        2 => {
            out.push((bits >> 4) as u8);
            2
        }
        3 => {
            out.extend_from_slice(&((bits >> 2) as u16).to_be_bytes());
            1
        }
        _ => return None, // six bits left over
    };
    // After the data: whitespace and either no pad or exactly the pads it needs.
    let mut pads = 0;
    for &c in &bytes[at..] {
        if is_pad(c) {
            pads += 1;
        } else if !is_space(c) {
            return None;
        }
    }
    (pads == 0 || pads == expected_pads).then_some(out)
}

fn is_base64_object(value: &Value) -> bool {
    matches!(value, Value::Object(map) if map.len() == 1
        && matches!(map.get("b64"), Some(b64 @ Value::String(_)) if json_nonfinite::number(b64).is_none()))
}

fn is_element_object(value: &Value) -> bool {
    value.is_object() && !is_base64_object(value)
}

/// The shape a value's nesting declares: the length of each list, following first elements.
fn dense_shape(value: &Value) -> Vec<i64> {
    let mut shape = Vec::new();
    let mut at = value;
    while let Value::Array(items) = at {
        shape.push(items.len() as i64);
        match items.first() {
            Some(first) => at = first,
            None => break,
        }
    }
    shape
}

/// A tensor being filled: its dtype, the shape its first value declared, its values.
struct Filling {
    proto: TensorProto,
    count: usize,
}

impl Filling {
    fn new(dtype: i32, shape: &[i64]) -> Filling {
        Filling {
            proto: TensorProto {
                dtype,
                tensor_shape: Some(shape_proto(shape)),
                ..TensorProto::default()
            },
            count: 0,
        }
    }

    /// TF Serving's `FillTensorProto`: every list at `level` as long as the shape says, every
    /// leaf at depth `rank`.
    fn fill(&mut self, value: &Value, level: usize, shape: &[i64]) -> Result<(), ServingError> {
        let rank = shape.len();
        let Value::Array(items) = value else {
            if level != rank {
                return Err(invalid(format!(
                    "JSON Value: {} found at incorrect level: {} in the JSON DOM. Expected at level: {rank}",
                    debug_string(value),
                    level + 1
                )));
            }
            self.add(value)?;
            self.count += 1;
            return Ok(());
        };
        if level >= rank {
            return Err(invalid(format!(
                "Encountered list at unexpected level: {level} expected < {rank}"
            )));
        }
        if items.len() as i64 != shape[level] {
            return Err(invalid(format!(
                "Encountered list at unexpected size: {} at level: {level} expected size: {}",
                items.len(),
                shape[level]
            )));
        }
        for item in items {
            self.fill(item, level + 1, shape)?;
        }
        Ok(())
    }

    /// TF Serving's `AddValueToTensor` (and the b64 objects of DT_STRING).
    fn add(&mut self, value: &Value) -> Result<(), ServingError> {
        let dtype = self.proto.dtype;
        let p = &mut self.proto;
        if let Value::Object(map) = value {
            if dtype != codec::DT_STRING {
                return Err(type_error(value, dtype));
            }
            let encoded = match map.get("b64") {
                Some(Value::String(text)) if is_base64_object(value) => text,
                _ => {
                    return Err(format_error(
                        value,
                        "not formatted correctly for base64 data",
                    ))
                }
            };
            let decoded =
                base64_unescape(encoded).ok_or_else(|| invalid("Unable to base64 decode"))?;
            p.string_val.push(Bytes::from(decoded));
            return Ok(());
        }
        let wrong = || type_error(value, dtype);
        match dtype {
            // Rounded to the nearest value the type holds, out of range to infinity, as
            // rapidjson's GetFloat (a static_cast of the double) and GetDouble do.
            codec::DT_FLOAT => p.float_val.push(number(value, dtype)? as f32),
            codec::DT_DOUBLE => p.double_val.push(number(value, dtype)?),
            codec::DT_INT32 | codec::DT_INT16 | codec::DT_INT8 | codec::DT_UINT8 => {
                let v = value.as_i64().and_then(|v| i32::try_from(v).ok());
                p.int_val.push(v.ok_or_else(wrong)?);
            }
            codec::DT_STRING => match json_nonfinite::string_bytes(value) {
                Some(bytes) => p.string_val.push(Bytes::from(bytes.into_owned())),
                None => return Err(wrong()),
            },
            codec::DT_INT64 => p.int64_val.push(value.as_i64().ok_or_else(wrong)?),
            codec::DT_BOOL => p.bool_val.push(value.as_bool().ok_or_else(wrong)?),
            codec::DT_UINT32 => {
                let v = value.as_u64().and_then(|v| u32::try_from(v).ok());
                p.uint32_val.push(v.ok_or_else(wrong)?);
            }
            codec::DT_UINT64 => p.uint64_val.push(value.as_u64().ok_or_else(wrong)?),
            other => {
                return Err(ServingError::new(
                    Code::Unimplemented,
                    format!(
                        "Conversion of JSON Value: {} to type: {}",
                        debug_string(value),
                        dtype_name(other)
                    ),
                ))
            }
        }
        Ok(())
    }
}

/// A JSON number (or non-finite token) for a float or double input, as a double; TF
/// Serving's type error if it is not a number. Whatever number it is, it is taken: TF
/// Serving's `IsLosslessDecimal` refusal ("Cannot convert JSON value: 16777217 to float
/// without loss of precision.") went in 2.5.0, and its REST guide now gives
/// `{"x": 1435774380}` as an input silently rounded to a float.
fn number(value: &Value, dtype: i32) -> Result<f64, ServingError> {
    if let Some(nonfinite) = json_nonfinite::number(value) {
        return Ok(nonfinite);
    }
    value.as_f64().ok_or_else(|| type_error(value, dtype))
}

fn shape_proto(shape: &[i64]) -> TensorShapeProto {
    TensorShapeProto {
        dim: shape
            .iter()
            .map(|&size| Dim {
                size,
                name: String::new(),
            })
            .collect(),
        unknown_rank: false,
    }
}

/// One input's rows stacked: the first row fixes the shape and size the others must have.
struct Column {
    filling: Filling,
    row_shape: Vec<i64>,
    row_size: usize,
}

/// TF Serving's `AddInstanceItem`: one row's value of input `name` appended to its column.
fn add_row_item(
    columns: &mut BTreeMap<String, Column>,
    name: &str,
    value: &Value,
    dtypes: &BTreeMap<&str, i32>,
) -> Result<(), ServingError> {
    let Some(&dtype) = dtypes.get(name) else {
        return Err(invalid(format!(
            "JSON object: does not have named input: {name}"
        )));
    };
    let shape = dense_shape(value);
    match columns.get_mut(name) {
        None => {
            let mut filling = Filling::new(dtype, &shape);
            filling.fill(value, 0, &shape)?;
            let row_size = filling.count;
            columns.insert(
                name.to_string(),
                Column {
                    filling,
                    row_shape: shape,
                    row_size,
                },
            );
        }
        Some(column) => {
            let before = column.filling.count;
            column.filling.fill(value, 0, &shape)?;
            let size = column.filling.count - before;
            if size != column.row_size {
                return Err(invalid(format!(
                    "Expecting tensor size: {} but got: {size}",
                    column.row_size
                )));
            }
            if shape != column.row_shape {
                return Err(invalid(format!(
                    "Expecting shape {} but got: {}",
                    shape_text(&column.row_shape),
                    shape_text(&shape)
                )));
            }
        }
    }
    Ok(())
}

/// TF Serving's `FillTensorMapFromInstancesList`.
fn rows_to_tensors(
    rows: &[Value],
    dtypes: &BTreeMap<&str, i32>,
) -> Result<BTreeMap<String, TensorProto>, ServingError> {
    if !rows[0].is_object() && dtypes.len() > 1 {
        return Err(invalid(
            "instances is a plain list, but expecting list of objects as multiple input tensors required as per tensorinfo_map",
        ));
    }
    let objects = is_element_object(&rows[0]);
    let names: BTreeSet<&str> = dtypes.keys().copied().collect();
    let mut columns: BTreeMap<String, Column> = BTreeMap::new();
    for (n, row) in rows.iter().enumerate() {
        if objects {
            let Value::Object(fields) = row else {
                return Err(invalid(format!(
                    "Expecting object but got list at item {n} of input list"
                )));
            };
            if is_base64_object(row) {
                return Err(invalid(format!(
                    "Expecting object but got list at item {n} of input list"
                )));
            }
            for (name, value) in fields {
                add_row_item(&mut columns, name, value, dtypes).map_err(|error| {
                    invalid(format!(
                        "Failed to process element: {n} key: {name} of 'instances' list. Error: {}",
                        nested(&error)
                    ))
                })?;
            }
            let keys: BTreeSet<&str> = fields.keys().map(String::as_str).collect();
            if keys != names {
                let expected: Vec<&str> = names.iter().copied().collect();
                return Err(invalid(format!(
                    "Failed to process element: {n} of 'instances' list. JSON object: {} keys must be equal to: {}",
                    debug_string(row),
                    expected.join(",")
                )));
            }
        } else {
            if is_element_object(row) {
                return Err(invalid(format!(
                    "Expecting value/list but got object at item {n} of input list"
                )));
            }
            let name = names.first().copied().unwrap_or_default();
            add_row_item(&mut columns, name, row, dtypes).map_err(|error| {
                invalid(format!(
                    "Failed to process element: {n} of 'instances' list. Error: {}",
                    nested(&error)
                ))
            })?;
        }
    }
    Ok(columns
        .into_iter()
        .map(|(name, column)| {
            let mut proto = column.filling.proto;
            let mut shape = vec![rows.len() as i64];
            shape.extend_from_slice(&column.row_shape);
            proto.tensor_shape = Some(shape_proto(&shape));
            (name, proto)
        })
        .collect())
}

/// TF Serving's `FillTensorMapFromInputsMap`.
fn columns_to_tensors(
    value: &Value,
    dtypes: &BTreeMap<&str, i32>,
) -> Result<BTreeMap<String, TensorProto>, ServingError> {
    let one = |name: &str, dtype: i32, value: &Value| -> Result<TensorProto, ServingError> {
        let shape = dense_shape(value);
        let mut filling = Filling::new(dtype, &shape);
        filling.fill(value, 0, &shape)?;
        let _ = name;
        Ok(filling.proto)
    };
    let mut tensors = BTreeMap::new();
    match value {
        Value::Object(fields) if !is_base64_object(value) => {
            for (&name, &dtype) in dtypes {
                let Some(item) = fields.get(name) else {
                    return Err(invalid(format!(
                        "Missing named input: {name} in 'inputs' object."
                    )));
                };
                tensors.insert(name.to_string(), one(name, dtype, item)?);
            }
        }
        _ => {
            if dtypes.len() > 1 {
                return Err(invalid(
                    "inputs is a plain value/list, but expecting an object as multiple input tensors required as per tensorinfo_map",
                ));
            }
            if let Some((&name, &dtype)) = dtypes.iter().next() {
                tensors.insert(name.to_string(), one(name, dtype, value)?);
            }
        }
    }
    Ok(tensors)
}

// ---- classify and regress ---------------------------------------------------------------

/// A `:classify` or `:regress` body (TF Serving's `FillClassifyRegressRequestFromJson`): the
/// signature it names and its examples, each with the optional `context` in front.
pub fn parse_examples(body: &[u8]) -> Result<(String, Input), ServingError> {
    let parsed = parse_body(body, Place::Document)?;
    let document = &parsed.document;
    let whole = || document;
    let context = match document.get("context") {
        Some(value) => Some(example_from_json(value)?),
        None => None,
    };
    let Some(examples) = document.get("examples") else {
        return Err(format_error(
            whole(),
            "When method is classify, key 'examples' is expected and was not found",
        ));
    };
    let Value::Array(examples) = examples else {
        return Err(format_error(
            whole(),
            "Expecting 'examples' value to be an list/array",
        ));
    };
    if examples.is_empty() {
        return Err(format_error(whole(), "'examples' value is an empty array"));
    }
    let examples = examples
        .iter()
        .map(example_from_json)
        .collect::<Result<Vec<_>, _>>()?;
    let kind = match context {
        None => input::Kind::ExampleList(ExampleList { examples }),
        Some(context) => {
            input::Kind::ExampleListWithContext(ExampleListWithContext { examples, context })
        }
    };
    Ok((parsed.signature_name, Input { kind: Some(kind) }))
}

/// TF Serving's `MakeExampleFromJsonObject`, serialized.
fn example_from_json(value: &Value) -> Result<Bytes, ServingError> {
    let Value::Object(fields) = value else {
        return Err(invalid(format!(
            "Example must be JSON object but got JSON {}",
            type_name(value)
        )));
    };
    let mut features = Vec::with_capacity(fields.len());
    for (name, content) in fields {
        let mut feature = Feature { kind: None };
        match content {
            Value::Array(items) => {
                for item in items {
                    add_to_feature(item, name, &mut feature)?;
                }
            }
            single => add_to_feature(single, name, &mut feature)?,
        }
        features.push((name.as_str(), feature));
    }
    Ok(Bytes::from(example_bytes(&features)))
}

/// An Example holding `features`, serialized as C++ protobuf (TF Serving) serializes it: every
/// map entry with its key and its value, even an empty name or a feature of no kind (`[]`).
/// prost leaves default keys and values out of map entries, and TensorFlow's Example parser
/// refuses an entry without them ("Could not parse example input").
fn example_bytes(features: &[(&str, Feature)]) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
    let delimited_len = |len: usize| 1 + encoded_len_varint(len as u64) + len;
    let mut map = Vec::new();
    for (name, feature) in features {
        let value = feature.encode_to_vec();
        // Example.features (1) > Features.feature (1, a map entry) > key (1), value (2).
        encode_key(1, WireType::LengthDelimited, &mut map);
        encode_varint(
            (delimited_len(name.len()) + delimited_len(value.len())) as u64,
            &mut map,
        );
        encode_key(1, WireType::LengthDelimited, &mut map);
        encode_varint(name.len() as u64, &mut map);
        map.extend_from_slice(name.as_bytes());
        encode_key(2, WireType::LengthDelimited, &mut map);
        encode_varint(value.len() as u64, &mut map);
        map.extend_from_slice(&value);
    }
    let mut example = Vec::with_capacity(delimited_len(map.len()));
    encode_key(1, WireType::LengthDelimited, &mut example);
    encode_varint(map.len() as u64, &mut example);
    example.extend_from_slice(&map);
    example
}

/// TF Serving's `AddValueToFeature`: a feature holds one kind of value, fixed by its first.
fn add_to_feature(value: &Value, name: &str, feature: &mut Feature) -> Result<(), ServingError> {
    let unexpected = || {
        invalid(format!(
            "Feature: {name} has element with unexpected JSON type: {}",
            type_name(value)
        ))
    };
    let incompatible = |feature: &Feature| {
        let kind = match feature.kind {
            Some(feature::Kind::BytesList(_)) => "bytes",
            Some(feature::Kind::FloatList(_)) => "float",
            Some(feature::Kind::Int64List(_)) => "int64",
            None => "UNKNOWN",
        };
        invalid(format!(
            "Unexpected element type in feature: {name} expecting type: {kind}"
        ))
    };
    if let Some(number) = json_nonfinite::number(value) {
        // A decimal number: a float feature, as rapidjson's IsDouble() says of NaN.
        return push_float(feature, number as f32).ok_or_else(|| incompatible(feature));
    }
    match value {
        Value::Null | Value::Array(_) => Err(unexpected()),
        Value::Bool(b) => push_int(feature, i64::from(*b)).ok_or_else(|| incompatible(feature)),
        Value::Object(_) => {
            if !is_base64_object(value) {
                return Err(unexpected());
            }
            let encoded = value.get("b64").and_then(Value::as_str).unwrap_or_default();
            let decoded =
                base64_unescape(encoded).ok_or_else(|| invalid("Unable to base64 decode"))?;
            push_bytes(feature, Bytes::from(decoded)).ok_or_else(|| incompatible(feature))
        }
        Value::String(_) => {
            let bytes = json_nonfinite::string_bytes(value).unwrap_or_default();
            push_bytes(feature, Bytes::from(bytes.into_owned()))
                .ok_or_else(|| incompatible(feature))
        }
        Value::Number(number) => {
            if number.is_f64() {
                let v = number.as_f64().unwrap_or_default() as f32;
                push_float(feature, v).ok_or_else(|| incompatible(feature))
            } else if let Some(v) = number.as_i64() {
                push_int(feature, v).ok_or_else(|| incompatible(feature))
            } else {
                Err(invalid(format!(
                    "Feature: {name} has uint64_t element. Only int64_t is supported."
                )))
            }
        }
    }
}

fn push_int(feature: &mut Feature, value: i64) -> Option<()> {
    match feature
        .kind
        .get_or_insert_with(|| feature::Kind::Int64List(Int64List::default()))
    {
        feature::Kind::Int64List(list) => {
            list.value.push(value);
            Some(())
        }
        _ => None,
    }
}

fn push_float(feature: &mut Feature, value: f32) -> Option<()> {
    match feature
        .kind
        .get_or_insert_with(|| feature::Kind::FloatList(FloatList::default()))
    {
        feature::Kind::FloatList(list) => {
            list.value.push(value);
            Some(())
        }
        _ => None,
    }
}

fn push_bytes(feature: &mut Feature, value: Bytes) -> Option<()> {
    match feature
        .kind
        .get_or_insert_with(|| feature::Kind::BytesList(BytesList::default()))
    {
        feature::Kind::BytesList(list) => {
            list.value.push(value);
            Some(())
        }
        _ => None,
    }
}

/// TF Serving's `MakeJsonFromClassificationResult`.
pub fn classification_answer(result: &ClassificationResult) -> Result<String, ServingError> {
    if result.classifications.is_empty() {
        return Err(invalid(
            "Cannot convert empty ClassificationResults to JSON",
        ));
    }
    let mut out = String::from("{\n    \"results\": [");
    for (i, classifications) in result.classifications.iter().enumerate() {
        out.push_str(if i > 0 { ",\n        [" } else { "\n        [" });
        for (j, class) in classifications.classes.iter().enumerate() {
            out.push_str(if j > 0 { ", [" } else { "[" });
            write_string(&mut out, class.label.as_bytes());
            out.push_str(", ");
            write_float(&mut out, class.score);
            out.push(']');
        }
        out.push(']');
    }
    out.push_str("\n    ]\n}");
    Ok(out)
}

/// TF Serving's `MakeJsonFromRegressionResult`.
pub fn regression_answer(result: &RegressionResult) -> Result<String, ServingError> {
    if result.regressions.is_empty() {
        return Err(invalid("Cannot convert empty RegressionResults to JSON"));
    }
    let mut out = String::from("{\n    \"results\": [");
    for (i, regression) in result.regressions.iter().enumerate() {
        out.push_str(if i > 0 { ", " } else { "" });
        write_float(&mut out, regression.value);
    }
    out.push_str("]\n}");
    Ok(out)
}

// ---- answers ----------------------------------------------------------------------------

/// `{"error": message}`, as TF Serving's `MakeJsonFromStatus`.
pub fn error_body(message: &str) -> String {
    let mut out = String::from("{ \"error\": ");
    write_string(&mut out, message.as_bytes());
    out.push_str(" }");
    out
}

/// TF Serving's `MakeJsonFromTensors`: the answer to a Predict in the request's format, from
/// outputs whose values are in their typed fields.
pub fn predict_answer(
    outputs: &BTreeMap<String, TensorProto>,
    format: Format,
) -> Result<String, ServingError> {
    if outputs.is_empty() {
        return Err(invalid("Cannot convert empty tensor map to JSON"));
    }
    let mut out = String::with_capacity(64);
    match format {
        Format::Row => {
            let mut batch: Option<i64> = None;
            for (name, tensor) in outputs {
                let shape = dims(tensor);
                let Some(&rows) = shape.first() else {
                    return Err(invalid(format!(
                        "Tensor name: {name} has no shape information "
                    )));
                };
                if let Some(expected) = batch.filter(|&b| b != rows) {
                    return Err(invalid(format!(
                        "Tensor name: {name} has inconsistent batch size: {rows} expecting: {expected}"
                    )));
                }
                batch = Some(rows);
            }
            let mut offsets: Vec<usize> = vec![0; outputs.len()];
            out.push_str("{\n    \"predictions\": [");
            for row in 0..batch.unwrap_or(0) {
                if row > 0 {
                    out.push(',');
                }
                out.push_str("\n        ");
                if outputs.len() > 1 {
                    out.push('{');
                }
                for (i, (name, tensor)) in outputs.iter().enumerate() {
                    if outputs.len() > 1 {
                        if i > 0 {
                            out.push_str(", ");
                        }
                        write_string(&mut out, name.as_bytes());
                        out.push_str(": ");
                    }
                    let shape = dims(tensor);
                    write_values(&mut out, name, tensor, &shape, 1, &mut offsets[i])?;
                }
                if outputs.len() > 1 {
                    out.push('}');
                }
            }
            out.push_str("\n    ]\n}");
        }
        Format::Columnar => {
            out.push_str("{\n    \"outputs\": ");
            if outputs.len() > 1 {
                out.push('{');
            }
            for (i, (name, tensor)) in outputs.iter().enumerate() {
                if outputs.len() > 1 {
                    out.push_str(if i > 0 { ",\n        " } else { "\n        " });
                    write_string(&mut out, name.as_bytes());
                    out.push_str(": ");
                }
                let shape = dims(tensor);
                write_values(&mut out, name, tensor, &shape, 0, &mut 0)?;
            }
            if outputs.len() > 1 {
                out.push_str("\n    }");
            }
            out.push_str("\n}");
        }
    }
    Ok(out)
}

fn dims(tensor: &TensorProto) -> Vec<i64> {
    tensor
        .tensor_shape
        .as_ref()
        .map(|s| s.dim.iter().map(|d| d.size).collect())
        .unwrap_or_default()
}

/// TF Serving's `AddTensorValues`: the values from dimension `dim` on, nested as lists.
fn write_values(
    out: &mut String,
    name: &str,
    tensor: &TensorProto,
    shape: &[i64],
    dim: usize,
    offset: &mut usize,
) -> Result<(), ServingError> {
    if dim >= shape.len() {
        return write_value(out, name, tensor, offset);
    }
    out.push('[');
    for i in 0..shape[dim] {
        if i > 0 {
            out.push_str(", ");
        }
        write_values(out, name, tensor, shape, dim + 1, offset)?;
    }
    out.push(']');
    Ok(())
}

/// TF Serving's `AddSingleValueAndAdvance`.
fn write_value(
    out: &mut String,
    name: &str,
    tensor: &TensorProto,
    offset: &mut usize,
) -> Result<(), ServingError> {
    let i = *offset;
    let missing = || {
        ServingError::new(
            Code::Internal,
            format!("output {name} has fewer values than its shape"),
        )
    };
    match tensor.dtype {
        codec::DT_FLOAT => write_float(out, *tensor.float_val.get(i).ok_or_else(missing)?),
        codec::DT_DOUBLE => write_double(out, *tensor.double_val.get(i).ok_or_else(missing)?),
        codec::DT_INT32 | codec::DT_INT16 | codec::DT_INT8 | codec::DT_UINT8 => {
            let _ = write!(out, "{}", tensor.int_val.get(i).ok_or_else(missing)?);
        }
        codec::DT_INT64 => {
            let _ = write!(out, "{}", tensor.int64_val.get(i).ok_or_else(missing)?);
        }
        codec::DT_UINT32 => {
            let _ = write!(out, "{}", tensor.uint32_val.get(i).ok_or_else(missing)?);
        }
        codec::DT_UINT64 => {
            let _ = write!(out, "{}", tensor.uint64_val.get(i).ok_or_else(missing)?);
        }
        codec::DT_BOOL => {
            let v = *tensor.bool_val.get(i).ok_or_else(missing)?;
            out.push_str(if v { "true" } else { "false" });
        }
        codec::DT_STRING => {
            let v = tensor.string_val.get(i).ok_or_else(missing)?;
            if name.ends_with("_bytes") {
                out.push_str("{\"b64\": ");
                write_string(out, BASE64.encode(v).as_bytes());
                out.push('}');
            } else {
                write_string(out, v);
            }
        }
        other => {
            return Err(invalid(format!(
                "Failed to write JSON value for tensor type: {}",
                dtype_name(other)
            )))
        }
    }
    *offset += 1;
    Ok(())
}

/// A JSON string. Bytes that are not UTF-8 become U+FFFD (TF Serving would write them raw,
/// which is not JSON): outputs holding binary data should be named `*_bytes`.
pub fn write_string(out: &mut String, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float32 as TF Serving's `WriteDecimal` writes it.
pub fn write_float(out: &mut String, value: f32) {
    if !value.is_finite() {
        return write_non_finite(out, f64::from(value));
    }
    let short = format_g(f64::from(value), 6);
    let text = match short.parse::<f32>() {
        Ok(back) if back == value => short,
        _ => format_g(f64::from(value), 9),
    };
    push_decimal(out, text);
}

/// A float64 as TF Serving's `WriteDecimal` writes it.
pub fn write_double(out: &mut String, value: f64) {
    if !value.is_finite() {
        return write_non_finite(out, value);
    }
    let short = format_g(value, 6);
    let text = match short.parse::<f64>() {
        Ok(back) if back == value => short,
        _ => format_g(value, 17),
    };
    push_decimal(out, text);
}

fn write_non_finite(out: &mut String, value: f64) {
    out.push_str(if value.is_nan() {
        "NaN"
    } else if value < 0.0 {
        "-Infinity"
    } else {
        "Infinity"
    });
}

/// Whole numbers written without an exponent get ".0", so a list never mixes integers and
/// decimals.
fn push_decimal(out: &mut String, text: String) {
    out.push_str(&text);
    if !text.contains('.') && !text.contains('e') {
        out.push_str(".0");
    }
}

/// C's `printf("%.{precision}g", value)` for a finite value.
pub fn format_g(value: f64, precision: usize) -> String {
    if value == 0.0 {
        return if value.is_sign_negative() { "-0" } else { "0" }.to_string();
    }
    let p = precision.max(1);
    // The exponent after rounding to p significant digits decides the style.
    let scientific = format!("{:.*e}", p - 1, value);
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if exponent < -4 || exponent >= p as i32 {
        let mantissa = strip_zeros(mantissa);
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    } else {
        let decimals = (p as i32 - 1 - exponent).max(0) as usize;
        strip_zeros(&format!("{value:.decimals$}")).to_string()
    }
}

fn strip_zeros(text: &str) -> &str {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_debug_string_is_the_first_256_bytes_of_the_whole_written_out() {
        // As writing it all and cutting it would be, without writing it all.
        let parse = |text: &str| -> Value {
            serde_json::from_slice(&json_nonfinite::rewrite(text.as_bytes())).unwrap()
        };
        let cut = |text: String| {
            let mut text = json_nonfinite::restore(text);
            let mut at = text.len().min(256);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            text.truncate(at);
            text
        };
        let many = format!("[{}]", vec!["NaN"; 2000].join(","));
        let rows = format!(
            r#"{{"instances": [{}]}}"#,
            vec!["[1.5, \"é\"]"; 100_000].join(",")
        );
        for text in [
            many.as_str(),
            rows.as_str(),
            r#"{"a": [1, -Infinity, "x"]}"#,
            "[]",
        ] {
            let value = parse(text);
            assert_eq!(debug_string(&value), cut(value.to_string()), "{text:.80}");
        }
        // Markers past the cut are written back too: "[" and 63 "NaN," then "NaN".
        assert_eq!(debug_string(&parse(&many)).len(), 256);
    }

    #[test]
    fn base64_is_decoded_as_absl_decodes_it() {
        let ok = |text: &str, want: &[u8]| {
            assert_eq!(base64_unescape(text).as_deref(), Some(want), "{text:?}");
        };
        ok("YWI=", b"ab");
        ok("YWI", b"ab"); // unpadded
        ok("YWI.", b"ab"); // "." as the pad
        ok("YWJ=", b"ab"); // the unused bits are not checked
        ok("YWI=\n", b"ab");
        ok("YW\r\nI=", b"ab"); // MIME line breaks
        ok(" aGVs bG8= ", b"hello");
        ok("YQ==", b"a");
        ok("YQ", b"a");
        ok("aGVsbG8gd29ybGQ=", b"hello world");
        ok("", b"");
        ok("/+/+", &[0xff, 0xef, 0xfe]);
        for bad in [
            "YQ=",
            "YWI==",
            "Y",
            "YWJj=",
            "%%%",
            "YW=I",
            "YWI=x",
            "aGVs\0bG8=",
            "YW-_",
        ] {
            assert_eq!(base64_unescape(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_parse_cost_counts_objects_and_values_outside_strings() {
        let budget = |body: &str| {
            let cost = parse_cost(body.as_bytes());
            assert!(cost.check(cost.bytes()).is_ok());
            assert!(cost.check(cost.bytes() - 1).is_err());
            assert!(cost.bytes() <= most_parse_cost(body.len()), "{body}");
            cost.bytes()
        };
        // 3 values (two commas, one array) and no object: the bytes plus 4 values' cost.
        let plain = "[1,2,3]";
        assert_eq!(budget(plain), plain.len() + 4 * VALUE_COST);
        // Braces, brackets and commas inside strings (escaped quotes too) are text.
        let quoted = r#""{[,\"{,]}""#;
        assert_eq!(budget(quoted), quoted.len() + VALUE_COST);
        let objects = r#"[{"a":1},{"a":1}]"#;
        assert_eq!(
            budget(objects),
            objects.len() + 3 * VALUE_COST + 2 * OBJECT_COST
        );
    }

    #[test]
    fn a_body_too_costly_to_parse_is_refused_with_resource_exhausted() {
        let body = r#"{"a":1},"#.repeat(1000);
        let cost = parse_cost(body.as_bytes());
        let error = cost.check(1 << 19).unwrap_err();
        assert_eq!(error.code, crate::status::Code::ResourceExhausted);
        assert!(error.message.contains("1000 objects"), "{}", error.message);
        assert!(cost.check(1 << 20).is_ok());
    }

    fn specs(inputs: &[(&str, i32)]) -> HashMap<String, TensorSpec> {
        inputs
            .iter()
            .map(|(name, dtype)| {
                (
                    name.to_string(),
                    TensorSpec {
                        dtype: *dtype,
                        shape: None,
                    },
                )
            })
            .collect()
    }

    fn parse(
        body: &str,
        inputs: &[(&str, i32)],
    ) -> Result<(BTreeMap<String, TensorProto>, Format), ServingError> {
        parse_predict(body.as_bytes())?.tensors(&specs(inputs))
    }

    fn parse_bytes(
        body: &[u8],
        inputs: &[(&str, i32)],
    ) -> Result<(BTreeMap<String, TensorProto>, Format), ServingError> {
        parse_predict(body)?.tensors(&specs(inputs))
    }

    fn message(result: Result<impl std::fmt::Debug, ServingError>) -> String {
        result.unwrap_err().message
    }

    #[test]
    fn nan_and_infinity_are_numbers_as_tf_servings_parser_reads_them() {
        let body = r#"{"instances": [NaN, -Infinity, Inf, -NaN, 1.5]}"#;
        let (tensors, _) = parse(body, &[("x", codec::DT_FLOAT)]).unwrap();
        let x = &tensors["x"].float_val;
        assert!(x[0].is_nan() && x[3].is_nan(), "{x:?}");
        assert_eq!(x[1..3], [f32::NEG_INFINITY, f32::INFINITY]);
        assert_eq!(x[4], 1.5);
        let (tensors, _) =
            parse(r#"{"inputs": [[Infinity]]}"#, &[("x", codec::DT_DOUBLE)]).unwrap();
        assert_eq!(tensors["x"].double_val, vec![f64::INFINITY]);
        // Where a number does not fit, TF Serving's type error, the token written back.
        assert_eq!(
            message(parse(r#"{"inputs": [1, NaN]}"#, &[("x", codec::DT_INT64)])),
            "JSON Value: NaN Type: Number is not of expected type: int64"
        );
        assert_eq!(
            message(parse(
                r#"{"inputs": -Infinity}"#,
                &[("x", codec::DT_STRING)]
            )),
            "JSON Value: -Infinity Type: Number is not of expected type: string"
        );
        assert!(message(parse(
            r#"{"inputs": [{"b64": NaN}]}"#,
            &[("x", codec::DT_STRING)]
        ))
        .ends_with("not formatted correctly for base64 data"));
        assert!(
            message(parse_predict(br#"{"signature_name": NaN}"#).map(|_| ()))
                .contains("'signature_name' key must be a string value.")
        );
        assert!(
            message(parse(r#"{"instances": NaN}"#, &[("x", codec::DT_FLOAT)]))
                .starts_with("JSON Value: {\"instances\":NaN} Expecting 'instances'")
        );
        // The token's text inside a string is text.
        let (tensors, _) = parse(r#"{"inputs": ["NaN"]}"#, &[("x", codec::DT_STRING)]).unwrap();
        assert_eq!(tensors["x"].string_val, vec![Bytes::from_static(b"NaN")]);
        // In an Example, a decimal number: a float feature.
        let (_, input) = parse_examples(br#"{"examples": [{"f": [NaN, 2.5]}]}"#).unwrap();
        let Some(input::Kind::ExampleList(list)) = input.kind else {
            panic!("{input:?}")
        };
        assert_eq!(
            list.examples[0],
            Bytes::from(example_bytes(&[(
                "f",
                Feature {
                    kind: Some(feature::Kind::FloatList(FloatList {
                        value: vec![f32::NAN, 2.5]
                    }))
                }
            )]))
        );
        // Counted as strings by the parse budget: never less than what parsing takes.
        let cost = parse_cost(b"[NaN]");
        assert!(
            cost.body_bytes >= json_nonfinite::rewrite(b"[NaN]").len(),
            "{cost:?}"
        );
    }

    #[test]
    fn string_bytes_that_are_not_utf8_are_taken_as_tf_servings_parser_takes_them() {
        // TF Serving parses without checking the encoding: a Latin-1 string, or a byte
        // Python escaped as a lone surrogate, is taken as its bytes (found by a hunt: the
        // whole request was refused with "invalid unicode code point").
        let body = b"{\"inputs\": [\"caf\xe9\", \"a\\udc80\"]}";
        let (tensors, _) = parse_bytes(body, &[("x", codec::DT_STRING)]).unwrap();
        assert_eq!(
            tensors["x"].string_val,
            vec![
                Bytes::from_static(b"caf\xe9"),
                Bytes::from_static(b"a\xed\xb2\x80")
            ]
        );
        let (_, input) = parse_examples(b"{\"examples\": [{\"f\": [\"\xff\", \"b\"]}]}").unwrap();
        let Some(input::Kind::ExampleList(list)) = input.kind else {
            panic!("{input:?}")
        };
        let example = Example::decode(list.examples[0].clone()).unwrap();
        assert_eq!(
            example.features.unwrap().feature["f"].kind,
            Some(feature::Kind::BytesList(BytesList {
                value: vec![Bytes::from_static(b"\xff"), Bytes::from_static(b"b")]
            }))
        );
        // Where such a string is not wanted, the error shows its text, not its marker.
        let refused = message(parse_bytes(
            b"{\"inputs\": [\"\xe9\"]}",
            &[("x", codec::DT_INT64)],
        ));
        assert_eq!(
            refused,
            "JSON Value: \"\u{FFFD}\" Type: String is not of expected type: int64"
        );
        let body = b"{\"signature_name\": \"s\xe9\", \"inputs\": [1]}";
        assert_eq!(parse_predict(body).unwrap().signature_name, "s\u{FFFD}");
        // Counted by the parse budget: never less than what parsing takes.
        for body in [&b"[\"\xe9\"]"[..], b"[\"\", \"\xe9\\udc80\", \"\"]"] {
            assert!(parse_cost(body).body_bytes >= json_nonfinite::rewrite(body).len());
        }
    }

    #[test]
    fn minus_zero_is_an_integer_as_tf_servings_parser_reads_it() {
        // rapidjson reads `-0` as the integer 0 (found by a hunt: an int64 input refused it).
        let (tensors, _) = parse(r#"{"inputs": [-0, -1]}"#, &[("x", codec::DT_INT64)]).unwrap();
        assert_eq!(tensors["x"].int64_val, vec![0, -1]);
        let (tensors, _) =
            parse(r#"{"instances": [-0, -0.0]}"#, &[("x", codec::DT_FLOAT)]).unwrap();
        let x = &tensors["x"].float_val;
        assert!(x[0] == 0.0 && x[0].is_sign_positive(), "{x:?}");
        assert!(x[1] == 0.0 && x[1].is_sign_negative(), "{x:?}");
        assert_eq!(
            message(parse(r#"{"inputs": [-0.0]}"#, &[("x", codec::DT_INT64)])),
            "JSON Value: -0.0 Type: Number is not of expected type: int64"
        );
        // In an Example, an integer: an int64 feature.
        let (_, input) = parse_examples(br#"{"examples": [{"f": [-0, 1]}]}"#).unwrap();
        let Some(input::Kind::ExampleList(list)) = input.kind else {
            panic!("{input:?}")
        };
        let example = Example::decode(list.examples[0].clone()).unwrap();
        assert_eq!(
            example.features.unwrap().feature["f"].kind,
            Some(feature::Kind::Int64List(Int64List { value: vec![0, 1] }))
        );
    }

    #[test]
    fn floats_take_any_number_rounded_as_tf_serving_does() {
        let float = |body: &str, dtype| parse(body, &[("x", dtype)]);
        let body = r#"{"inputs": [16777217, 1435774380, -16777217, 1e-50, 3.4028235e38, 1e39,
            -1e39, 18446744073709551615]}"#;
        let (tensors, _) = float(body, codec::DT_FLOAT).unwrap();
        assert_eq!(
            tensors["x"].float_val,
            vec![
                16777216.0,
                1435774380.0,
                -16777216.0,
                0.0,
                f32::MAX,
                f32::INFINITY,
                f32::NEG_INFINITY,
                18446744073709551615.0
            ]
        );
        let (tensors, _) =
            float(r#"{"inputs": [9007199254740993, 1e39]}"#, codec::DT_DOUBLE).unwrap();
        assert_eq!(tensors["x"].double_val, vec![9007199254740992.0, 1e39]);
        assert_eq!(
            message(float(r#"{"inputs": ["1"]}"#, codec::DT_FLOAT)),
            "JSON Value: \"1\" Type: String is not of expected type: float"
        );
    }

    #[test]
    fn a_key_given_twice_keeps_its_first_value_as_rapidjsons_lookups_find() {
        let body = r#"{"signature_name": "a", "inputs": {"x": [1], "x": [2, 3]},
            "signature_name": 3, "inputs": "later"}"#;
        let parsed = parse_predict(body.as_bytes()).unwrap();
        assert_eq!(parsed.signature_name, "a");
        let (tensors, _) = parsed.tensors(&specs(&[("x", codec::DT_INT64)])).unwrap();
        assert_eq!(tensors["x"].int64_val, vec![1]);
        // Otherwise the document is serde_json's own.
        let text =
            r#"{"a": [null, true, -1, 18446744073709551615, 0.5, "s\u00e9", {}], "b": {"c": []}}"#;
        let ours = parse_object(text.as_bytes(), Place::Value).unwrap();
        let theirs: serde_json::Map<String, Value> = serde_json::from_str(text).unwrap();
        assert_eq!(ours, theirs);
        // serde_json's depth limit still holds: a deep body is an error, not a full stack.
        let deep = format!("{{\"a\": {}", "[".repeat(100_000));
        assert!(message(parse_object(deep.as_bytes(), Place::Value))
            .contains("recursion limit exceeded"));
    }

    #[test]
    fn a_byte_order_mark_and_text_after_the_document_are_ignored_as_by_rapidjson() {
        let body = b"\xEF\xBB\xBF{\"instances\": [1]}\n{\"not\": read";
        let (tensors, _) = parse_predict(body)
            .unwrap()
            .tensors(&specs(&[("x", codec::DT_INT64)]))
            .unwrap();
        assert_eq!(tensors["x"].int64_val, vec![1]);
        assert_eq!(
            message(parse_predict(b"\xEF\xBB\xBF").map(|_| ())),
            "JSON Parse error: The document is empty"
        );
        assert!(message(parse_predict(b"{\"instances\": [1]").map(|_| ()))
            .starts_with("JSON Parse error: "));
    }

    #[test]
    fn a_parse_errors_offset_counts_the_clients_bytes_as_rapidjson_does() {
        let offset = |body: &[u8]| {
            let said = message(parse_predict(body).map(|_| ()));
            let (_, at) = said.rsplit_once("at offset: ").unwrap();
            at.parse::<usize>().unwrap()
        };
        // The same error after a token or after a number of the same length: the same offset.
        let plain = offset(br#"{"instances": [1.5, 12345678, 2,]}"#);
        assert_eq!(offset(br#"{"instances": [NaN, Infinity, 2,]}"#), plain);
        // A byte-order mark is skipped but counted, as rapidjson's stream counts it.
        assert_eq!(
            offset(b"\xEF\xBB\xBF{\"instances\": [NaN, Infinity, 2,]}"),
            plain + 3
        );
    }

    #[test]
    fn rows_of_one_input_stack_into_one_tensor() {
        let (tensors, format) = parse(
            r#"{"instances": [[1, 2], [3, 4], [5, 6]]}"#,
            &[("x", codec::DT_INT64)],
        )
        .unwrap();
        assert_eq!(format, Format::Row);
        let x = &tensors["x"];
        assert_eq!(dims(x), vec![3, 2]);
        assert_eq!(x.int64_val, vec![1, 2, 3, 4, 5, 6]);
        let (tensors, _) = parse(r#"{"instances": [0.5, 1]}"#, &[("x", codec::DT_FLOAT)]).unwrap();
        assert_eq!(dims(&tensors["x"]), vec![2]);
        assert_eq!(tensors["x"].float_val, vec![0.5, 1.0]);
    }

    #[test]
    fn rows_of_several_inputs_are_objects_naming_each() {
        let body = r#"{"signature_name": "s", "instances": [
            {"ids": [1, 2], "name": "a", "raw": {"b64": "aGVsbG8="}},
            {"ids": [3, 4], "name": "b", "raw": {"b64": "d29ybGQ="}}]}"#;
        let inputs = [
            ("ids", codec::DT_INT32),
            ("name", codec::DT_STRING),
            ("raw", codec::DT_STRING),
        ];
        let parsed = parse_predict(body.as_bytes()).unwrap();
        assert_eq!(parsed.signature_name, "s");
        let (tensors, _) = parsed.tensors(&specs(&inputs)).unwrap();
        assert_eq!(dims(&tensors["ids"]), vec![2, 2]);
        assert_eq!(dims(&tensors["name"]), vec![2]);
        assert_eq!(
            tensors["raw"].string_val,
            vec![Bytes::from_static(b"hello"), Bytes::from_static(b"world")]
        );
        let missing = r#"{"instances": [{"ids": [1, 2], "name": "a"}]}"#;
        assert!(message(parse(missing, &inputs)).contains("keys must be equal to: ids,name,raw"));
        let plain = r#"{"instances": [1, 2]}"#;
        assert!(message(parse(plain, &inputs)).starts_with("instances is a plain list"));
    }

    #[test]
    fn columns_may_differ_in_their_first_dimension() {
        let body = r#"{"inputs": {"a": [[1.5, 2], [3, 4], [5, 6]], "b": [true]}}"#;
        let (tensors, format) =
            parse(body, &[("a", codec::DT_DOUBLE), ("b", codec::DT_BOOL)]).unwrap();
        assert_eq!(format, Format::Columnar);
        assert_eq!(dims(&tensors["a"]), vec![3, 2]);
        assert_eq!(dims(&tensors["b"]), vec![1]);
        assert_eq!(tensors["b"].bool_val, vec![true]);
        let (tensors, _) = parse(r#"{"inputs": 7}"#, &[("x", codec::DT_INT32)]).unwrap();
        assert_eq!(dims(&tensors["x"]), Vec::<i64>::new());
        assert_eq!(
            message(parse(r#"{"inputs": {"a": [1]}}"#, &[("a", 1), ("b", 1)])),
            "Missing named input: b in 'inputs' object."
        );
    }

    #[test]
    fn bad_bodies_get_tf_servings_messages() {
        let x = [("x", codec::DT_INT32)];
        assert_eq!(
            message(parse("", &x)),
            "JSON Parse error: The document is empty"
        );
        assert!(message(parse("{\"instances\": [1,", &x)).starts_with("JSON Parse error: "));
        assert_eq!(message(parse("[1]", &x)), "JSON Value: [1] Is not object");
        assert_eq!(
            message(parse("{}", &x)),
            "Missing 'inputs' or 'instances' key"
        );
        assert!(message(parse(r#"{"inputs": [1], "instances": [1]}"#, &x))
            .ends_with("expecting only one of 'inputs' or 'instances' keys to exist "));
        assert!(
            message(parse(r#"{"instances": []}"#, &x)).ends_with("No values in 'instances' array")
        );
        assert!(message(parse(r#"{"instances": 3}"#, &x))
            .ends_with("Expecting 'instances' to be an list/array"));
        assert!(message(parse(r#"{"signature_name": 3, "inputs": 1}"#, &x))
            .ends_with("'signature_name' key must be a string value."));
        assert_eq!(
            message(parse(r#"{"inputs": [1, 2.5]}"#, &x)),
            "JSON Value: 2.5 Type: Number is not of expected type: int32"
        );
        assert_eq!(
            message(parse(r#"{"inputs": [3000000000]}"#, &x)),
            "JSON Value: 3000000000 Type: Number is not of expected type: int32"
        );
        assert_eq!(
            message(parse(r#"{"inputs": [[1, 2], [3]]}"#, &x)),
            "Encountered list at unexpected size: 1 at level: 1 expected size: 2"
        );
        assert_eq!(
            message(parse(r#"{"inputs": [[1, 2], 3]}"#, &x)),
            "JSON Value: 3 found at incorrect level: 2 in the JSON DOM. Expected at level: 2"
        );
        assert_eq!(
            message(parse(r#"{"instances": [[1, 2], [3, 4, 5]]}"#, &x)),
            "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting tensor size: 2 but got: 3"
        );
        assert_eq!(
            message(parse(
                r#"{"inputs": {"b64": "%%%"}}"#,
                &[("s", codec::DT_STRING)]
            )),
            "Unable to base64 decode"
        );
        assert_eq!(
            message(parse(r#"{"inputs": {"b64": "AA=="}}"#, &x)),
            "JSON Value: {\"b64\":\"AA==\"} Type: Object is not of expected type: int32"
        );
        let half = parse(r#"{"inputs": [1]}"#, &[("h", codec::DT_HALF)]).unwrap_err();
        assert_eq!(half.code, Code::Unimplemented);
        assert_eq!(half.message, "Conversion of JSON Value: 1 to type: half");
    }

    fn tensor(dtype: i32, shape: &[i64]) -> TensorProto {
        TensorProto {
            dtype,
            tensor_shape: Some(shape_proto(shape)),
            ..TensorProto::default()
        }
    }

    fn compact(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn answers_follow_the_request_format() {
        let mut scores = tensor(codec::DT_FLOAT, &[2, 2]);
        scores.float_val = vec![0.1, 2.0, 1e-5, f32::NAN];
        let mut ids = tensor(codec::DT_STRING, &[2]);
        ids.string_val = vec![Bytes::from_static(b"a"), Bytes::from_static(b"b\"")];
        let mut raw_bytes = tensor(codec::DT_STRING, &[2]);
        raw_bytes.string_val = vec![Bytes::from_static(b"\xff"), Bytes::new()];
        let one: BTreeMap<String, TensorProto> = [("scores".to_string(), scores.clone())].into();
        let row = predict_answer(&one, Format::Row).unwrap();
        assert!(row.contains("[0.1, 2.0],\n        [1e-05, NaN]"), "{row}");
        let columnar = predict_answer(&one, Format::Columnar).unwrap();
        assert!(
            columnar.contains("\"outputs\": [[0.1, 2.0], [1e-05, NaN]]"),
            "{columnar}"
        );
        let several: BTreeMap<String, TensorProto> = [
            ("ids".to_string(), ids),
            ("raw_bytes".to_string(), raw_bytes),
        ]
        .into();
        assert_eq!(
            compact(&predict_answer(&several, Format::Row).unwrap()),
            compact(
                r#"{"predictions": [{"ids": "a", "raw_bytes": {"b64": "/w=="}},
                                    {"ids": "b\"", "raw_bytes": {"b64": ""}}]}"#
            )
        );
        let mut other = tensor(codec::DT_INT64, &[3]);
        other.int64_val = vec![1, 2, 3];
        let uneven: BTreeMap<String, TensorProto> =
            [("a".to_string(), scores), ("b".to_string(), other)].into();
        assert_eq!(
            message(predict_answer(&uneven, Format::Row)),
            "Tensor name: b has inconsistent batch size: 3 expecting: 2"
        );
        assert!(predict_answer(&uneven, Format::Columnar).is_ok());
        let half: BTreeMap<String, TensorProto> =
            [("h".to_string(), tensor(codec::DT_HALF, &[1]))].into();
        assert_eq!(
            message(predict_answer(&half, Format::Columnar)),
            "Failed to write JSON value for tensor type: half"
        );
    }

    /// tensorflow/core/example/example.proto's Example, to read back what `example_bytes`
    /// wrote.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Example {
        #[prost(message, optional, tag = "1")]
        features: Option<Features>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Features {
        #[prost(map = "string, message", tag = "1")]
        feature: HashMap<String, Feature>,
    }

    #[test]
    fn a_feature_named_twice_in_an_example_keeps_its_last_value_as_tf_servings_walk_does() {
        // TF Serving assigns every member of an example in turn; elsewhere in the body the
        // first value stays (its lookups), a b64 object's and the body's own keys included.
        let body =
            br#"{"examples": [{"age": 5, "age": 500, "tag": {"b64": "AA==", "b64": "AQ=="}}],
            "context": {"c": 1, "c": 2}, "examples": [{"age": 7}], "context": {"c": 9}}"#;
        let (_, input) = parse_examples(body).unwrap();
        let Some(input::Kind::ExampleListWithContext(list)) = input.kind else {
            panic!("no context");
        };
        let int = |value: i64| Some(feature::Kind::Int64List(Int64List { value: vec![value] }));
        let example = Example::decode(list.examples[0].clone()).unwrap();
        let features = example.features.unwrap().feature;
        assert_eq!(features["age"].kind, int(500));
        assert_eq!(
            features["tag"].kind,
            Some(feature::Kind::BytesList(BytesList {
                value: vec![Bytes::from_static(b"\0")]
            }))
        );
        let context = Example::decode(list.context).unwrap();
        assert_eq!(context.features.unwrap().feature["c"].kind, int(2));
    }

    #[test]
    fn examples_are_built_as_tf_serving_builds_them() {
        let body = br#"{"context": {"country": "fr"}, "examples": [
            {"age": 3, "weight": 1.5, "tags": ["a", {"b64": "AA=="}], "ok": true},
            {"age": [], "weight": [2.0, 3.5]}]}"#;
        let (signature, input) = parse_examples(body).unwrap();
        assert_eq!(signature, "");
        let Some(input::Kind::ExampleListWithContext(list)) = input.kind else {
            panic!("no context");
        };
        let context = Example::decode(list.context).unwrap();
        let country = &context.features.unwrap().feature["country"];
        assert_eq!(
            country.kind,
            Some(feature::Kind::BytesList(BytesList {
                value: vec![Bytes::from_static(b"fr")]
            }))
        );
        let first = Example::decode(list.examples[0].clone()).unwrap();
        let features = first.features.unwrap().feature;
        assert_eq!(
            features["age"].kind,
            Some(feature::Kind::Int64List(Int64List { value: vec![3] }))
        );
        assert_eq!(
            features["ok"].kind,
            Some(feature::Kind::Int64List(Int64List { value: vec![1] }))
        );
        assert_eq!(
            features["weight"].kind,
            Some(feature::Kind::FloatList(FloatList { value: vec![1.5] }))
        );
        let second = Example::decode(list.examples[1].clone()).unwrap();
        assert_eq!(second.features.unwrap().feature["age"].kind, None);
        // Every map entry carries its key and value, even an empty name and a feature of no
        // kind: the bytes C++ protobuf writes (checked against Python's protobuf, which
        // writes the same), which TensorFlow's Example parser needs.
        let (_, input) = parse_examples(br#"{"examples": [{"": [], "v": []}, {}]}"#).unwrap();
        let Some(input::Kind::ExampleList(list)) = input.kind else {
            panic!("no list");
        };
        assert_eq!(
            &list.examples[0][..],
            b"\n\x0d\n\x04\n\x00\x12\x00\n\x05\n\x01v\x12\x00"
        );
        assert_eq!(&list.examples[1][..], b"\n\x00");
        let error = |body: &str| parse_examples(body.as_bytes()).unwrap_err().message;
        assert_eq!(
            error(r#"{"examples": [{"w": [2, 3.5]}]}"#),
            "Unexpected element type in feature: w expecting type: int64"
        );
        assert_eq!(
            error(r#"{"examples": [{"w": null}]}"#),
            "Feature: w has element with unexpected JSON type: Null"
        );
        assert_eq!(
            error(r#"{"examples": [{"w": 18446744073709551615}]}"#),
            "Feature: w has uint64_t element. Only int64_t is supported."
        );
        assert_eq!(
            error(r#"{"examples": [3]}"#),
            "Example must be JSON object but got JSON Number"
        );
        assert!(error(r#"{"inputs": []}"#)
            .ends_with("When method is classify, key 'examples' is expected and was not found"));
        assert!(error(r#"{"examples": []}"#).ends_with("'examples' value is an empty array"));
    }

    #[test]
    fn classify_and_regress_answers() {
        use crate::proto::tensorflow::serving::{Class, Classifications, Regression};
        let result = ClassificationResult {
            classifications: vec![Classifications {
                classes: vec![
                    Class {
                        label: "a".into(),
                        score: 0.25,
                    },
                    Class {
                        label: "b".into(),
                        score: 0.75,
                    },
                ],
            }],
        };
        assert_eq!(
            compact(&classification_answer(&result).unwrap()),
            compact(r#"{"results": [[["a", 0.25], ["b", 0.75]]]}"#)
        );
        let result = RegressionResult {
            regressions: vec![Regression { value: 1.0 }, Regression { value: 0.5 }],
        };
        assert_eq!(
            compact(&regression_answer(&result).unwrap()),
            compact(r#"{"results": [1.0, 0.5]}"#)
        );
        assert!(regression_answer(&RegressionResult::default()).is_err());
    }

    #[test]
    fn floats_are_written_as_tf_serving_writes_them() {
        let float = |v: f32| {
            let mut out = String::new();
            write_float(&mut out, v);
            out
        };
        let double = |v: f64| {
            let mut out = String::new();
            write_double(&mut out, v);
            out
        };
        assert_eq!(float(0.2), "0.2");
        assert_eq!(float(3.0), "3.0");
        assert_eq!(float(-0.0), "-0.0");
        assert_eq!(float(9_000_000.0), "9e+06");
        assert_eq!(float(0.00003), "3e-05");
        assert_eq!(float(0.123_456_79), "0.123456791");
        assert_eq!(float(123_456.7), "123456.703");
        assert_eq!(float(f32::INFINITY), "Infinity");
        assert_eq!(float(f32::NEG_INFINITY), "-Infinity");
        assert_eq!(double(0.1), "0.1");
        assert_eq!(double(1.0 / 3.0), "0.33333333333333331");
        assert_eq!(double(1e100), "1e+100");
        assert_eq!(error_body("a \"b\"\n"), "{ \"error\": \"a \\\"b\\\"\\n\" }");
    }
}
