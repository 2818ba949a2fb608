//! Request splitting (`--split-rows`): a request with more rows than the limit is cut along
//! its first dimension into chunks of at most that many rows, the chunks run on several
//! workers at once, and the answers are joined back in order — so a large request's latency
//! is that of its chunks run side by side, not of one worker doing all of it (the TF Serving
//! tuning notes' "split a large request into parallel chunks"; TF Serving's own
//! `enable_large_batch_splitting` cuts at `max_execution_batch_size` the same way).
//!
//! Only correct for models whose every output row depends on its own input row alone (the
//! rule batching has); turning it on is the operator's statement that this holds. A request
//! is split only when every input shares the first dimension; an answer whose outputs do not
//! have one row per input row cannot be joined and fails with FAILED_PRECONDITION.

use bytes::{Bytes, BytesMut};

use crate::dispatch::{WorkReply, WorkRequest};
use crate::signature::shape_text;
use crate::status::{Code, ServingError};
use crate::versions::Target;
use crate::wire::{self, TensorMeta};

pub(crate) const DT_STRING: i32 = 7;

/// The most chunks one request is cut into. A request's rows are declared, not counted:
/// a tensor of shape [2^60, 0] carries no bytes, and its list of 2^60 chunks aborted the
/// front door (found by a hunt). One past it runs whole, as one that cannot be cut.
pub const MAX_CHUNKS: u64 = 65_536;

/// The chunks of `request` (each with its row count), or None when it stays whole: no limit,
/// not above it, inputs that do not all share a first dimension, or more than MAX_CHUNKS
/// chunks.
pub fn split(request: &WorkRequest, limit: u64) -> Option<Vec<(WorkRequest, u64)>> {
    let rows = request.rows();
    if limit == 0
        || rows <= limit
        || rows.div_ceil(limit) > MAX_CHUNKS
        || !request.row_wise
        || request.tensors.len() != request.frames.len()
        || !request.one_first_dimension()
    {
        return None;
    }
    // Per input: the frame's pieces, one per chunk.
    let bounds: Vec<(u64, u64)> = (0..rows.div_ceil(limit))
        .map(|i| (i * limit, ((i + 1) * limit).min(rows)))
        .collect();
    let mut pieces: Vec<Vec<Bytes>> = Vec::with_capacity(request.frames.len());
    for ((_, dtype, _), frame) in request.tensors.iter().zip(&request.frames) {
        pieces.push(cut(frame, *dtype, rows, &bounds)?);
    }
    let chunks = bounds
        .iter()
        .enumerate()
        .map(|(i, &(start, end))| {
            let tensors = request
                .tensors
                .iter()
                .map(|(name, dtype, shape)| {
                    let mut shape = shape.clone();
                    shape[0] = (end - start) as i64;
                    (name.clone(), *dtype, shape)
                })
                .collect();
            // Every chunk on the same version: their answers are joined into one.
            let chunk = WorkRequest {
                target: Target {
                    pinned: true,
                    ..request.target
                },
                signature: request.signature.clone(),
                tensors,
                frames: pieces.iter().map(|p| p[i].clone()).collect(),
                outputs: request.outputs.clone(),
                row_wise: request.row_wise,
                // Each chunk's frames are slices of the request's: the shares go with the last.
                memory: request.memory.clone(),
            };
            (chunk, end - start)
        })
        .collect();
    Some(chunks)
}

/// One tensor's frame cut at row `bounds`; None when its size is not a whole number of rows.
pub(crate) fn cut(
    frame: &Bytes,
    dtype: i32,
    rows: u64,
    bounds: &[(u64, u64)],
) -> Option<Vec<Bytes>> {
    if dtype == DT_STRING {
        return cut_strings(frame, rows, bounds);
    }
    let per_row = row_size(frame.len(), rows)?;
    // Zero-copy: each piece is a view of the request's buffer.
    Some(
        bounds
            .iter()
            .map(|&(s, e)| frame.slice(s as usize * per_row..e as usize * per_row))
            .collect(),
    )
}

/// `cut` of a DT_STRING frame, its values walked one by one (slices of it) and each piece
/// written whole: a list of them first took 32 bytes a value, 787 MiB for a 33-byte request
/// of 20,000,000 empty strings, counted by no budget (found by a hunt). `bounds` in order.
fn cut_strings(frame: &Bytes, rows: u64, bounds: &[(u64, u64)]) -> Option<Vec<Bytes>> {
    let mut values = wire::StringValues::of(frame).ok()?;
    let per_row = row_size(values.len(), rows)?;
    let mut at = 0;
    let mut pieces = Vec::with_capacity(bounds.len());
    for &(start, end) in bounds {
        let (start, end) = (start as usize * per_row, end as usize * per_row);
        if start < at || end < start {
            return None;
        }
        for _ in at..start {
            values.next()?.ok()?;
        }
        let count = end - start;
        // Its exact size first (a walk over the values' headers), then written in place.
        let size = values
            .clone()
            .take(count)
            .try_fold(5usize, |size, value| Some(size + 5 + value.ok()?.len()))?;
        let part = values
            .by_ref()
            .take(count)
            .map(|value| value.unwrap_or(&[]));
        pieces.push(Bytes::from(wire::encode_strings_iter(
            u32::try_from(count).ok()?,
            part,
            size,
        )));
        at = end;
    }
    Some(pieces)
}

fn row_size(total: usize, rows: u64) -> Option<usize> {
    let rows = usize::try_from(rows).ok()?;
    (total % rows == 0).then_some(total / rows)
}

/// The chunks' answers joined in chunk order into the answer of the whole request.
pub fn join(parts: Vec<(WorkReply, u64)>) -> Result<WorkReply, ServingError> {
    let not_per_row = |name: &str| {
        ServingError::new(
            Code::FailedPrecondition,
            format!(
                "output {name} of a split request does not have one row per input row: \
                 --split-rows is only for models whose rows are independent"
            ),
        )
    };
    let Some((first, _)) = parts.first() else {
        return Err(ServingError::new(
            Code::Internal,
            "a split request had no chunks",
        ));
    };
    let layout: Vec<(String, i32)> = first
        .tensors
        .iter()
        .map(|(name, dtype, _)| (name.clone(), *dtype))
        .collect();
    let (slot, version) = (first.slot.clone(), first.version);
    let mut total_rows = 0i64;
    let mut span: Option<(i64, i64)> = None;
    let mut columns: Vec<Vec<Bytes>> = vec![Vec::with_capacity(parts.len()); layout.len()];
    let mut shapes: Vec<Vec<i64>> = Vec::with_capacity(layout.len());
    for (index, (reply, rows)) in parts.into_iter().enumerate() {
        if reply.tensors.len() != layout.len() || reply.frames.len() != layout.len() {
            return Err(ServingError::new(
                Code::Internal,
                "the chunks of a split request were answered with different outputs",
            ));
        }
        for (column, ((name, dtype, shape), frame)) in
            reply.tensors.iter().zip(reply.frames).enumerate()
        {
            if (name, *dtype) != (&layout[column].0, layout[column].1) {
                return Err(ServingError::new(
                    Code::Internal,
                    "the chunks of a split request were answered with different outputs",
                ));
            }
            if shape.first() != Some(&(rows as i64)) {
                return Err(not_per_row(name));
            }
            if index == 0 {
                shapes.push(shape.clone());
            } else if shape[1..] != shapes[column][1..] {
                // Rows padded to the longest of their call (a text model's tokens): a row's
                // answer depends on the others in its call.
                let message = format!(
                    "output {name} of a split request has shape {} in one chunk and {} in \
                     another past the first dimension: its rows depend on each other, and \
                     --split-rows is only for models whose rows are independent",
                    shape_text(&shapes[column]),
                    shape_text(shape)
                );
                return Err(ServingError::new(Code::FailedPrecondition, message));
            }
            columns[column].push(frame);
        }
        total_rows += rows as i64;
        if let Some((start, end)) = reply.span {
            span = Some(span.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
        }
    }
    let mut tensors: Vec<TensorMeta> = Vec::with_capacity(layout.len());
    let mut frames = Vec::with_capacity(layout.len());
    for (((name, dtype), mut shape), pieces) in layout.into_iter().zip(shapes).zip(columns) {
        shape[0] = total_rows;
        frames.push(concat(&pieces, dtype)?);
        tensors.push((name, dtype, shape));
    }
    Ok(WorkReply {
        tensors,
        frames,
        slot,
        version,
        span,
    })
}

pub(crate) fn concat(pieces: &[Bytes], dtype: i32) -> Result<Bytes, ServingError> {
    let parts: Vec<(Bytes, usize)> = pieces.iter().map(|p| (p.clone(), 1)).collect();
    concat_repeated(&parts, dtype)
}

/// `concat` of each piece repeated its number of times, written once into the frame.
pub(crate) fn concat_repeated(parts: &[(Bytes, usize)], dtype: i32) -> Result<Bytes, ServingError> {
    let too_large = || ServingError::new(Code::Internal, "a joined tensor too large");
    if dtype == DT_STRING {
        // Their values' bytes as they are, under one header: a list of the values took 32
        // bytes a value (an empty one takes 1 in a frame).
        let bad = |e: wire::ProtocolError| {
            ServingError::new(Code::Internal, format!("a chunk's string output: {e}"))
        };
        let mut count: u64 = 0;
        let mut bodies = Vec::with_capacity(parts.len());
        for (piece, times) in parts {
            let values = wire::StringValues::of(piece).map_err(bad)?;
            count = (values.len() as u64)
                .checked_mul(*times as u64)
                .and_then(|n| n.checked_add(count))
                .ok_or_else(too_large)?;
            bodies.push((values.checked_values().map_err(bad)?, *times));
        }
        let count = u32::try_from(count).map_err(|_| {
            ServingError::new(Code::Internal, format!("{count} strings in one tensor"))
        })?;
        return Ok(Bytes::from(wire::encode_string_bodies(count, &bodies)));
    }
    let bytes = parts.iter().try_fold(0usize, |sum, (piece, times)| {
        piece.len().checked_mul(*times)?.checked_add(sum)
    });
    let mut out = BytesMut::with_capacity(bytes.ok_or_else(too_large)?);
    for (piece, times) in parts {
        for _ in 0..*times {
            out.extend_from_slice(piece);
        }
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(values: &[f32]) -> Bytes {
        Bytes::from(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    /// 5 rows: x float [5, 2] and s string [5].
    fn request() -> WorkRequest {
        let x: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let s: Vec<Vec<u8>> = (0..5).map(|i| format!("row{i}").into_bytes()).collect();
        WorkRequest {
            target: crate::versions::Target {
                model: 0,
                version: 1,
                pinned: false,
            },
            signature: "serving_default".into(),
            tensors: vec![
                ("x".into(), 1, vec![5, 2]),
                ("s".into(), DT_STRING, vec![5]),
            ],
            frames: vec![floats(&x), Bytes::from(wire::encode_strings(&s))],
            outputs: vec![],
            row_wise: true,
            memory: Default::default(),
        }
    }

    /// `request()` cut into chunks of 3 rows and 2, each answered by an echoing worker.
    fn echoed_chunks_of_three() -> Vec<(WorkReply, u64)> {
        let chunks = split(&request(), 3).unwrap();
        chunks.iter().map(|(c, r)| (echo(c, (0, 1)), *r)).collect()
    }

    /// What an echoing worker answers a chunk: its own inputs.
    fn echo(chunk: &WorkRequest, t: (i64, i64)) -> WorkReply {
        WorkReply {
            tensors: chunk.tensors.clone(),
            frames: chunk.frames.clone(),
            slot: "cpu-0".into(),
            version: 1,
            span: Some(t),
        }
    }

    #[test]
    fn chunks_of_at_most_the_limit_in_order_and_joined_back_unchanged() {
        let whole = request();
        let chunks = split(&whole, 2).expect("5 rows > 2");
        let rows: Vec<u64> = chunks.iter().map(|(_, r)| *r).collect();
        assert_eq!(rows, [2, 2, 1]);
        assert_eq!(chunks[1].0.tensors[0], ("x".to_string(), 1, vec![2, 2]));
        assert_eq!(chunks[1].0.frames[0], floats(&[4.0, 5.0, 6.0, 7.0]));
        let strings = wire::decode_strings(&chunks[2].0.frames[1]).unwrap();
        assert_eq!(strings, [Bytes::from_static(b"row4")]);
        let answers = chunks
            .iter()
            .enumerate()
            .map(|(i, (c, r))| (echo(c, (10 * i as i64, 10 * i as i64 + 5)), *r))
            .collect();
        let joined = join(answers).unwrap();
        assert_eq!(joined.tensors, whole.tensors);
        assert_eq!(joined.frames, whole.frames);
        assert_eq!(joined.span, Some((0, 25)));
    }

    #[test]
    fn string_frames_are_joined_whatever_their_elements_types() {
        // A worker's answer may hold msgpack str elements (Python's str), the front door's bin.
        let mut of_str = Vec::new();
        rmp::encode::write_array_len(&mut of_str, 2).unwrap();
        rmp::encode::write_str(&mut of_str, "ab").unwrap();
        rmp::encode::write_str(&mut of_str, "").unwrap();
        let of_bin = Bytes::from(wire::encode_strings(&[b"cd".as_slice()]));
        let joined = concat(&[Bytes::from(of_str), of_bin], DT_STRING).unwrap();
        let values = wire::decode_strings(&joined).unwrap();
        assert_eq!(values, [&b"ab"[..], b"", b"cd"]);
        let bad = concat(&[Bytes::from_static(&[0x92, 0xc4, 5])], DT_STRING).unwrap_err();
        assert_eq!(bad.code, Code::Internal);
        assert!(
            bad.message.starts_with("a chunk's string output:"),
            "{}",
            bad.message
        );
    }

    #[test]
    fn a_string_frame_is_cut_value_by_value_whatever_its_elements_types() {
        // Python sends str or bin elements; each piece is written as bin.
        let mut frame = Vec::new();
        rmp::encode::write_array_len(&mut frame, 4).unwrap();
        rmp::encode::write_str(&mut frame, "a").unwrap();
        rmp::encode::write_bin(&mut frame, b"").unwrap();
        rmp::encode::write_str(&mut frame, &"c".repeat(300)).unwrap();
        rmp::encode::write_bin(&mut frame, b"dd").unwrap();
        let frame = Bytes::from(frame);
        let pieces = cut(&frame, DT_STRING, 2, &[(0, 1), (1, 2)]).unwrap();
        assert_eq!(pieces[0], wire::encode_strings(&[&b"a"[..], b""]));
        assert_eq!(
            pieces[1],
            wire::encode_strings(&["c".repeat(300).as_bytes(), b"dd"])
        );
        // The first row alone (batching's head row) reads no further.
        let head = cut(&frame, DT_STRING, 4, &[(0, 1)]).unwrap();
        assert_eq!(head, [Bytes::from(wire::encode_strings(&[b"a"]))]);
        // Not a whole number of rows, bounds out of order, a frame cut short: not cut.
        assert!(cut(&frame, DT_STRING, 3, &[(0, 3)]).is_none());
        assert!(cut(&frame, DT_STRING, 2, &[(1, 2), (0, 1)]).is_none());
        assert!(cut(
            &frame.slice(..frame.len() - 1),
            DT_STRING,
            2,
            &[(0, 1), (1, 2)]
        )
        .is_none());
    }

    #[test]
    fn rows_declared_past_the_chunk_bound_stay_whole() {
        // [2^60, 0]: no bytes, 2^60 rows. Its chunks were listed, and the front door aborted.
        let zero_size = WorkRequest {
            tensors: vec![("x".into(), 1, vec![1 << 60, 0])],
            frames: vec![Bytes::new()],
            ..request()
        };
        assert!(split(&zero_size, 1000).is_none());
        let at_the_bound = WorkRequest {
            tensors: vec![("x".into(), 1, vec![(MAX_CHUNKS * 2) as i64, 0])],
            frames: vec![Bytes::new()],
            ..request()
        };
        assert_eq!(
            split(&at_the_bound, 2).map(|c| c.len() as u64),
            Some(MAX_CHUNKS)
        );
        assert!(split(&at_the_bound, 1).is_none());
    }

    #[test]
    fn stays_whole_without_a_limit_below_it_or_with_unequal_first_dimensions() {
        let whole = request();
        assert!(split(&whole, 0).is_none());
        assert!(split(&whole, 5).is_none());
        let mut ragged = request();
        ragged.tensors[1].2 = vec![4];
        assert!(split(&ragged, 2).is_none());
        let mut scalar = request();
        scalar.tensors[1].2 = vec![];
        assert!(split(&scalar, 2).is_none());
        // A frame that is not a whole number of rows (the codec would never send it).
        let mut torn = request();
        torn.frames[0] = torn.frames[0].slice(..36);
        assert!(split(&torn, 2).is_none());
        // An output its signature gives a fixed size (a vocabulary of 3, asked of a 6-row
        // request cut in 3 and 3, came back 6 long: every chunk's copy).
        let mut constant = request();
        constant.row_wise = false;
        assert!(split(&constant, 2).is_none());
    }

    #[test]
    fn an_output_without_one_row_per_input_row_fails_the_join() {
        let mut answers = echoed_chunks_of_three();
        // A model that reduces over the batch: one row whatever it was given.
        answers[1].0.tensors[0].2 = vec![1, 2];
        answers[1].0.frames[0] = floats(&[0.0, 0.0]);
        let error = join(answers).unwrap_err();
        assert_eq!(error.code, Code::FailedPrecondition);
        assert!(error.message.contains("output x"), "{}", error.message);
    }

    #[test]
    fn rows_padded_to_their_chunks_longest_fail_the_join_saying_so() {
        let mut answers = echoed_chunks_of_three();
        // A text model's tokens, padded to the longest row of the call: 2 wide, then 1.
        answers[1].0.tensors[0].2 = vec![2, 1];
        answers[1].0.frames[0] = floats(&[0.0, 0.0]);
        let error = join(answers).unwrap_err();
        assert_eq!(error.code, Code::FailedPrecondition);
        assert_eq!(
            error.message,
            "output x of a split request has shape [3,2] in one chunk and [2,1] in another \
             past the first dimension: its rows depend on each other, and --split-rows is only \
             for models whose rows are independent"
        );
    }
}
