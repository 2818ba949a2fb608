//! What decoding a gRPC request would take in memory, read off its wire bytes before prost
//! builds it, and the codec that refuses a request over the budget.
//!
//! prost gives every element of a repeated field a value of its own: an empty string in
//! `string_val` is 2 bytes on the wire and a 32-byte `Bytes` in memory, an empty dimension 2
//! bytes and a 32-byte `Dim`, a map entry of a few bytes a whole `TensorProto` (hundreds of
//! bytes), a 1-byte varint in `int64_val` 8 bytes; a vector may have room for twice what it
//! holds. A request at the message limit could take the front door tens of GB. So one pass
//! over the bytes, with the request types' shapes (which fields are messages, which repeat
//! and what each element costs), sums what the elements would take. A request whose cost is
//! over the front door's request budget (`request_budget`), or over what the requests being
//! served leave of it, is refused with RESOURCE_EXHAUSTED before anything is built; one that
//! fits holds its cost of the budget until it is answered. Fields a shape does not name are
//! skipped by prost too and cost nothing; bytes fields (`tensor_content`, examples) are
//! slices of the received message, not copies.

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::{Arc, OnceLock};

use bytes::{Buf, Bytes};
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::request_budget::{self, Held, RequestBudget};

use crate::proto::mpspool::tfs::{
    tensor_shape_proto::Dim, GetModelMetadataRequest, GetModelStatusRequest, PredictRequest,
    TensorProto,
};
use crate::proto::tensorflow::serving::{
    input, ClassificationRequest, InferenceTask, Input, MultiInferenceRequest, RegressionRequest,
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

/// prost's limit on nested messages and groups.
const RECURSION_LIMIT: u32 = 100;

/// What decoding a message of these `fields` from `wire` would allocate, roughly: the
/// message's own bytes (strings are copied) and every element's. Err (why) for bytes prost
/// refuses too; the walk reads everything prost reads (unknown groups included), so nothing
/// prost would build goes uncounted.
pub fn cost(wire: &[u8], fields: &[Field]) -> Result<usize, &'static str> {
    Ok(wire.len().saturating_add(elements_cost(wire, fields, 0)?))
}

/// The elements' share of `cost`.
fn elements_cost(mut wire: &[u8], fields: &[Field], depth: u32) -> Result<usize, &'static str> {
    let mut cost = 0usize;
    while !wire.is_empty() {
        let (number, value, rest) = next_field(wire, depth)?;
        wire = rest;
        let kind = fields
            .iter()
            .find(|(known, _)| u64::from(*known) == number)
            .map(|(_, kind)| *kind);
        let added = match (kind, value) {
            (None, _) => 0,
            (Some(Kind::Message(inner, size)), Value::Delimited(payload)) => GROWTH
                .saturating_mul(size)
                .saturating_add(elements_cost(payload, inner, depth + 1)?),
            (Some(Kind::Element(size)), Value::Delimited(_)) => GROWTH.saturating_mul(size),
            (Some(Kind::Scalars { size, wire }), Value::Delimited(packed)) => {
                // A packed varint's last byte is the one under 0x80: one element each.
                let count = if wire == 1 {
                    packed.iter().filter(|&&byte| byte < 0x80).count()
                } else {
                    packed.len() / wire
                };
                GROWTH.saturating_mul(count).saturating_mul(size)
            }
            (Some(Kind::Scalars { size, .. }), Value::Scalar) => GROWTH.saturating_mul(size),
            // A field of the wrong wire type: prost refuses it.
            (Some(_), _) => 0,
        };
        cost = cost.saturating_add(added);
    }
    Ok(cost)
}

/// A field's value as it lies on the wire.
enum Value<'a> {
    Scalar,
    Delimited(&'a [u8]),
    /// A group (a deprecated encoding no field here has): skipped, as prost skips it.
    Group,
}

/// The field at the start of `wire`: its number, its value, and what follows it; Err for
/// what prost refuses too.
fn next_field(wire: &[u8], depth: u32) -> Result<(u64, Value<'_>, &[u8]), &'static str> {
    let (key, rest) = varint(wire).ok_or("invalid varint")?;
    let number = key >> 3;
    if number == 0 {
        return Err("invalid tag value: 0");
    }
    let underflow = "buffer underflow";
    match key & 7 {
        0 => varint(rest)
            .map(|(_, rest)| (number, Value::Scalar, rest))
            .ok_or("invalid varint"),
        1 => rest
            .get(8..)
            .map(|rest| (number, Value::Scalar, rest))
            .ok_or(underflow),
        5 => rest
            .get(4..)
            .map(|rest| (number, Value::Scalar, rest))
            .ok_or(underflow),
        2 => {
            let (len, rest) = varint(rest).ok_or("invalid varint")?;
            let len = usize::try_from(len)
                .ok()
                .filter(|&len| len <= rest.len())
                .ok_or(underflow)?;
            let (payload, rest) = rest.split_at(len);
            Ok((number, Value::Delimited(payload), rest))
        }
        3 => Ok((number, Value::Group, skip_group(rest, number, depth + 1)?)),
        4 => Err("unexpected end group tag"),
        _ => Err("invalid wire type"),
    }
}

/// What follows the group `number` that `wire` is inside (prost's `skip_field`).
fn skip_group(mut wire: &[u8], number: u64, depth: u32) -> Result<&[u8], &'static str> {
    if depth >= RECURSION_LIMIT {
        return Err("recursion limit reached");
    }
    loop {
        let (key, rest) = varint(wire).ok_or("invalid varint")?;
        if key & 7 == 4 {
            return if key >> 3 == number {
                Ok(rest)
            } else {
                Err("unexpected end group tag")
            };
        }
        wire = next_field(wire, depth)?.2;
    }
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

/// What a built tensor holds in memory: its vectors' capacity (what they took, not what they
/// hold) and its strings; what REST keeps of its budget share until the answer.
pub fn tensor_memory(tensor: &TensorProto) -> usize {
    fn room<T>(values: &Vec<T>) -> usize {
        values.capacity().saturating_mul(size_of::<T>())
    }
    let strings = tensor
        .string_val
        .iter()
        .fold(room(&tensor.string_val), |sum, s| {
            sum.saturating_add(s.len())
        });
    [
        size_of::<TensorProto>(),
        tensor.tensor_content.len(),
        strings,
        room(&tensor.half_val),
        room(&tensor.float_val),
        room(&tensor.double_val),
        room(&tensor.int_val),
        room(&tensor.scomplex_val),
        room(&tensor.int64_val),
        room(&tensor.bool_val),
        room(&tensor.dcomplex_val),
        room(&tensor.uint32_val),
        room(&tensor.uint64_val),
    ]
    .into_iter()
    .fold(0, usize::saturating_add)
}

/// What a built Classify/Regress input holds: its serialized examples (and context).
pub fn input_memory(input: &Input) -> usize {
    let examples = |examples: &[Bytes]| {
        examples.iter().fold(
            examples.len().saturating_mul(size_of::<Bytes>()),
            |sum, example| sum.saturating_add(example.len()),
        )
    };
    match &input.kind {
        Some(input::Kind::ExampleList(list)) => examples(&list.examples),
        // The context once, and once more in front of each example (serialized_examples).
        Some(input::Kind::ExampleListWithContext(list)) => examples(&list.examples)
            .saturating_add(list.context.len())
            .saturating_add(
                crate::inference::merged_size(&list.context, &list.examples)
                    .try_into()
                    .unwrap_or(usize::MAX),
            ),
        None => 0,
    }
}

/// The front door's request budget, installed once at start (`install`); the codecs tonic
/// makes per call (by `Default`) have no other way to reach it. Until then (unit tests of
/// other modules), a budget of the floor's size.
static BUDGET: OnceLock<Arc<RequestBudget>> = OnceLock::new();

/// Makes `budget` the one every gRPC request's decoding reserves from, and returns the one
/// installed: a second call (there is none) would leave the first in place. What a gRPC body
/// reserves while it arrives must come from the returned one, since its share is merged
/// with the decoder's (tokio panics on merging shares of two semaphores).
pub fn install(budget: Arc<RequestBudget>) -> Arc<RequestBudget> {
    if BUDGET.set(budget).is_err() {
        crate::log_warn!("the gRPC decode budget was installed twice; the first one stays");
    }
    installed().clone()
}

/// The budget gRPC requests (and their answers) are held to.
pub fn budget() -> &'static RequestBudget {
    installed()
}

fn installed() -> &'static Arc<RequestBudget> {
    BUDGET.get_or_init(|| Arc::new(RequestBudget::new(request_budget::BUDGET_MIN)))
}

tokio::task_local! {
    /// What the request being served holds of the budget: its decoded message's share, put
    /// here by its decoder and given back when the request's future ends (answered, failed or
    /// dropped with its client). tonic decodes a unary request inside the same future that
    /// calls its handler and then makes its answer, so the share lives as long as the decoded
    /// request can.
    static HELD: RefCell<Option<Held>>;
}

tokio::task_local! {
    /// The share a whole message's bytes held while they arrived (request_body), handed to
    /// its decoding: the decoded cost counts those bytes too, so the decoder tops the share
    /// up rather than reserving it all again. Handed over in the same poll as the decoding,
    /// so no other request can take it in between.
    static GATHERED: RefCell<Option<Held>>;
}

/// `request` (a gRPC call's future), holding the budget's shares its decoding reserves until
/// it ends. Every connection's service wraps its calls in this.
pub fn holding_request_memory<F: Future>(request: F) -> impl Future<Output = F::Output> {
    HELD.scope(
        RefCell::new(None),
        GATHERED.scope(RefCell::new(None), request),
    )
}

/// `call` (a REST request's API call) with `held`, its parsed body's share, as the share of
/// the request being served, so that it goes with the request's work as a gRPC request's does
/// (`request_budget::KeptShare`); the share back when the call ends, if its work gave it back.
pub async fn serving_with<F: Future>(held: Held, call: F) -> (F::Output, Option<Held>) {
    let call = async {
        let output = call.await;
        (output, take_request_share())
    };
    HELD.scope(RefCell::new(Some(held)), call).await
}

/// Hands the share of a message that has just arrived whole to its decoding (`GATHERED`);
/// outside a request's scope it is given back.
pub fn hand_over_gathered(held: Held) {
    let _ = GATHERED.try_with(|gathered| match &mut *gathered.borrow_mut() {
        Some(earlier) => earlier.merge(held),
        slot @ None => *slot = Some(held),
    });
}

/// The share the request being served holds for its decoded form, taken from it (its answer
/// takes it over: `answer_body::hold_answer`); None outside a request or when it holds none.
pub fn take_request_share() -> Option<Held> {
    HELD.try_with(|share| share.borrow_mut().take())
        .ok()
        .flatten()
}

/// Puts `held` back as the share of the request being served (taken by
/// `take_request_share` while its work was at a worker); outside a request it is given back.
pub fn give_back_request_share(held: Option<Held>) {
    let _ = HELD.try_with(|share| *share.borrow_mut() = held);
}

/// What the request being served holds of the budget now (its decoded form); 0 outside a
/// request or when it holds none.
pub fn request_share_bytes() -> usize {
    HELD.try_with(|share| request_budget::share_bytes(share.borrow().as_ref()))
        .unwrap_or(0)
}

fn take_gathered() -> Option<Held> {
    GATHERED
        .try_with(|gathered| gathered.borrow_mut().take())
        .ok()
        .flatten()
}

/// Keeps `held` until the request being served ends; outside `holding_request_memory` (no
/// such caller) it is given back at once. The first message's only: a unary call that sends
/// more has them decoded and dropped by tonic (while it reads the call's end), so their
/// shares go back at once.
fn hold_while_serving(held: Held) {
    let _ = HELD.try_with(|share| {
        share.borrow_mut().get_or_insert(held);
    });
}

/// A gRPC request whose decoded form is smaller than this is not counted against the budget:
/// decoding cannot wait for room as a REST body does, and a small call (a health, status or
/// metadata call, a batch-1 Predict) should not be refused because large requests or a
/// waiting REST body hold the budget. Each is small, and their number is bounded by
/// connections and streams.
pub const UNCOUNTED_BYTES: usize = 64 << 10;

/// RESOURCE_EXHAUSTED when decoding `wire` as a message of `fields` would take more than the
/// whole budget, or more than it has free now (others hold it) beside `carried` (what its
/// bytes held while they arrived); for bytes prost would refuse, its code and words
/// (INTERNAL, "failed to decode Protobuf message"). Otherwise the share, to hold while the
/// decoded message lives (None for a request under UNCOUNTED_BYTES).
pub fn admit(
    wire: &[u8],
    fields: &[Field],
    budget: &RequestBudget,
    carried: Option<Held>,
) -> Result<Option<Held>, Status> {
    let cost = cost(wire, fields)
        .map_err(|why| Status::internal(format!("failed to decode Protobuf message: {why}")))?;
    if cost > budget.bytes() {
        return Err(Status::resource_exhausted(format!(
            "decoding this request ({} bytes) would take about {} MiB of memory, more than the \
             {} MiB allowed (4 times --max-message-bytes, at least 256): it has too many values \
             or entries for its size; send fewer per request",
            wire.len(),
            cost >> 20,
            budget.bytes() >> 20
        )));
    }
    if cost < UNCOUNTED_BYTES {
        return Ok(None);
    }
    // Waiting is not an option here (decoding is synchronous), so a request that finds too
    // little free is refused, as a full queue refuses one, and may be sent again.
    request_budget::resize(carried, cost, budget)
        .map(Some)
        .ok_or_else(|| {
            Status::resource_exhausted(format!(
                "requests being served (or a REST body waiting) hold {} MiB of the front door's \
             memory, and decoding this one ({} bytes, about {} MiB) would pass the {} MiB \
             allowed for all of them at once (4 times --max-message-bytes, at least 256); try \
             again later",
                budget.held_bytes() >> 20,
                wire.len(),
                cost.div_ceil(1 << 20),
                budget.bytes() >> 20
            ))
        })
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
        // tonic gathers a whole message (decompressed, if it came compressed) in one buffer:
        // its first chunk is all of it. Were it not, the walk could not see it all.
        let wire = buf.chunk();
        if wire.len() < buf.remaining() {
            return Err(Status::internal(
                "the request is not in one buffer: what decoding it would take cannot be checked",
            ));
        }
        let held = admit(wire, U::FIELDS, installed(), take_gathered())?;
        let decoded = self.0.decode(buf)?;
        if let Some(held) = held {
            hold_while_serving(held);
        }
        Ok(decoded)
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

    fn walked(wire: &[u8]) -> usize {
        cost(wire, PREDICT).unwrap()
    }

    /// The cost's bounds for `count` elements of `size` bytes: at least their values, at
    /// most twice (a vector's growth) plus the message's bytes and its map slot.
    fn assert_about(what: &str, wire: &[u8], count: usize, size: usize) {
        let cost = walked(wire);
        assert!(cost >= count * size, "{what}: {cost} < {}", count * size);
        let most = wire.len() + GROWTH * (count * size + INPUT_SLOT);
        assert!(cost <= most, "{what}: {cost} > {most}");
    }

    #[test]
    fn empty_repeated_entries_cost_their_values_not_their_bytes() {
        let strings = predict(TensorProto {
            string_val: vec![Bytes::new(); 10_000],
            ..Default::default()
        });
        assert!(strings.len() < 25_000);
        assert_about("strings", &strings, 10_000, size_of::<Bytes>());
        let dims = predict(TensorProto {
            tensor_shape: Some(TensorShapeProto {
                dim: vec![Dim::default(); 10_000],
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_about("dims", &dims, 10_000, size_of::<Dim>());
    }

    /// A PredictRequest with one unnamed input whose TensorProto is `tensor`'s bytes.
    fn predict_raw(tensor: &[u8]) -> Vec<u8> {
        let mut entry = vec![2 << 3 | 2];
        prost::encoding::encode_varint(tensor.len() as u64, &mut entry);
        entry.extend_from_slice(tensor);
        let mut wire = vec![2 << 3 | 2];
        prost::encoding::encode_varint(entry.len() as u64, &mut wire);
        wire.extend_from_slice(&entry);
        wire
    }

    #[test]
    fn scalars_cost_their_decoded_size_packed_or_not_short_or_long() {
        // 1-byte and 10-byte varints (a negative id is 10): one element each.
        for id in [1i64, -1] {
            let packed = predict(TensorProto {
                int64_val: vec![id; 10_000],
                ..Default::default()
            });
            assert_about(&format!("packed {id}"), &packed, 10_000, 8);
        }
        // The same values one field each (older encoders): 2 bytes on the wire, 8 decoded.
        let unpacked = predict_raw(&[10 << 3, 1].repeat(10_000));
        let decoded = PredictRequest::decode(unpacked.as_slice()).unwrap();
        assert_eq!(
            decoded.inputs[""].int64_val.len(),
            10_000,
            "prost takes them unpacked"
        );
        assert_about("unpacked", &unpacked, 10_000, 8);
    }

    #[test]
    fn a_plain_batch_costs_about_its_size() {
        let wire = predict(TensorProto {
            tensor_content: Bytes::from(vec![7u8; 1 << 20]),
            float_val: vec![1.0; 1000],
            ..Default::default()
        });
        assert!(walked(&wire) <= wire.len() + GROWTH * (4_000 + INPUT_SLOT));
    }

    #[test]
    fn a_group_prost_skips_hides_nothing_after_it() {
        // Field 15 opens and closes a group (prost skips unknown groups and reads on), then
        // 10,000 empty strings, at the top, in the map entry and in the tensor.
        let strings = [8 << 3 | 2, 0].repeat(10_000);
        let group = [15 << 3 | 3, 15 << 3 | 4];
        let in_tensor = predict_raw(&[&group[..], &strings].concat());
        let in_entry = {
            let mut tensor = vec![2 << 3 | 2];
            prost::encoding::encode_varint(strings.len() as u64, &mut tensor);
            let entry = [&group[..], &tensor, &strings].concat();
            let mut wire = vec![2 << 3 | 2];
            prost::encoding::encode_varint(entry.len() as u64, &mut wire);
            [wire, entry].concat()
        };
        let at_top = [&group[..], &predict_raw(&strings)].concat();
        for (what, wire) in [("tensor", in_tensor), ("entry", in_entry), ("top", at_top)] {
            let decoded = PredictRequest::decode(wire.as_slice()).unwrap();
            assert_eq!(
                decoded.inputs[""].string_val.len(),
                10_000,
                "{what}: prost read on"
            );
            assert_about(what, &wire, 10_000, size_of::<Bytes>());
        }
    }

    #[test]
    fn bytes_prost_refuses_are_refused_as_prost_would() {
        let open = [15 << 3 | 3];
        let nested = [[15 << 3 | 3].repeat(200), [15 << 3 | 4].repeat(200)].concat();
        let cases: [&[u8]; 8] = [
            &[0xff; 11],            // a varint longer than 10 bytes
            &[2 << 3 | 2, 0xff, 1], // a length past the end
            &[1 << 3 | 1, 0],       // a truncated fixed64
            &[1 << 3 | 6],          // a wire type that does not exist
            &[15 << 3 | 4],         // an end group with no start
            &open,                  // a group never closed
            &nested,                // groups past the recursion limit
            &[0, 0],                // field 0
        ];
        for wire in cases {
            assert!(
                PredictRequest::decode(wire).is_err(),
                "prost takes {wire:?}"
            );
            let error = admit(wire, PREDICT, &RequestBudget::new(1 << 30), None).unwrap_err();
            assert_eq!(error.code(), tonic::Code::Internal, "{wire:?}");
            assert!(error
                .message()
                .starts_with("failed to decode Protobuf message"));
        }
    }

    #[test]
    fn a_request_over_the_budget_is_refused_with_resource_exhausted() {
        let wire = predict(TensorProto {
            string_val: vec![Bytes::new(); 100_000],
            ..Default::default()
        });
        let error = admit(&wire, PREDICT, &RequestBudget::new(1 << 20), None).unwrap_err();
        assert_eq!(error.code(), tonic::Code::ResourceExhausted);
        let message = error.message();
        assert!(message.contains("more than the 1 MiB allowed"), "{message}");
        assert!(admit(&wire, PREDICT, &RequestBudget::new(64 << 20), None).is_ok());
    }

    fn float_request(count: usize) -> Vec<u8> {
        predict(TensorProto {
            tensor_content: vec![0; count * 4].into(),
            ..Default::default()
        })
    }

    #[test]
    fn requests_being_served_share_the_budget() {
        let budget = RequestBudget::new(10 << 20);
        let four_mib = float_request(1 << 20);
        let first = admit(&four_mib, PREDICT, &budget, None).unwrap();
        let second = admit(&four_mib, PREDICT, &budget, None).unwrap();
        assert!(budget.held_bytes() >= 8 << 20);
        let error = admit(&four_mib, PREDICT, &budget, None).unwrap_err();
        assert_eq!(error.code(), tonic::Code::ResourceExhausted);
        let message = error.message();
        assert!(
            message.contains("hold 8 MiB of the front door's memory"),
            "{message}"
        );
        assert!(message.contains("pass the 10 MiB allowed"), "{message}");
        // A small request is not counted: it goes through while the budget is full.
        let small = float_request(UNCOUNTED_BYTES / 8);
        assert!(admit(&small, PREDICT, &budget, None).unwrap().is_none());
        drop(first);
        let third = admit(&four_mib, PREDICT, &budget, None).unwrap();
        drop((second, third));
        assert_eq!(budget.held_bytes(), 0);
    }

    #[test]
    fn a_messages_gathered_share_is_topped_up_not_reserved_again() {
        let budget = RequestBudget::new(10 << 20);
        let wire = float_request(1 << 20);
        // What its 4 MiB held while they arrived, and others' 5 MiB: 1 MiB free.
        let carried = budget.try_reserve(wire.len());
        let others = budget.try_reserve(5 << 20).unwrap();
        let held = admit(&wire, PREDICT, &budget, carried).unwrap().unwrap();
        assert!(budget.held_bytes() >= (5 << 20) + wire.len());
        drop(held);
        // Without it handed over, the same message finds 1 MiB free beside its bytes.
        let carried = budget.try_reserve(wire.len()).unwrap();
        let error = admit(&wire, PREDICT, &budget, None).unwrap_err();
        assert_eq!(error.code(), tonic::Code::ResourceExhausted);
        // A share larger than the cost keeps the cost's.
        let big = budget.try_reserve(5 << 20);
        drop(carried);
        let held = admit(&wire, PREDICT, &budget, big).unwrap().unwrap();
        assert!(budget.held_bytes() < (10 << 20) - (512 << 10));
        drop((held, others));
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_share_lives_until_its_request_ends() {
        let budget = Arc::new(RequestBudget::new(10 << 20));
        let wire = float_request(1 << 20);
        let (admitted, mut end) = tokio::sync::oneshot::channel::<()>();
        let request = tokio::spawn(holding_request_memory({
            let budget = budget.clone();
            async move {
                hold_while_serving(admit(&wire, PREDICT, &budget, None).unwrap().unwrap());
                let _ = admitted.send(());
                // The handler's await (a worker's answer).
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }));
        let _ = (&mut end).await;
        assert!(budget.held_bytes() >= 4 << 20, "held while served");
        request.await.unwrap();
        assert_eq!(budget.held_bytes(), 0, "given back when it ended");

        // A request dropped before it ends (its client gone) gives its share back too.
        let wire = float_request(1 << 20);
        let request = holding_request_memory({
            let budget = budget.clone();
            async move {
                hold_while_serving(admit(&wire, PREDICT, &budget, None).unwrap().unwrap());
                std::future::pending::<()>().await;
            }
        });
        let mut request = Box::pin(request);
        let polled = futures_poll_once(request.as_mut()).await;
        assert!(polled.is_none() && budget.held_bytes() >= 4 << 20);
        drop(request);
        assert_eq!(budget.held_bytes(), 0);

        // Outside a request's scope nothing is kept.
        hold_while_serving(
            admit(&float_request(1 << 20), PREDICT, &budget, None)
                .unwrap()
                .unwrap(),
        );
        assert_eq!(budget.held_bytes(), 0);

        // A call that sends a second message holds the first's share only.
        let held = |budget: &RequestBudget| admit(&float_request(1 << 20), PREDICT, budget, None);
        holding_request_memory({
            let budget = budget.clone();
            async move {
                hold_while_serving(held(&budget).unwrap().unwrap());
                hold_while_serving(held(&budget).unwrap().unwrap());
                assert!(budget.held_bytes() < 5 << 20, "{}", budget.held_bytes());
            }
        })
        .await;
        assert_eq!(budget.held_bytes(), 0);
    }

    /// Polls `future` once: its output if it was ready.
    async fn futures_poll_once<F: Future + Unpin>(mut future: F) -> Option<F::Output> {
        std::future::poll_fn(|context| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut future).poll(context) {
                std::task::Poll::Ready(output) => Some(output),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
