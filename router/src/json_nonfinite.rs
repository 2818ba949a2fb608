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
        }
    })
}

/// The most bytes a token's marker takes in a body (more than it adds): what
/// `json_tensor::parse_cost` charges for each `N` or `I` outside strings.
pub fn most_added_bytes() -> usize {
    markers().quoted.iter().map(String::len).max().unwrap_or(0)
}

/// The `which` of a `-0` token, after the three markers'.
const MINUS_ZERO: usize = 3;

/// What a token becomes in the rewritten text.
fn replacement(which: usize) -> &'static [u8] {
    match which {
        MINUS_ZERO => b" 0",
        _ => markers().quoted[which].as_bytes(),
    }
}

/// `body` with every non-finite token outside strings written as its marker, and every
/// `-0` as ` 0`; borrowed as it is when it has none. Anything else (`Infi`, `NaNx`) is left
/// for the parser to refuse.
pub fn rewrite(body: &[u8]) -> Cow<'_, [u8]> {
    let mut out: Option<Vec<u8>> = None;
    let mut copied = 0; // body[..copied] is in `out`
    for (start, len, which) in Tokens::new(body) {
        let out = out.get_or_insert_with(|| Vec::with_capacity(body.len() + 64));
        out.extend_from_slice(&body[copied..start]);
        out.extend_from_slice(replacement(which));
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
    let mut added = 0; // what the markers before `offset` added to the text
    for (start, len, which) in Tokens::new(body) {
        let marker = replacement(which).len();
        let at = start + added;
        if offset < at {
            break;
        }
        if offset < at + marker {
            return start;
        }
        added += marker - len;
    }
    offset - added
}

/// The tokens outside strings of a body, in order: (start, length, which marker, or
/// `MINUS_ZERO`).
struct Tokens<'a> {
    body: &'a [u8],
    at: usize,
    /// Whether the body has a `-0` anywhere: then minus signs are stops of the walk too.
    minus_zero: bool,
}

impl<'a> Tokens<'a> {
    fn new(body: &'a [u8]) -> Tokens<'a> {
        // Outside strings JSON has no N or I, and a body of numbers rarely a `-0`: such a body
        // is not walked.
        let minus_zero = memchr::memmem::find(body, b"-0").is_some();
        let at = if !minus_zero && memchr::memchr2(b'N', b'I', body).is_none() {
            body.len()
        } else {
            0
        };
        Tokens {
            body,
            at,
            minus_zero,
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
    type Item = (usize, usize, usize);

    /// Jumps from one byte that matters to the next: outside strings a quote or a token's
    /// letter, inside them a quote or a backslash (which escapes the byte after it).
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        let body = self.body;
        while let Some(found) = self.next_stop(&body[self.at..]) {
            let here = self.at + found;
            if body[here] == b'"' {
                self.at = here + 1;
                loop {
                    let Some(next) = memchr::memchr2(b'"', b'\\', &body[self.at..]) else {
                        self.at = body.len(); // an unterminated string: the parser says so
                        break;
                    };
                    self.at += next + 1;
                    if body[self.at - 1] == b'"' {
                        break;
                    }
                    self.at = (self.at + 1).min(body.len()); // the escaped byte
                }
                continue;
            }
            if body[here] == b'-' {
                self.at = here + 1;
                if is_minus_zero(&body[here..]) {
                    self.at = here + 2;
                    return Some((here, 2, MINUS_ZERO));
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
                return Some((start, len, which));
            }
        }
        self.at = body.len();
        None
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

/// JSON text serde_json wrote, with each marker written as TF Serving writes the number.
pub fn restore(text: String) -> String {
    if !text.contains("\"\\u0000") {
        return text;
    }
    markers()
        .quoted
        .iter()
        .zip(WRITTEN)
        .fold(text, |text, (quoted, written)| {
            text.replace(quoted, written)
        })
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
