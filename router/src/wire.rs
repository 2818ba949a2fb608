//! The router ⇄ worker wire protocol, the Rust side of `mpspool/wire.py` (the one
//! definition: read its docstring for the message table).
//!
//! A message is `[header, *tensor frames]`: the header a msgpack map `{"v": 1, "k": kind,
//! ...}`, each tensor a separate frame of raw little-endian bytes, except DT_STRING tensors,
//! which travel as one msgpack array of byte strings. The router sees each worker message
//! behind the worker's ZeroMQ identity (`<slot>:<pid>`). Never pickle: msgpack only.
//! The test vectors in `tests/vectors/wire.json` are checked by both sides.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: i64 = 1;

pub const WORKERS_ENDPOINT: &str = "workers.ipc";
pub const CONTROL_ENDPOINT: &str = "control.ipc";

pub fn endpoint(run_dir: &str, name: &str) -> String {
    format!("ipc://{run_dir}/{name}")
}

/// `[name, dtype, shape]`: dtype a TensorFlow DataType number.
pub type TensorMeta = (String, i32, Vec<i64>);

/// A message that does not follow the protocol (wrong version, bad framing, bad msgpack).
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("undecodable header: {0}")]
    Undecodable(#[from] rmp_serde::decode::Error),
    #[error("expected protocol version {PROTOCOL_VERSION}, got {0}")]
    Version(i64),
    #[error("a string tensor frame must hold an array of byte strings: {0}")]
    StringFrame(String),
}

/// Everything a worker sends. Unknown kinds fail to decode (and are logged and dropped).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "k")]
pub enum WorkerMessage {
    /// `+ [serialized SignatureDefMap]`; weights: where its variables live, or nil.
    #[serde(rename = "ready")]
    Ready {
        slot: String,
        pid: i64,
        model: String,
        version: i64,
        #[serde(default)]
        weights: Option<rmpv::Value>,
        /// `[version dir, µs, records]` of the warm-up file it replayed; none without one
        /// (or with warm-up off).
        #[serde(default)]
        warmup: Option<(String, u64, u64)>,
        /// `[version dir, µs]` of its SavedModel's load (none from a worker before these).
        #[serde(default)]
        load: Option<(String, u64)>,
    },
    /// weights: READY's, sent again when serving copied a variable out of the segment.
    #[serde(rename = "hb")]
    Heartbeat {
        slot: String,
        pid: i64,
        #[serde(default)]
        served: i64,
        #[serde(default)]
        weights: Option<rmpv::Value>,
    },
    /// `+ one frame per output tensor`; t: `[start, end]` of the model run, µs since the epoch.
    #[serde(rename = "reply")]
    Reply {
        id: u64,
        tensors: Vec<TensorMeta>,
        #[serde(default)]
        t: Option<(i64, i64)>,
    },
    #[serde(rename = "error")]
    Error { id: u64, code: i32, message: String },
    #[serde(rename = "bye")]
    Bye { slot: String, pid: i64 },
}

#[derive(Deserialize)]
struct Envelope {
    v: i64,
    #[serde(flatten)]
    message: WorkerMessage,
}

/// Decode a worker's header frame.
pub fn decode_worker_header(frame: &[u8]) -> Result<WorkerMessage, ProtocolError> {
    #[derive(Deserialize)]
    struct VersionOnly {
        v: i64,
    }
    match rmp_serde::from_slice::<Envelope>(frame) {
        Ok(envelope) if envelope.v == PROTOCOL_VERSION => Ok(envelope.message),
        Ok(envelope) => Err(ProtocolError::Version(envelope.v)),
        // Say "wrong version" rather than "bad field" when that is the reason.
        Err(error) => match rmp_serde::from_slice::<VersionOnly>(frame) {
            Ok(only) if only.v != PROTOCOL_VERSION => Err(ProtocolError::Version(only.v)),
            _ => Err(ProtocolError::Undecodable(error)),
        },
    }
}

#[derive(Serialize)]
struct RequestHeader<'a> {
    v: i64,
    k: &'static str,
    id: u64,
    sig: &'a str,
    tensors: &'a [TensorMeta],
    outputs: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline: Option<u64>,
}

/// The REQUEST header: `{v, k: "req", id, sig, tensors, outputs[, deadline]}`; its tensors
/// follow as frames. `deadline`: when the client stops waiting, in µs of CLOCK_MONOTONIC
/// (`deadline_micros`); left out when the client set none.
pub fn encode_request(
    id: u64,
    signature: &str,
    tensors: &[TensorMeta],
    outputs: &[String],
    deadline: Option<u64>,
) -> Vec<u8> {
    let header = RequestHeader {
        v: PROTOCOL_VERSION,
        k: "req",
        id,
        sig: signature,
        tensors,
        outputs,
        deadline,
    };
    // Serializing plain strings, integers and arrays into a Vec cannot fail.
    rmp_serde::to_vec_named(&header).unwrap_or_default()
}

/// Now in µs of CLOCK_MONOTONIC: the clock of a REQUEST's deadline. It is the system's, not
/// the process's, so the worker reads the same one (Python's `time.monotonic()` on Linux),
/// and unlike the wall clock it does not jump.
pub fn monotonic_micros() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    // CLOCK_MONOTONIC always exists on Linux, so it cannot fail (and 0 would only make a
    // deadline look passed).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64) * 1_000_000 + (now.tv_nsec as u64) / 1_000
}

/// A deadline on the front door's clock (tokio's, which tests may pause) as a REQUEST's
/// `deadline`: what is left of it, counted from CLOCK_MONOTONIC's now. One already passed
/// is now, which the worker also takes for passed.
pub fn deadline_micros(deadline: tokio::time::Instant) -> u64 {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    monotonic_micros().saturating_add(u64::try_from(left.as_micros()).unwrap_or(u64::MAX))
}

/// The REREGISTER message: "I do not know you, send READY again".
pub fn encode_reregister() -> Vec<u8> {
    #[derive(Serialize)]
    struct Who {
        v: i64,
        k: &'static str,
    }
    rmp_serde::to_vec_named(&Who {
        v: PROTOCOL_VERSION,
        k: "who",
    })
    .unwrap_or_default()
}

/// A DT_STRING tensor's frame: one msgpack array of byte strings.
// The front door builds its frames with encode_strings_iter; tests build them from lists.
#[cfg_attr(not(test), allow(dead_code))]
pub fn encode_strings<S: AsRef<[u8]>>(values: &[S]) -> Vec<u8> {
    let payload: usize = values.iter().map(|v| v.as_ref().len() + 5).sum();
    encode_strings_iter(
        values.len() as u32,
        values.iter().map(AsRef::as_ref),
        payload + 5,
    )
}

/// A DT_STRING frame of `count` values from their encoded bytes (`StringValues::checked_values`
/// of other frames), each of `bodies` written its number of times.
pub fn encode_string_bodies(count: u32, bodies: &[(&[u8], usize)]) -> Vec<u8> {
    let bytes = bodies.iter().fold(0usize, |sum, (body, times)| {
        sum.saturating_add(body.len().saturating_mul(*times))
    });
    let mut out = Vec::with_capacity(bytes.saturating_add(5));
    // Writes into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut out, count);
    for (body, times) in bodies {
        for _ in 0..*times {
            out.extend_from_slice(body);
        }
    }
    out
}

/// The same frame from `count` values yielded one by one into a buffer of `capacity` bytes:
/// the codec repeats a request's last value to fill a shape without listing it n times.
pub fn encode_strings_iter<'a>(
    count: u32,
    values: impl IntoIterator<Item = &'a [u8]>,
    capacity: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    // Writes into a Vec cannot fail; lengths above u32 cannot reach here (2 GiB limit).
    let _ = rmp::encode::write_array_len(&mut out, count);
    for value in values {
        let _ = rmp::encode::write_bin(&mut out, value);
    }
    out
}

/// The byte strings of a DT_STRING frame (msgpack str or bin elements, as Python sends either).
pub fn decode_strings(frame: &Bytes) -> Result<Vec<Bytes>, ProtocolError> {
    let mut values = StringValues::of(frame)?;
    let mut decoded = Vec::with_capacity(values.len());
    for value in values.by_ref() {
        decoded.push(frame.slice_ref(value?));
    }
    values.finish()?;
    Ok(decoded)
}

/// The values of a DT_STRING frame one by one, each a slice of it, as they are asked for: no
/// list of them (which takes 32 bytes a value, where an empty one takes 1 byte of frame).
#[derive(Clone, Debug)]
pub struct StringValues<'a> {
    rest: &'a [u8],
    left: u32,
}

fn string_frame_error(what: &str) -> ProtocolError {
    ProtocolError::StringFrame(what.to_string())
}

impl<'a> StringValues<'a> {
    /// The values of `frame`: its array's header read, its values not yet.
    pub fn of(frame: &'a [u8]) -> Result<Self, ProtocolError> {
        let mut rest = frame;
        let count = rmp::decode::read_array_len(&mut rest)
            .map_err(|e| string_frame_error(&e.to_string()))?;
        // Each takes at least one byte: a count beyond the frame is a lie, not an allocation.
        if count as usize > rest.len() {
            return Err(string_frame_error(&format!(
                "{count} elements in {} bytes",
                rest.len()
            )));
        }
        Ok(Self { rest, left: count })
    }

    /// How many values are left to read.
    pub fn len(&self) -> usize {
        self.left as usize
    }

    /// The bytes of the values left, as they are encoded, once each is checked to be whole and
    /// nothing follows the last: what frames are joined or repeated from without a list of
    /// their values (`split::concat`, `batch::merge`).
    pub fn checked_values(&self) -> Result<&'a [u8], ProtocolError> {
        let mut walk = self.clone();
        for value in walk.by_ref() {
            value?;
        }
        walk.finish()?;
        Ok(self.rest)
    }

    /// An error when bytes follow the last value (all read).
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(string_frame_error(&format!(
                "{} bytes after the array",
                self.rest.len()
            )))
        }
    }

    fn read(&mut self) -> Result<&'a [u8], ProtocolError> {
        let marker = rmp::decode::read_marker(&mut self.rest)
            .map_err(|_| string_frame_error("truncated"))?;
        let len = match marker {
            rmp::Marker::FixStr(n) => n as usize,
            rmp::Marker::Str8 | rmp::Marker::Bin8 => read_len(&mut self.rest, 1)?,
            rmp::Marker::Str16 | rmp::Marker::Bin16 => read_len(&mut self.rest, 2)?,
            rmp::Marker::Str32 | rmp::Marker::Bin32 => read_len(&mut self.rest, 4)?,
            other => return Err(string_frame_error(&format!("element of type {other:?}"))),
        };
        if len > self.rest.len() {
            return Err(string_frame_error("truncated"));
        }
        let (value, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(value)
    }
}

impl<'a> Iterator for StringValues<'a> {
    type Item = Result<&'a [u8], ProtocolError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let value = self.read();
        if value.is_err() {
            self.left = 0; // nothing after a bad value can be read
        }
        Some(value)
    }
}

fn read_len(cursor: &mut &[u8], width: usize) -> Result<usize, ProtocolError> {
    if cursor.len() < width {
        return Err(ProtocolError::StringFrame("truncated".to_string()));
    }
    let (head, rest) = cursor.split_at(width);
    *cursor = rest;
    Ok(head.iter().fold(0usize, |n, b| (n << 8) | *b as usize))
}

/// A control-channel message (`{"v": 1, "op": ..., "n": ..., ...}`) as a msgpack map.
pub fn decode_control(frame: &[u8]) -> Result<Vec<(String, rmpv::Value)>, ProtocolError> {
    let value: rmpv::Value = rmp_serde::from_slice(frame)?;
    let rmpv::Value::Map(entries) = value else {
        return Err(ProtocolError::Version(-1));
    };
    let fields: Vec<(String, rmpv::Value)> = entries
        .into_iter()
        .filter_map(|(k, v)| k.as_str().map(|k| (k.to_string(), v)))
        .collect();
    match fields
        .iter()
        .find(|(k, _)| k == "v")
        .and_then(|(_, v)| v.as_i64())
    {
        Some(PROTOCOL_VERSION) => Ok(fields),
        Some(other) => Err(ProtocolError::Version(other)),
        None => Err(ProtocolError::Version(-1)),
    }
}

/// A control-channel reply: `{"v": 1, **fields}`.
pub fn encode_control(fields: Vec<(&str, rmpv::Value)>) -> Vec<u8> {
    let mut entries = vec![(rmpv::Value::from("v"), rmpv::Value::from(PROTOCOL_VERSION))];
    entries.extend(fields.into_iter().map(|(k, v)| (rmpv::Value::from(k), v)));
    let mut out = Vec::new();
    // Writing a Value into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &rmpv::Value::Map(entries));
    out
}

/// Hex text → bytes: the shared test vectors store bytes as hex.
#[cfg(test)]
pub fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// tests/vectors/wire.json, written from mpspool/wire.py (tests/vectors/make_vectors.py).
    #[test]
    fn shared_vectors_match_the_python_side() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/vectors/wire.json");
        let vectors: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        // One without a deadline, one with.
        let requests = vectors["requests"].as_array().unwrap();
        assert_eq!(requests.len(), 2);
        for request in requests {
            let fields = &request["fields"];
            let tensors: Vec<TensorMeta> =
                serde_json::from_value(fields["tensors"].clone()).unwrap();
            let outputs: Vec<String> = serde_json::from_value(fields["outputs"].clone()).unwrap();
            let encoded = encode_request(
                fields["id"].as_u64().unwrap(),
                fields["sig"].as_str().unwrap(),
                &tensors,
                &outputs,
                fields.get("deadline").and_then(|d| d.as_u64()),
            );
            assert_eq!(encoded, unhex(request["bytes"].as_str().unwrap()));
        }
        assert_eq!(
            encode_reregister(),
            unhex(vectors["reregister"].as_str().unwrap())
        );
        for case in vectors["worker"].as_array().unwrap() {
            let message = decode_worker_header(&unhex(case["bytes"].as_str().unwrap())).unwrap();
            let kind = match message {
                WorkerMessage::Ready {
                    ref slot,
                    ref warmup,
                    ref load,
                    ..
                } => {
                    // The third READY says its warm-up and its load, the others neither.
                    let want =
                        (slot == "cpu-2").then(|| ("/models/demo/3".to_string(), 250_000, 2));
                    assert_eq!(*warmup, want);
                    let want = (slot == "cpu-2").then(|| ("/models/demo/3".to_string(), 1_750_000));
                    assert_eq!(*load, want);
                    "ready"
                }
                WorkerMessage::Heartbeat {
                    served,
                    ref weights,
                    ..
                } => {
                    // The second heartbeat carries weights, the first none.
                    let copied = weights
                        .as_ref()
                        .and_then(|w| w.as_map())
                        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("copied")))
                        .map(|(_, v)| v.clone());
                    let want = (served == 13).then(|| {
                        rmpv::Value::Map(vec![(
                            rmpv::Value::from("table:0"),
                            rmpv::Value::from(256),
                        )])
                    });
                    assert_eq!(copied, want, "served {served}");
                    "hb"
                }
                WorkerMessage::Reply { id, ref t, .. } => {
                    assert_eq!(id, 1 << 40);
                    assert_eq!(*t, Some((1_700_000_000_000_000, 1_700_000_000_000_250)));
                    "reply"
                }
                WorkerMessage::Error { code, .. } => {
                    assert_eq!(code, 3);
                    "error"
                }
                WorkerMessage::Bye { .. } => "bye",
            };
            assert_eq!(kind, case["kind"].as_str().unwrap());
        }
        let strings = &vectors["strings"];
        let values: Vec<Vec<u8>> = strings["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| unhex(v.as_str().unwrap()))
            .collect();
        let frame = unhex(strings["bytes"].as_str().unwrap());
        assert_eq!(encode_strings(&values), frame);
        let decoded = decode_strings(&Bytes::from(frame)).unwrap();
        assert_eq!(
            decoded.iter().map(|v| v.to_vec()).collect::<Vec<_>>(),
            values
        );
    }

    #[tokio::test]
    async fn deadlines_are_counted_on_the_monotonic_clock() {
        let before = monotonic_micros();
        let ahead = deadline_micros(tokio::time::Instant::now() + Duration::from_secs(2));
        let after = monotonic_micros();
        // Both clocks are read in whole µs, so what is left of 2 s may read 1 µs short.
        assert!(ahead + 1 >= before + 2_000_000 && ahead <= after + 2_000_000);
        // Passed: now, which the worker takes for passed too.
        let passed = deadline_micros(tokio::time::Instant::now() - Duration::from_millis(5));
        assert!(passed >= after && passed <= monotonic_micros());
    }

    #[test]
    fn strings_round_trip() {
        let values: Vec<&[u8]> = vec![b"", b"a", &[0u8; 300], &[7u8; 70_000]];
        let frame = Bytes::from(encode_strings(&values));
        let back = decode_strings(&frame).unwrap();
        assert_eq!(back.len(), 4);
        for (a, b) in values.iter().zip(back.iter()) {
            assert_eq!(*a, &b[..]);
        }
    }

    #[test]
    fn string_frames_that_lie_are_refused() {
        // An array header claiming 2^32-1 elements in a 5-byte frame.
        let frame = Bytes::from_static(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(decode_strings(&frame).is_err());
        let frame = Bytes::from_static(&[0x91, 0xc4, 0x05, b'a']);
        assert!(decode_strings(&frame).is_err());
        let frame = Bytes::from_static(&[0x91, 0x01]);
        assert!(decode_strings(&frame).is_err());
    }

    #[test]
    fn worker_headers_decode_by_kind() {
        let header = rmp_serde::to_vec_named(&serde_json::json!({
            "v": 1, "k": "error", "id": 7, "code": 3, "message": "bad"
        }))
        .unwrap();
        assert_eq!(
            decode_worker_header(&header).unwrap(),
            WorkerMessage::Error {
                id: 7,
                code: 3,
                message: "bad".into()
            }
        );
        let header = rmp_serde::to_vec_named(
            &serde_json::json!({"v": 2, "k": "bye", "slot": "cpu-0", "pid": 1}),
        )
        .unwrap();
        assert!(matches!(
            decode_worker_header(&header),
            Err(ProtocolError::Version(2))
        ));
        assert!(decode_worker_header(b"\xc1").is_err());
    }
}
