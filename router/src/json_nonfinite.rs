//! JSON's non-finite numbers in REST requests. TF Serving's parser takes `NaN`, `Inf` and
//! `Infinity`, each after an optional minus (rapidjson's `kParseNanAndInfFlag`; a minus before
//! `NaN` is dropped), and Python's `json.dumps` writes a float NaN as `NaN`; serde_json
//! refuses them, and its `Value` cannot hold one.
//!
//! So before a body is parsed, each such token outside strings becomes a string naming it
//! with a key drawn at random when this process first needs one (`"\u0000nan:<key>"`): a
//! client cannot spell one without the key, so such a string is the token and nothing else.
//! The document's readers ask `number` where a number may stand, and `restore` writes the
//! tokens back into the text of an error.
//!
//! One more token is rewritten: rapidjson reads `-0` (no fraction, no exponent) as the
//! integer 0, where serde_json reads the float -0.0, which an integer input refuses ("is not
//! of expected type: int64") and a `:classify` feature takes as a float. It becomes ` 0`, the
//! same length, so that no position moves.
//!
//! And one kind of string: TF Serving parses without `kParseValidateEncodingFlag`, so a
//! string value's bytes are taken as they are, UTF-8 or not (Latin-1 text, bytes a C client
//! wrote into JSON), and an escaped low surrogate alone (`"\udc80"`, what Python's
//! `json.dumps` writes for a byte it decoded with `surrogateescape`) is written out as its
//! three UTF-8-like bytes. serde_json refuses both, and a `String` cannot hold them. Such a
//! string value (not a member's name) becomes `"\u0000raw:<key>:<hex of its bytes>"`;
//! `string_bytes` gives a reader its bytes, `restore` writes it back into an error's text.

use std::borrow::Cow;
use std::sync::OnceLock;

use serde_json::Value;

/// What the three markers stand for, and how TF Serving writes each; `token` and the
/// `Markers` arrays use the same order.
const NUMBERS: [f64; 3] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
const WRITTEN: [&str; 3] = ["NaN", "Infinity", "-Infinity"];

/// The three markers, as parsed strings and as they are written in JSON (quoted).
struct Markers {
    parsed: [String; 3],
    quoted: [String; 3],
    /// A raw string's marker up to its hex, as parsed and as written (quoted).
    raw_parsed: String,
    raw_quoted: String,
}

fn markers() -> &'static Markers {
    static MARKERS: OnceLock<Markers> = OnceLock::new();
    MARKERS.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // Each RandomState holds keys the standard library seeded from the OS.
        let draw = |salt: u64| {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(salt);
            hasher.finish()
        };
        let key = format!("{:016x}{:016x}", draw(1), draw(2));
        let names = ["nan", "inf", "-inf"].map(|name| format!("{name}:{key}"));
        Markers {
            parsed: names.clone().map(|name| format!("\u{0}{name}")),
            quoted: names.map(|name| format!("\"\\u0000{name}\"")),
            raw_parsed: format!("\u{0}raw:{key}:"),
            raw_quoted: format!("\"\\u0000raw:{key}:"),
        }
    })
}

/// The most bytes a token's marker takes in a body (more than it adds): what
/// `json_tensor::parse_cost` charges for each `N` or `I` outside strings.
pub fn most_added_bytes() -> usize {
    markers().quoted.iter().map(String::len).max().unwrap_or(0)
}

/// What a token becomes in the rewritten text.
enum Replacement {
    /// A non-finite number: its marker (0 NaN, 1 +∞, 2 −∞).
    Number(usize),
    /// `-0`: ` 0`.
    MinusZero,
    /// A string value serde_json refuses and rapidjson reads: its marker, quoted.
    Raw(Vec<u8>),
}

impl Replacement {
    fn bytes(&self) -> &[u8] {
        match self {
            Replacement::Number(which) => markers().quoted[*which].as_bytes(),
            Replacement::MinusZero => b" 0",
            Replacement::Raw(quoted) => quoted,
        }
    }
}

/// What a raw string's marker adds to a body at most beyond twice the string's length:
/// `json_tensor::parse_cost` charges it for each string of a body that may hold one.
pub fn raw_added_bytes() -> usize {
    markers().raw_quoted.len() + 1
}

/// Whether a body may hold a string serde_json refuses and rapidjson reads (bytes that are
/// not UTF-8, or an escaped low surrogate without its high one before it); most bodies hold
/// none, and are not walked for them. An escaped pair (an emoji as Python's `json.dumps`
/// writes it) is not one: it had every string of a body walked and charged twice to the
/// request budget (found by a review).
pub fn may_hold_raw_strings(body: &[u8]) -> bool {
    std::str::from_utf8(body).is_err() || has_lone_low_surrogate(body)
}

/// Whether `text` has an escaped low surrogate (`\udc00`-`\udfff`, either case) not right
/// after an escaped high one. (An escaped backslash before `udc..` reads as one too: such a
/// text is walked for nothing, and nothing in it is rewritten.)
fn has_lone_low_surrogate(text: &[u8]) -> bool {
    let surrogate = |escape: &[u8], fourth: fn(u8) -> bool| {
        escape.len() >= 6
            && escape[1] == b'u'
            && matches!(escape[2], b'd' | b'D')
            && fourth(escape[3])
    };
    let low = |b: u8| matches!(b, b'c'..=b'f' | b'C'..=b'F');
    let high = |b: u8| matches!(b, b'8' | b'9' | b'a' | b'b' | b'A' | b'B');
    let mut from = 0;
    while let Some(found) = memchr::memchr(b'\\', &text[from..]) {
        let at = from + found;
        from = at + 1;
        if surrogate(&text[at..], low) && !(at >= 6 && surrogate(&text[at - 6..at], high)) {
            return true;
        }
    }
    false
}

/// `body` with every non-finite token outside strings written as its marker, every `-0`
/// as ` 0`, and every string value serde_json refuses but rapidjson reads as its marker;
/// borrowed as it is when it has none. Anything else (`Infi`, `NaNx`, a control character
/// in a string) is left for the parser to refuse.
pub fn rewrite(body: &[u8]) -> Cow<'_, [u8]> {
    let mut out: Option<Vec<u8>> = None;
    let mut copied = 0; // body[..copied] is in `out`
    for (start, len, replacement) in Tokens::new(body) {
        let out = out.get_or_insert_with(|| Vec::with_capacity(body.len() + 64));
        out.extend_from_slice(&body[copied..start]);
        out.extend_from_slice(replacement.bytes());
        copied = start + len;
    }
    match out {
        None => Cow::Borrowed(body),
        Some(mut out) => {
            out.extend_from_slice(&body[copied..]);
            Cow::Owned(out)
        }
    }
}

/// Where `offset`, a position in `rewrite(body)`, is in `body` itself: an error's position
/// as the client wrote it (TF Serving's parser reads the tokens in place). A position inside
/// a marker is its token's start.
pub fn original_offset(body: &[u8], offset: usize) -> usize {
    // What the markers before `offset` added to the text (a raw string's marker may be
    // shorter than the string: then less than nothing).
    let mut added: isize = 0;
    for (start, len, replacement) in Tokens::new(body) {
        let marker = replacement.bytes().len();
        let at = start.saturating_add_signed(added);
        if offset < at {
            break;
        }
        if offset < at + marker {
            return start;
        }
        added += marker as isize - len as isize;
    }
    offset.saturating_add_signed(-added)
}

/// What a body's parse needs rewritten, in order: (start, length, what it becomes).
struct Tokens<'a> {
    body: &'a [u8],
    at: usize,
    /// Whether the body has a `-0` anywhere: then minus signs are stops of the walk too.
    minus_zero: bool,
    /// Whether its strings are each looked at (`may_hold_raw_strings`).
    raw_strings: bool,
}

impl<'a> Tokens<'a> {
    fn new(body: &'a [u8]) -> Tokens<'a> {
        // Outside strings JSON has no N or I, a body of numbers rarely a `-0`, and most
        // bodies no string serde_json refuses: such a body is not walked.
        let minus_zero = memchr::memmem::find(body, b"-0").is_some();
        let raw_strings = may_hold_raw_strings(body);
        let at = if !minus_zero && !raw_strings && memchr::memchr2(b'N', b'I', body).is_none() {
            body.len()
        } else {
            0
        };
        Tokens {
            body,
            at,
            minus_zero,
            raw_strings,
        }
    }

    /// Where the next byte that matters outside strings is in `text`: a quote, a token's
    /// letter, and a minus sign where one may start a `-0`.
    fn next_stop(&self, text: &[u8]) -> Option<usize> {
        if self.minus_zero {
            text.iter()
                .position(|byte| matches!(byte, b'"' | b'N' | b'I' | b'-'))
        } else {
            memchr::memchr3(b'"', b'N', b'I', text)
        }
    }
}

impl Iterator for Tokens<'_> {
    type Item = (usize, usize, Replacement);

    /// Jumps from one byte that matters to the next: outside strings a quote or a token's
    /// letter, inside them a quote or a backslash (which escapes the byte after it).
    fn next(&mut self) -> Option<(usize, usize, Replacement)> {
        let body = self.body;
        while let Some(found) = self.next_stop(&body[self.at..]) {
            let here = self.at + found;
            if body[here] == b'"' {
                self.at = here + 1;
                let mut closed = false;
                loop {
                    let Some(next) = memchr::memchr2(b'"', b'\\', &body[self.at..]) else {
                        self.at = body.len(); // an unterminated string: the parser says so
                        break;
                    };
                    self.at += next + 1;
                    if body[self.at - 1] == b'"' {
                        closed = true;
                        break;
                    }
                    self.at = (self.at + 1).min(body.len()); // the escaped byte
                }
                if closed && self.raw_strings {
                    if let Some(marker) = raw_marker(&body[here + 1..self.at - 1], &body[self.at..])
                    {
                        return Some((here, self.at - here, Replacement::Raw(marker)));
                    }
                }
                continue;
            }
            if body[here] == b'-' {
                self.at = here + 1;
                // An exponent's sign (`1e-0`) is inside a number, not the start of one.
                let exponent = here > 0 && matches!(body[here - 1], b'e' | b'E');
                if !exponent && is_minus_zero(&body[here..]) {
                    self.at = here + 2;
                    return Some((here, 2, Replacement::MinusZero));
                }
                continue; // a minus before another number, or before a token's letter
            }
            let start = if here > 0 && body[here - 1] == b'-' {
                here - 1
            } else {
                here
            };
            self.at = here + 1;
            if let Some((len, which)) = token(&body[start..]) {
                self.at = start + len;
                return Some((start, len, Replacement::Number(which)));
            }
        }
        self.at = body.len();
        None
    }
}

/// The marker (quoted) of a string whose content, between its quotes, is `content` and
/// which `after` follows: only for a string value serde_json refuses and rapidjson reads.
/// A member's name (a colon follows) is left for serde_json to refuse, as before.
fn raw_marker(content: &[u8], after: &[u8]) -> Option<Vec<u8>> {
    if std::str::from_utf8(content).is_ok() && !has_lone_low_surrogate(content) {
        return None; // serde_json reads it: most strings of a body that holds one
    }
    let next = after
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    if next == Some(&b':') {
        return None;
    }
    let (bytes, serde_refuses) = rapidjson_string(content)?;
    if !serde_refuses {
        return None;
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut marker = markers().raw_quoted.as_bytes().to_vec();
    marker.reserve(2 * bytes.len() + 1);
    for byte in bytes {
        marker.extend_from_slice(&[HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 0xf)]]);
    }
    marker.push(b'"');
    Some(marker)
}

/// A string's content read as rapidjson 1.1.0 reads it without validating its encoding
/// (`ParseStringToStream`): other bytes copied as they are, escapes decoded, a surrogate
/// pair joined, a low surrogate alone written as its three bytes; None where rapidjson
/// refuses it (a control character, a bad escape, a high surrogate without its low one).
/// With it, whether serde_json refuses the same content (not UTF-8, or a lone surrogate).
fn rapidjson_string(content: &[u8]) -> Option<(Vec<u8>, bool)> {
    let mut out = Vec::with_capacity(content.len());
    let mut lone_surrogate = false;
    let mut at = 0;
    while let Some(&byte) = content.get(at) {
        match byte {
            b'\\' => {
                let escape = *content.get(at + 1)?;
                at += 2;
                let plain = match escape {
                    b'"' | b'\\' | b'/' => escape,
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'u' => {
                        let mut point = hex4(content.get(at..at + 4)?)?;
                        at += 4;
                        if (0xD800..=0xDBFF).contains(&point) {
                            if content.get(at..at + 2) != Some(b"\\u") {
                                return None;
                            }
                            let low = hex4(content.get(at + 2..at + 6)?)?;
                            if !(0xDC00..=0xDFFF).contains(&low) {
                                return None;
                            }
                            at += 6;
                            point = (((point - 0xD800) << 10) | (low - 0xDC00)) + 0x10000;
                        } else if (0xDC00..=0xDFFF).contains(&point) {
                            lone_surrogate = true;
                        }
                        encode_utf8(point, &mut out);
                        continue;
                    }
                    _ => return None,
                };
                out.push(plain);
            }
            0x00..=0x1f => return None,
            _ => {
                out.push(byte);
                at += 1;
            }
        }
    }
    let serde_refuses = lone_surrogate || std::str::from_utf8(&out).is_err();
    Some((out, serde_refuses))
}

/// Four hex digits, either case, as rapidjson's `ParseHex4`.
fn hex4(digits: &[u8]) -> Option<u32> {
    digits.iter().try_fold(0u32, |value, &digit| {
        let nibble = (digit as char).to_digit(16)?;
        Some(value << 4 | nibble)
    })
}

/// A code point in UTF-8's encoding, surrogates too (rapidjson's `UTF8::Encode`).
fn encode_utf8(point: u32, out: &mut Vec<u8>) {
    if point < 0x80 {
        out.push(point as u8);
    } else if point < 0x800 {
        out.extend_from_slice(&[0xC0 | (point >> 6) as u8, 0x80 | (point & 0x3F) as u8]);
    } else if point < 0x10000 {
        out.extend_from_slice(&[
            0xE0 | (point >> 12) as u8,
            0x80 | ((point >> 6) & 0x3F) as u8,
            0x80 | (point & 0x3F) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xF0 | (point >> 18) as u8,
            0x80 | ((point >> 12) & 0x3F) as u8,
            0x80 | ((point >> 6) & 0x3F) as u8,
            0x80 | (point & 0x3F) as u8,
        ]);
    }
}

/// The token at the start of `text`: its length and which marker (0 NaN, 1 +∞, 2 −∞).
fn token(text: &[u8]) -> Option<(usize, usize)> {
    let minus = usize::from(text.first() == Some(&b'-'));
    let rest = &text[minus..];
    let (len, which) = if rest.starts_with(b"NaN") {
        (3, 0)
    } else if rest.starts_with(b"Infinity") {
        (8, 1 + minus)
    } else if rest.starts_with(b"Inf") && rest.get(3) != Some(&b'i') {
        (3, 1 + minus)
    } else {
        return None;
    };
    Some((minus + len, which))
}

/// Whether `text` starts with the number `-0`: no more digits, no fraction, no exponent
/// (rapidjson's integer 0; `-0.0` and `-0e1` are doubles there too).
fn is_minus_zero(text: &[u8]) -> bool {
    text.starts_with(b"-0") && !matches!(text.get(2), Some(b'0'..=b'9' | b'.' | b'e' | b'E'))
}

/// The number a marker stands for; None for any other value.
pub fn number(value: &Value) -> Option<f64> {
    let Value::String(text) = value else {
        return None;
    };
    if !text.starts_with('\u{0}') {
        return None;
    }
    let which = markers().parsed.iter().position(|marker| marker == text)?;
    Some(NUMBERS[which])
}

/// A string value's bytes: a raw string's own (`rewrite`), else its text's. None for any
/// other value, and for a non-finite number's marker.
pub fn string_bytes(value: &Value) -> Option<Cow<'_, [u8]>> {
    let Value::String(text) = value else {
        return None;
    };
    if !text.starts_with('\u{0}') {
        return Some(Cow::Borrowed(text.as_bytes()));
    }
    if let Some(hex) = text.strip_prefix(markers().raw_parsed.as_str()) {
        return Some(Cow::Owned(from_hex(hex)));
    }
    number(value)
        .is_none()
        .then_some(Cow::Borrowed(text.as_bytes()))
}

/// A string value's text: a raw string's bytes where they are not UTF-8 replaced (an error
/// message, a name to look up that no name can match).
pub fn string_text(value: &Value) -> Option<Cow<'_, str>> {
    match string_bytes(value)? {
        Cow::Borrowed(bytes) => std::str::from_utf8(bytes).ok().map(Cow::Borrowed),
        Cow::Owned(bytes) => Some(Cow::Owned(String::from_utf8_lossy(&bytes).into_owned())),
    }
}

/// The bytes of hex digit pairs (a trailing half pair, where an error's text was cut, left).
fn from_hex(hex: &str) -> Vec<u8> {
    hex.as_bytes()
        .chunks_exact(2)
        .filter_map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

/// JSON text serde_json wrote, with each marker written as TF Serving writes the number,
/// and each raw string as a string of its text (bytes that are not UTF-8 replaced). A raw
/// string's marker cut short (an error's text is cut) is written as far as it goes.
pub fn restore(text: String) -> String {
    if !text.contains("\"\\u0000") {
        return text;
    }
    let text = markers()
        .quoted
        .iter()
        .zip(WRITTEN)
        .fold(text, |text, (quoted, written)| {
            text.replace(quoted, written)
        });
    let prefix = markers().raw_quoted.as_str();
    if !text.contains(prefix) {
        return text;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find(prefix) {
        out.push_str(&rest[..at]);
        rest = &rest[at + prefix.len()..];
        let hex_len = rest
            .bytes()
            .position(|b| !b.is_ascii_hexdigit())
            .unwrap_or(rest.len());
        let bytes = from_hex(&rest[..hex_len]);
        let closed = rest[hex_len..].starts_with('"');
        rest = &rest[hex_len + usize::from(closed)..];
        let written = serde_json::to_string(&String::from_utf8_lossy(&bytes)).unwrap_or_default();
        // Unclosed: the text was cut inside it, and stays cut (no closing quote).
        out.push_str(if closed {
            &written
        } else {
            written.trim_end_matches('"')
        });
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Value {
        serde_json::from_slice(&rewrite(body.as_bytes())).unwrap()
    }

    #[test]
    fn every_spelling_rapidjson_takes_becomes_its_number() {
        let value = parse(r#"[NaN, -NaN, Inf, -Inf, Infinity, -Infinity, 1, -2.5]"#);
        let numbers: Vec<Option<f64>> = value.as_array().unwrap().iter().map(number).collect();
        assert!(numbers[0].unwrap().is_nan() && numbers[1].unwrap().is_nan());
        assert_eq!(
            numbers[2..6],
            [
                Some(f64::INFINITY),
                Some(f64::NEG_INFINITY),
                Some(f64::INFINITY),
                Some(f64::NEG_INFINITY)
            ]
        );
        assert_eq!(numbers[6..], [None, None]);
        assert_eq!(value[7], serde_json::json!(-2.5));
    }

    #[test]
    fn strings_keys_and_escapes_are_left_as_they_are() {
        let body = r#"{"NaN": "Infinity \" NaN", "x\\": ["-Inf", "\\"]}"#;
        assert!(matches!(rewrite(body.as_bytes()), Cow::Borrowed(_)));
        let value = parse(body);
        assert_eq!(value["NaN"], "Infinity \" NaN");
        assert_eq!(value["x\\"][0], "-Inf");
        assert!(number(&value["NaN"]).is_none());
    }

    #[test]
    fn documents_without_tokens_come_back_as_they_are() {
        // Strings full of the bytes the scan stops at, written by serde_json: nothing changes.
        let mut seed = 7u64;
        let alphabet = ['N', 'I', 'a', '"', '\\', '-', '\u{0}', 'f', ' ', 'é'];
        for _ in 0..500 {
            let text: String = (0..12)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    alphabet[(seed >> 33) as usize % alphabet.len()]
                })
                .collect();
            let body = serde_json::json!({ text.clone(): [text, -1.5, {"NaN": null}] }).to_string();
            assert_eq!(&*rewrite(body.as_bytes()), body.as_bytes(), "{body}");
        }
    }

    #[test]
    fn near_misses_are_left_for_the_parser_to_refuse() {
        for body in [
            "[Infin]",
            "[NaNx]",
            "[nan]",
            "[-NaX]",
            "[Infinityy]",
            "[\"NaN\\",
            "[\"\\",
            "[NaN, \"I",
            "[NaN, \"\\",
        ] {
            assert!(
                serde_json::from_slice::<Value>(&rewrite(body.as_bytes())).is_err(),
                "{body}"
            );
        }
    }

    #[test]
    fn a_client_cannot_spell_a_marker_without_the_key() {
        let forged = parse(r#"["\u0000nan:0000000000000000", "\u0000inf:"]"#);
        assert!(forged
            .as_array()
            .unwrap()
            .iter()
            .all(|v| number(v).is_none()));
    }

    #[test]
    fn a_position_in_the_rewritten_text_maps_back_to_the_clients() {
        let body = br#"{"a": [NaN, 1, -Infinity], "b": "NaN", "c": Inf x}"#;
        let text = rewrite(body);
        let find = |hay: &[u8], needle: &[u8]| {
            hay.windows(needle.len()).position(|w| w == needle).unwrap()
        };
        for needle in [&b"1,"[..], b"\"b\"", b"\"NaN\"", b"x}", b"{"] {
            assert_eq!(
                original_offset(body, find(&text, needle)),
                find(body, needle),
                "{}",
                String::from_utf8_lossy(needle)
            );
        }
        // Inside a marker: its token's start.
        let marker = find(&text, markers().quoted[2].as_bytes());
        assert_eq!(original_offset(body, marker + 5), find(body, b"-Infinity"));
        assert_eq!(original_offset(body, text.len()), body.len());
        assert_eq!(original_offset(b"[1, 2]", 4), 4);
    }

    #[test]
    fn minus_zero_is_the_integer_zero_as_rapidjson_reads_it() {
        let value = parse(r#"{"a": [-0, -0.0, -0e1, -0E1, -0.5, 0], "b": "-0"}"#);
        assert_eq!(value["a"][0], serde_json::json!(0));
        assert!(value["a"][0].is_i64() || value["a"][0].is_u64());
        for at in 1..4 {
            let number = value["a"][at].as_f64().unwrap();
            assert!(value["a"][at].is_f64() && number == 0.0 && number.is_sign_negative());
        }
        assert_eq!(value["a"][4], serde_json::json!(-0.5));
        assert_eq!(value["b"], "-0", "strings are left as they are");
        // An exponent of -0 is a number's part (found by a review: `1e-0` became `1e 0`).
        let exponents = parse("[1e-0, 2.5E-0, -0e-0, 1e-00]");
        assert_eq!(exponents, serde_json::json!([1.0, 2.5, -0.0, 1.0]));
        // `-05` and `-01` are not numbers: left for the parser to refuse.
        assert!(serde_json::from_slice::<Value>(&rewrite(b"[-05]")).is_err());
        // The text keeps its length: positions do not move.
        let body = br#"[-0, NaN, -0 x]"#;
        let text = rewrite(body);
        let x = text.iter().position(|&b| b == b'x').unwrap();
        assert_eq!(original_offset(body, x), 13);
        assert!(matches!(rewrite(b"[-1.5, -20]"), Cow::Borrowed(_)));
    }

    #[test]
    fn string_values_rapidjson_reads_and_serde_json_refuses_keep_their_bytes() {
        // The bytes TF Serving's parser (rapidjson 1.1.0, no encoding check) gives for each,
        // measured by a hunt that ran TF Serving's own parse call.
        let body =
            b"{\"a\": [\"caf\xe9\", \"a\\udc00b\", \"\\ud83d\\ude00\\u00e9\\n\xff\", \"ok\"]}";
        let text = rewrite(body);
        let value: Value = serde_json::from_slice(&text).unwrap();
        let bytes: Vec<Vec<u8>> = value["a"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| string_bytes(v).unwrap().into_owned())
            .collect();
        assert_eq!(bytes[0], b"caf\xe9");
        assert_eq!(bytes[1], b"a\xed\xb0\x80b");
        assert_eq!(
            bytes[2],
            "\u{1F600}\u{e9}\n"
                .bytes()
                .chain([0xff])
                .collect::<Vec<u8>>()
        );
        assert_eq!(bytes[3], b"ok");
        assert_eq!(
            value["a"][3], "ok",
            "a string serde_json reads is left as it is"
        );
        assert_eq!(string_text(&value["a"][0]).unwrap(), "caf\u{FFFD}");
        // Written back into an error's text as text, the marker's key never shown.
        assert_eq!(
            restore(value.to_string()),
            "{\"a\":[\"caf\u{FFFD}\",\"a\u{FFFD}\u{FFFD}\u{FFFD}b\",\"\u{1F600}\u{e9}\\n\u{FFFD}\",\"ok\"]}"
        );
        let cut = value["a"][0].to_string();
        assert_eq!(restore(cut[..cut.len() - 3].to_string()), "\"caf");
    }

    #[test]
    fn strings_rapidjson_refuses_or_names_are_left_for_the_parser() {
        for body in [
            &b"[\"a\\ud800\"]"[..],   // a high surrogate alone
            b"[\"a\\ud800\\u0041\"]", // ... before another escape
            b"[\"\xe9\x01\"]",        // a control character
            b"[\"\xe9\\q\"]",         // a bad escape
            b"{\"caf\xe9\": 1}",      // a member's name
            b"{\"caf\xe9\" \n : 1}",
        ] {
            assert!(
                serde_json::from_slice::<Value>(&rewrite(body)).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // UTF-8 and escaped pairs only: nothing to rewrite, and the body is not walked (an
        // emoji as Python writes it had every string walked and charged twice).
        let plain = "[\"caf\u{e9}\", \"\\ud83d\\ude00\", \"\\uD83D\\uDE00\"]".as_bytes();
        assert!(!may_hold_raw_strings(plain));
        assert!(!may_hold_raw_strings(b"[\"caf\xc3\xa9\", 1]"));
        assert!(matches!(rewrite(plain), Cow::Borrowed(_)));
        assert!(may_hold_raw_strings(b"[\"\\udc80\"]"));
        assert!(may_hold_raw_strings(b"[\"\\ud83d\", \"\\ude00\"]"));
    }

    #[test]
    fn a_position_after_a_raw_string_maps_back_to_the_clients() {
        let body = b"[\"\xe9\", \"abc\xe9\xe9\xe9\xe9\", x]";
        let text = rewrite(body);
        let x = text.iter().position(|&b| b == b'x').unwrap();
        assert_eq!(
            original_offset(body, x),
            body.iter().position(|&b| b == b'x').unwrap()
        );
    }

    #[test]
    fn restore_writes_the_tokens_back() {
        let value = parse(r#"{"a": [NaN, -Infinity, Inf], "b": "NaN"}"#);
        assert_eq!(
            restore(value.to_string()),
            r#"{"a":[NaN,-Infinity,Infinity],"b":"NaN"}"#
        );
        let body = b"[-Infinity]";
        assert!(rewrite(body).len() - body.len() <= most_added_bytes());
    }
}
