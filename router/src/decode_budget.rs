//! What decoding a gRPC request would take in memory, read off its wire bytes before prost
//! builds it, and the codec that refuses a request over the budget.
//!
//! prost gives every element of a repeated field a value of its own: an empty string in
//! `string_val` is 2 bytes on the wire and a 32-byte `Bytes` in memory, an empty dimension 2
//! bytes and a 32-byte `Dim`, a map entry of a few bytes a whole `TensorProto` (hundreds of
//! bytes), a 1-byte varint in `int64_val` 8 bytes; a vector may have room for twice what it
//! holds. A request at the message limit could take the front door tens of GB. So one pass
//! over the bytes, with the request types' shapes (which fields are messages, which repeat
//! and what each element costs), sums what the elements would take, and a request over the
//! budget (`parse_budget::budget_bytes`, the rule REST's JSON bodies follow) is refused with
//! RESOURCE_EXHAUSTED before anything is built. Fields a shape does not name are skipped by
//! prost too and cost nothing; bytes fields (`tensor_content`, examples) are slices of the
//! received message, not copies.

use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Buf, Bytes};
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::proto::mpspool::tfs::{
    tensor_shape_proto::Dim, GetModelMetadataRequest, GetModelStatusRequest, PredictRequest,
    TensorProto,
};
use crate::proto::tensorflow::serving::{
    ClassificationRequest, InferenceTask, MultiInferenceRequest, RegressionRequest,
    ReloadConfigRequest,
};

/// A vector grows by doubling: right after it grew, it has room for twice what it holds.
const GROWTH: usize = 2;

/// How a field of a message costs memory when decoded.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// A message: its own fields are walked; each occurrence adds a value of this many bytes
    /// (an element of a repeated or map field; 0 for a field that does not repeat).
    Message(&'static [Field], usize),
    /// Each occurrence is an element of this many bytes (a repeated string or bytes field).
    Element(usize),
    /// Repeated scalars of `size` bytes, each at least `wire` bytes when packed (1 for a
    /// varint); prost also takes them one by one, unpacked.
    Scalars { size: usize, wire: usize },
}

/// A field's number and how it costs memory.
pub type Field = (u32, Kind);

const DIM: &[Field] = &[];
const SHAPE: &[Field] = &[(2, Kind::Message(DIM, size_of::<Dim>()))];
const VARINT_32: Kind = Kind::Scalars { size: 4, wire: 1 };
const VARINT_64: Kind = Kind::Scalars { size: 8, wire: 1 };
const TENSOR: &[Field] = &[
    (2, Kind::Message(SHAPE, 0)),
    (5, Kind::Scalars { size: 4, wire: 4 }),  // float_val
    (6, Kind::Scalars { size: 8, wire: 8 }),  // double_val
    (7, VARINT_32),                           // int_val
    (8, Kind::Element(size_of::<Bytes>())),   // string_val
    (9, Kind::Scalars { size: 4, wire: 4 }),  // scomplex_val
    (10, VARINT_64),                          // int64_val
    (11, Kind::Scalars { size: 1, wire: 1 }), // bool_val
    (12, Kind::Scalars { size: 8, wire: 8 }), // dcomplex_val
    (13, VARINT_32),                          // half_val
    (16, VARINT_32),                          // uint32_val
    (17, VARINT_64),                          // uint64_val
];
/// A map entry's value; the entry itself is a slot of the map.
const INPUT_ENTRY: &[Field] = &[(2, Kind::Message(TENSOR, 0))];
/// A map slot: the key and value, and the hash table's control byte and spare room.
const INPUT_SLOT: usize = size_of::<(String, TensorProto)>() + 8;
const STRINGS: Kind = Kind::Element(size_of::<String>());
const PREDICT: &[Field] = &[(2, Kind::Message(INPUT_ENTRY, INPUT_SLOT)), (3, STRINGS)];
const EXAMPLES: &[Field] = &[(1, Kind::Element(size_of::<Bytes>()))];
const INPUT: &[Field] = &[
    (1, Kind::Message(EXAMPLES, 0)),
    (2, Kind::Message(EXAMPLES, 0)),
];
const EXAMPLES_REQUEST: &[Field] = &[(2, Kind::Message(INPUT, 0))];
const MULTI_INFERENCE: &[Field] = &[
    (1, Kind::Message(&[], size_of::<InferenceTask>())),
    (2, Kind::Message(INPUT, 0)),
];

/// A request type's shape, for `cost`.
pub trait DecodeCost {
    const FIELDS: &'static [Field];
}

impl DecodeCost for PredictRequest {
    const FIELDS: &'static [Field] = PREDICT;
}
impl DecodeCost for ClassificationRequest {
    const FIELDS: &'static [Field] = EXAMPLES_REQUEST;
}
impl DecodeCost for RegressionRequest {
    const FIELDS: &'static [Field] = EXAMPLES_REQUEST;
}
impl DecodeCost for MultiInferenceRequest {
    const FIELDS: &'static [Field] = MULTI_INFERENCE;
}
impl DecodeCost for GetModelMetadataRequest {
    const FIELDS: &'static [Field] = &[(2, STRINGS)];
}
impl DecodeCost for GetModelStatusRequest {
    const FIELDS: &'static [Field] = &[];
}
impl DecodeCost for ReloadConfigRequest {
    const FIELDS: &'static [Field] = &[(2, STRINGS)];
}

/// What decoding a message of these `fields` from `wire` would allocate, roughly: the
/// message's own bytes (strings are copied) and every element's.
pub fn cost(wire: &[u8], fields: &[Field]) -> usize {
    wire.len().saturating_add(elements_cost(wire, fields))
}

/// The elements' share of `cost`. Malformed bytes end the walk: prost refuses them, with
/// its own message.
fn elements_cost(mut wire: &[u8], fields: &[Field]) -> usize {
    let mut cost = 0usize;
    while let Some((key, rest)) = varint(wire) {
        let kind = fields
            .iter()
            .find(|(number, _)| u64::from(*number) == key >> 3)
            .map(|(_, kind)| *kind);
        let (payload, rest) = match key & 7 {
            0 => match varint(rest) {
                Some((_, rest)) => (None, rest),
                None => break,
            },
            1 if rest.len() >= 8 => (None, &rest[8..]),
            5 if rest.len() >= 4 => (None, &rest[4..]),
            2 => match varint(rest).and_then(|(len, rest)| {
                let len = usize::try_from(len).ok().filter(|&len| len <= rest.len())?;
                Some(rest.split_at(len))
            }) {
                Some((payload, rest)) => (Some(payload), rest),
                None => break,
            },
            _ => break, // groups, truncated fixed-size values, wire types that do not exist
        };
        wire = rest;
        let added = match (kind, payload) {
            (None, _) => 0,
            (Some(Kind::Message(inner, size)), Some(payload)) => GROWTH
                .saturating_mul(size)
                .saturating_add(elements_cost(payload, inner)),
            (Some(Kind::Element(size)), Some(_)) => GROWTH.saturating_mul(size),
            (Some(Kind::Scalars { size, wire }), Some(packed)) => GROWTH
                .saturating_mul(packed.len() / wire.max(1))
                .saturating_mul(size),
            (Some(Kind::Scalars { size, .. }), None) => GROWTH.saturating_mul(size),
            // A message or bytes field sent as a scalar: prost refuses it.
            (Some(_), None) => 0,
        };
        cost = cost.saturating_add(added);
    }
    cost
}

/// A base-128 varint at the start of `bytes`, and what follows it.
fn varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

/// The budget in bytes, set once at start from the message limit (0 until then: the
/// budget's floor applies).
static BUDGET_BYTES: AtomicUsize = AtomicUsize::new(0);

pub fn set_budget(bytes: usize) {
    BUDGET_BYTES.store(bytes, Ordering::Relaxed);
}

fn budget() -> usize {
    match BUDGET_BYTES.load(Ordering::Relaxed) {
        0 => crate::parse_budget::BUDGET_MIN,
        bytes => bytes,
    }
}

/// RESOURCE_EXHAUSTED when decoding `wire` as a message of `fields` would take more than
/// `budget` bytes.
pub fn check(wire: &[u8], fields: &[Field], budget: usize) -> Result<(), Status> {
    let cost = cost(wire, fields);
    if cost <= budget {
        return Ok(());
    }
    Err(Status::resource_exhausted(format!(
        "decoding this request ({} bytes) would take about {} MiB of memory, more than the \
         {} MiB allowed (4 times --max-message-bytes, at least 256): it has too many values \
         or entries for its size; send fewer per request",
        wire.len(),
        cost >> 20,
        budget >> 20
    )))
}

/// prost's codec, with each request checked against the decode budget first.
pub struct BudgetedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for BudgetedCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for BudgetedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + DecodeCost + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BudgetedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        BudgetedDecoder(ProstCodec::<T, U>::raw_decoder(BufferSettings::default()))
    }
}

pub struct BudgetedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + DecodeCost> Decoder for BudgetedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // tonic gathers a whole message in one buffer: its first chunk is all of it.
        let wire = buf.chunk();
        let wire = &wire[..wire.len().min(buf.remaining())];
        check(wire, U::FIELDS, budget())?;
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::mpspool::tfs::TensorShapeProto;

    fn predict(tensor: TensorProto) -> Vec<u8> {
        PredictRequest {
            inputs: [("x".to_string(), tensor)].into_iter().collect(),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn empty_repeated_entries_cost_their_values_not_their_bytes() {
        let strings = predict(TensorProto {
            string_val: vec![Bytes::new(); 10_000],
            ..Default::default()
        });
        let dims = predict(TensorProto {
            tensor_shape: Some(TensorShapeProto {
                dim: vec![Dim::default(); 10_000],
                ..Default::default()
            }),
            ..Default::default()
        });
        for (what, wire, element) in [
            ("strings", strings, size_of::<Bytes>()),
            ("dims", dims, size_of::<Dim>()),
        ] {
            let cost = cost(&wire, PREDICT);
            assert!(wire.len() < 25_000, "{what}: {}", wire.len());
            assert!(cost >= 10_000 * element, "{what}: {cost}");
            assert!(
                cost <= wire.len() + 2 * 10_000 * element + 2_000,
                "{what}: {cost}"
            );
        }
    }

    #[test]
    fn packed_and_unpacked_scalars_cost_their_decoded_size() {
        let ids: Vec<i64> = vec![1; 10_000];
        let packed = predict(TensorProto {
            int64_val: ids,
            ..Default::default()
        });
        assert!(cost(&packed, PREDICT) >= 8 * 10_000);
        // The same values one field each (older encoders): 2 bytes on the wire, 8 decoded.
        let mut tensor = Vec::new();
        for _ in 0..10_000 {
            tensor.extend_from_slice(&[10 << 3, 1]);
        }
        let mut entry = vec![2 << 3 | 2];
        prost::encoding::encode_varint(tensor.len() as u64, &mut entry);
        entry.extend_from_slice(&tensor);
        let mut unpacked = vec![2 << 3 | 2];
        prost::encoding::encode_varint(entry.len() as u64, &mut unpacked);
        unpacked.extend_from_slice(&entry);
        let decoded = PredictRequest::decode(unpacked.as_slice()).unwrap();
        assert_eq!(
            decoded.inputs[""].int64_val.len(),
            10_000,
            "prost takes them unpacked"
        );
        assert!(cost(&unpacked, PREDICT) >= 8 * 10_000);
    }

    #[test]
    fn a_plain_batch_costs_about_its_size() {
        let wire = predict(TensorProto {
            tensor_content: Bytes::from(vec![7u8; 1 << 20]),
            float_val: vec![1.0; 1000],
            ..Default::default()
        });
        assert!(
            cost(&wire, PREDICT) < 2 * wire.len() + 2_000,
            "{}",
            cost(&wire, PREDICT)
        );
    }

    #[test]
    fn a_request_over_the_budget_is_refused_with_resource_exhausted() {
        let wire = predict(TensorProto {
            string_val: vec![Bytes::new(); 100_000],
            ..Default::default()
        });
        let error = check(&wire, PREDICT, 1 << 20).unwrap_err();
        assert_eq!(error.code(), tonic::Code::ResourceExhausted);
        assert!(
            error.message().contains("more than the 1 MiB allowed"),
            "{}",
            error.message()
        );
        assert!(check(&wire, PREDICT, 64 << 20).is_ok());
    }

    #[test]
    fn malformed_bytes_end_the_walk_for_prost_to_refuse() {
        for wire in [
            &[0xff_u8; 11][..],
            &[2 << 3 | 2, 0xff, 0x01],
            &[3 << 3 | 3],
            &[1 << 3 | 1, 0],
        ] {
            assert_eq!(cost(wire, PREDICT), wire.len());
        }
    }
}
