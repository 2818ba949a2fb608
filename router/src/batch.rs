//! Batching in the front door (`--enable-batching`, `--batching-parameters-file`): requests
//! from different clients that wait for a worker are merged along their first dimension into
//! one worker call, and the answer is cut back into each request's rows — TF Serving's
//! batching, with its parameters:
//!
//! - `max_batch_size`: rows in one merged call; a request above it is refused with
//!   INVALID_ARGUMENT, TF Serving's message (unless it is cut into chunks first);
//! - `batch_timeout_micros`: when a worker has room but the batch is not full, wait at most
//!   this long after its oldest request arrived for more to join (0: send what is there);
//! - `allowed_batch_sizes`: a merged call is padded up to the smallest allowed size that
//!   holds it, with copies of its first row (as TF Serving pads), and the padding's answers
//!   are dropped;
//! - `max_enqueued_batches`: requests beyond this many full batches waiting are refused
//!   with UNAVAILABLE, TF Serving's message.
//!
//! Requests merge when they have the same signature, the same output filter, and inputs of
//! the same names, dtypes and trailing dimensions, all sharing one first dimension. Only
//! correct for models whose every output row depends on its own input row alone: turning
//! batching on is the operator's statement that this holds (as in TF Serving).
//!
//! The front door merges only what waits in its queue, so batching needs a limit on what
//! each worker has in flight (`--worker-inflight`, 1 by default with batching): while the
//! workers compute, new requests gather here and leave as one call.

use std::time::Duration;

use bytes::Bytes;

use crate::dispatch::{WorkReply, WorkRequest};
use crate::split;
use crate::status::{Code, ServingError};

/// TF Serving's refusal of a request of more rows than `max_batch_size`.
pub fn too_large(rows: u64, batching: &Batching) -> ServingError {
    let message = format!(
        "Task size {rows} is larger than maximum input batch size {}",
        batching.max_batch_size
    );
    ServingError::new(Code::InvalidArgument, message)
}

/// TF Serving's refusal of a request a batched call cannot take: no input, a scalar input,
/// or inputs whose first dimensions differ (batching_util.h, ComputeTensorBatchSize).
pub fn unbatchable(request: &WorkRequest) -> Option<ServingError> {
    let message = if request.tensors.is_empty() {
        "Batching Run() must have at least one input tensor"
    } else if (request.tensors.iter()).any(|(_, _, shape)| shape.is_empty()) {
        "Batching Run() input tensors must have at least one dimension"
    } else if !request.one_first_dimension() {
        "Batching Run() input tensors must have equal 0th-dimension size"
    } else {
        return None;
    };
    Some(ServingError::new(Code::InvalidArgument, message))
}

/// TF Serving's message when its batch queue is full (shared_batch_scheduler.h).
pub const QUEUE_FULL: &str = "The batch scheduling queue to which this task was submitted is full";

#[derive(Clone, Debug, PartialEq)]
pub struct Batching {
    pub max_batch_size: u64,
    pub timeout: Duration,
    /// Increasing; empty or ending at `max_batch_size`.
    pub allowed_batch_sizes: Vec<u64>,
    pub max_enqueued_batches: u64,
}

impl Default for Batching {
    /// TF Serving's defaults (BasicBatchScheduler's options).
    fn default() -> Self {
        Batching {
            max_batch_size: 1000,
            timeout: Duration::ZERO,
            allowed_batch_sizes: Vec::new(),
            max_enqueued_batches: 10,
        }
    }
}

impl Batching {
    pub fn check(&self) -> Result<(), String> {
        if self.max_batch_size == 0 || self.max_enqueued_batches == 0 {
            return Err("max_batch_size and max_enqueued_batches must be at least 1".into());
        }
        let sizes = &self.allowed_batch_sizes;
        if !sizes.is_empty() {
            if sizes.windows(2).any(|w| w[0] >= w[1]) || sizes[0] == 0 {
                return Err(format!(
                    "allowed_batch_sizes must be positive and increasing, got {sizes:?}"
                ));
            }
            if sizes.last() != Some(&self.max_batch_size) {
                return Err(format!(
                    "the last of allowed_batch_sizes must equal max_batch_size {}, got {sizes:?}",
                    self.max_batch_size
                ));
            }
        }
        Ok(())
    }

    /// The rows a merged call of `rows` rows is padded to.
    pub fn padded(&self, rows: u64) -> u64 {
        self.allowed_batch_sizes
            .iter()
            .copied()
            .find(|&size| size >= rows)
            .unwrap_or(rows)
    }

    /// Rows that may wait in the queue before new requests are refused.
    pub fn queue_rows(&self) -> u64 {
        self.max_enqueued_batches
            .saturating_mul(self.max_batch_size)
    }
}

/// What must be equal for two requests to share a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergeKey {
    signature: String,
    outputs: Vec<String>,
    inputs: Vec<(String, i32, Vec<i64>)>,
}

/// The request's merge key and rows; None when it cannot merge (no rows, inputs that do not
/// share a first dimension).
pub fn merge_key(request: &WorkRequest) -> Option<(MergeKey, u64)> {
    let rows = request.rows();
    if !can_merge(request) {
        return None;
    }
    let inputs = (request.tensors.iter())
        .map(|(name, dtype, shape)| (name.clone(), *dtype, shape[1..].to_vec()))
        .collect();
    let key = MergeKey {
        signature: request.signature.clone(),
        outputs: request.outputs.clone(),
        inputs,
    };
    Some((key, rows))
}

/// Whether the request may share a call or be padded: rows, one per output row, and every
/// input's first dimension its rows.
pub fn can_merge(request: &WorkRequest) -> bool {
    request.rows() > 0
        && request.row_wise
        && !request.tensors.is_empty()
        && request.tensors.len() == request.frames.len()
        && request.one_first_dimension()
}

/// One request of `padded` rows from `members` (same merge key, in order), padded with
/// copies of the first member's first row; None if a frame is not a whole number of rows.
/// Each frame is written once, its padding in place (building the padding apart and then
/// copying it in took twice the padding at the peak; found by a review).
pub fn merge(members: &[&WorkRequest], padded: u64) -> Option<WorkRequest> {
    let first = members.first()?;
    let rows: u64 = members.iter().map(|m| m.rows()).sum();
    let padding = usize::try_from(padded.saturating_sub(rows)).ok()?;
    let mut tensors = Vec::with_capacity(first.tensors.len());
    let mut frames = Vec::with_capacity(first.tensors.len());
    for (column, (name, dtype, shape)) in first.tensors.iter().enumerate() {
        let mut parts: Vec<(Bytes, usize)> = members
            .iter()
            .map(|m| m.frames.get(column).map(|f| (f.clone(), 1)))
            .collect::<Option<_>>()?;
        if padding > 0 {
            let head = split::cut(&first.frames[column], *dtype, first.rows(), &[(0, 1)])?;
            parts.push((head.into_iter().next()?, padding));
        }
        frames.push(split::concat_repeated(&parts, *dtype).ok()?);
        let mut shape = shape.clone();
        shape[0] = padded as i64;
        tensors.push((name.clone(), *dtype, shape));
    }
    Some(WorkRequest {
        target: first.target,
        signature: first.signature.clone(),
        tensors,
        frames,
        outputs: first.outputs.clone(),
        row_wise: first.row_wise,
        // Each member keeps its own frames, and shares, until the call is answered.
        memory: Default::default(),
    })
}

/// About the bytes `merge(members, padded)` builds: the members' frames and the padding
/// (the first member's first row, repeated); None where merge would fail.
pub fn merged_bytes(members: &[&WorkRequest], padded: u64) -> Option<u64> {
    let first = members.first()?;
    let rows: u64 = members.iter().map(|m| m.rows()).sum();
    let mut bytes: u64 = 0;
    for (column, (_, dtype, _)) in first.tensors.iter().enumerate() {
        for member in members {
            bytes = bytes.saturating_add(member.frames.get(column)?.len() as u64);
        }
        if padded > rows {
            let head = split::cut(&first.frames[column], *dtype, first.rows(), &[(0, 1)])?;
            let row = head.first()?.len() as u64;
            bytes = bytes.saturating_add(row.saturating_mul(padded - rows));
        }
    }
    Some(bytes)
}

/// The merged call's answer cut into each member's rows (`rows`, in order; padding after
/// them is dropped); None when an output does not have one row per row of the `sent` call
/// (`sent` rows, padding included) — TF Serving refuses such outputs too, and cutting a
/// batch-independent output by position would hand out wrong answers.
pub fn unmerge(reply: &WorkReply, rows: &[u64], sent: u64) -> Option<Vec<WorkReply>> {
    let mut bounds = Vec::with_capacity(rows.len());
    let mut start = 0;
    for &r in rows {
        bounds.push((start, start + r));
        start += r;
    }
    let mut parts: Vec<WorkReply> = rows
        .iter()
        .map(|_| WorkReply {
            tensors: Vec::with_capacity(reply.tensors.len()),
            frames: Vec::with_capacity(reply.tensors.len()),
            slot: reply.slot.clone(),
            version: reply.version,
            span: reply.span,
        })
        .collect();
    for ((name, dtype, shape), frame) in reply.tensors.iter().zip(&reply.frames) {
        let total = u64::try_from(*shape.first()?).ok()?;
        if total != sent || sent < start {
            return None;
        }
        let pieces = split::cut(frame, *dtype, total, &bounds)?;
        for ((part, piece), &r) in parts.iter_mut().zip(pieces).zip(rows) {
            let mut shape = shape.clone();
            shape[0] = r as i64;
            part.tensors.push((name.clone(), *dtype, shape));
            part.frames.push(piece);
        }
    }
    Some(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire;

    fn request(rows: usize, base: u8, strings: bool) -> WorkRequest {
        let dense: Vec<u8> = (0..rows * 2).map(|i| base + i as u8).collect();
        let mut tensors = vec![("x".to_string(), 4, vec![rows as i64, 2])];
        let mut frames = vec![Bytes::from(dense)];
        if strings {
            let values: Vec<Vec<u8>> = (0..rows).map(|i| vec![base, i as u8]).collect();
            tensors.push(("s".to_string(), split::DT_STRING, vec![rows as i64]));
            frames.push(Bytes::from(wire::encode_strings(&values)));
        }
        WorkRequest {
            target: crate::versions::Target {
                model: 0,
                version: 1,
                pinned: false,
            },
            signature: "serving_default".into(),
            tensors,
            frames,
            outputs: vec![],
            row_wise: true,
            memory: Default::default(),
        }
    }

    fn echo(request: &WorkRequest) -> WorkReply {
        WorkReply {
            tensors: request.tensors.clone(),
            frames: request.frames.clone(),
            slot: "cpu-0".into(),
            version: 1,
            span: Some((1, 2)),
        }
    }

    #[test]
    fn merged_and_cut_back_each_request_gets_its_own_rows() {
        let a = request(2, 10, true);
        let b = request(3, 100, true);
        let merged = merge(&[&a, &b], 5).unwrap();
        assert_eq!(merged.tensors[0].2, vec![5, 2]);
        let parts = unmerge(&echo(&merged), &[2, 3], 5).unwrap();
        assert_eq!(parts[0].frames, a.frames);
        assert_eq!(parts[1].frames, b.frames);
        assert_eq!(parts[1].tensors, b.tensors);
        assert_eq!(parts[0].span, Some((1, 2)));
    }

    #[test]
    fn padding_repeats_the_first_row_and_its_answers_are_dropped() {
        let policy = Batching {
            max_batch_size: 8,
            allowed_batch_sizes: vec![4, 8],
            ..Batching::default()
        };
        assert_eq!(policy.padded(3), 4);
        assert_eq!(policy.padded(5), 8);
        assert_eq!(Batching::default().padded(7), 7);
        let a = request(1, 10, true);
        let b = request(2, 20, true);
        let merged = merge(&[&a, &b], 4).unwrap();
        assert_eq!(&merged.frames[0][6..], &[10, 11]); // the first row again
        let strings = wire::decode_strings(&merged.frames[1]).unwrap();
        assert_eq!(strings[3], Bytes::from_static(&[10, 0]));
        let parts = unmerge(&echo(&merged), &[1, 2], 4).unwrap();
        assert_eq!(parts[0].frames, a.frames);
        assert_eq!(parts[1].frames, b.frames);
    }

    #[test]
    fn merged_string_frames_are_written_from_their_values_bytes_and_sized_first() {
        let a = request(1, 10, true);
        let b = request(2, 20, true);
        let merged = merge(&[&a, &b], 6).unwrap();
        let mut want = wire::decode_strings(&a.frames[1]).unwrap();
        want.extend(wire::decode_strings(&b.frames[1]).unwrap());
        want.extend(std::iter::repeat_n(Bytes::from_static(&[10, 0]), 3));
        assert_eq!(merged.frames[1], Bytes::from(wire::encode_strings(&want)));
        let built: u64 = merged.frames.iter().map(|f| f.len() as u64).sum();
        let sized = merged_bytes(&[&a, &b], 6).unwrap();
        // Each piece's array header is counted though the merged frame has one.
        assert!(sized >= built && sized <= built + 16, "{sized} for {built}");
        // A value that is not whole fails the merge rather than send a frame cut short.
        let mut torn = request(1, 10, true);
        torn.frames[1] = torn.frames[1].slice(..torn.frames[1].len() - 1);
        assert!(merge(&[&torn, &b], 3).is_none());
    }

    #[test]
    fn only_requests_that_can_share_a_call_have_equal_keys() {
        let key = |r: &WorkRequest| merge_key(r).map(|(k, _)| k);
        let a = request(2, 0, false);
        assert_eq!(merge_key(&a).map(|(_, rows)| rows), Some(2));
        assert_eq!(key(&a), key(&request(5, 1, false)));
        let mut wider = request(2, 0, false);
        wider.tensors[0].2 = vec![2, 3];
        assert_ne!(key(&a), key(&wider));
        let mut other = request(2, 0, false);
        other.signature = "other".into();
        assert_ne!(key(&a), key(&other));
        let mut filtered = request(2, 0, false);
        filtered.outputs = vec!["y".into()];
        assert_ne!(key(&a), key(&filtered));
        let mut ragged = request(2, 0, true);
        ragged.tensors[1].2 = vec![1];
        assert_eq!(key(&ragged), None);
        assert_eq!(key(&request(0, 0, false)), None);
        // Asking for an output its signature gives a fixed size (a vocabulary): alone.
        let mut constant = request(2, 0, false);
        constant.row_wise = false;
        assert_eq!(key(&constant), None);
    }

    #[test]
    fn an_answer_without_a_row_per_input_row_cannot_be_cut() {
        let merged = merge(&[&request(2, 0, false), &request(2, 9, false)], 4).unwrap();
        let mut reply = echo(&merged);
        reply.tensors[0].2 = vec![1, 2];
        reply.frames[0] = reply.frames[0].slice(..2);
        assert!(unmerge(&reply, &[2, 2], 4).is_none());
        // A batch-independent output that happens to have enough rows: not cut by position.
        let mut table = echo(&merged);
        table.tensors[0].2 = vec![6, 2];
        table.frames[0] = Bytes::from(vec![0u8; 12]);
        assert!(unmerge(&table, &[2, 2], 4).is_none());
    }

    #[test]
    fn parameters_are_checked_as_tf_serving_checks_them() {
        assert!(Batching::default().check().is_ok());
        let bad = |sizes: Vec<u64>| Batching {
            max_batch_size: 8,
            allowed_batch_sizes: sizes,
            ..Batching::default()
        };
        assert!(bad(vec![2, 4, 8]).check().is_ok());
        assert!(bad(vec![4, 2, 8]).check().is_err());
        assert!(bad(vec![2, 4]).check().is_err());
        assert_eq!(Batching::default().queue_rows(), 10_000);
    }
}
