//! TensorProto ⇄ worker frames, parsing exactly as TensorFlow's C++ `Tensor::FromProto`
//! (what TF Serving runs):
//! - a non-empty `tensor_content` holds the raw little-endian values and must be exactly
//!   `num_elements × itemsize` bytes;
//! - otherwise only the typed `*_val` field that matches the dtype is read (values in any other
//!   field are ignored: an int64 tensor sent in `bool_val` is all zeros);
//! - no values at all → zeros; fewer values than elements → the last value repeats;
//! - more values than elements → the first `num_elements` are used.
//!
//! Half and bfloat16 travel in `half_val` as their 16-bit patterns; complex values as
//! (real, imaginary) pairs. `declared()` reads only dtype and shape, so a request is checked
//! against the signature before any value is expanded: a 180-byte request that declares a
//! shape of billions of elements costs microseconds to refuse, never an allocation.

use bytes::{Bytes, BytesMut};

use crate::proto::mpspool::tfs::{TensorProto, TensorShapeProto};
use crate::status::ServingError;
use crate::wire;

pub const DT_FLOAT: i32 = 1;
pub const DT_DOUBLE: i32 = 2;
pub const DT_INT32: i32 = 3;
pub const DT_UINT8: i32 = 4;
pub const DT_INT16: i32 = 5;
pub const DT_INT8: i32 = 6;
pub const DT_STRING: i32 = 7;
pub const DT_COMPLEX64: i32 = 8;
pub const DT_INT64: i32 = 9;
pub const DT_BOOL: i32 = 10;
pub const DT_BFLOAT16: i32 = 14;
pub const DT_UINT16: i32 = 17;
pub const DT_COMPLEX128: i32 = 18;
pub const DT_HALF: i32 = 19;
pub const DT_UINT32: i32 = 22;
pub const DT_UINT64: i32 = 23;

/// numpy's limit on ndim (TensorFlow's own is 254; no served model comes near either).
const MAX_RANK: usize = 64;

/// The largest tensor a request may describe (2 GiB: protobuf's own limit on a message, so no
/// request that spells its values out can be refused by this). Typed fields repeat their last
/// value to fill the shape, so a request of a few bytes could otherwise ask for terabytes.
pub const MAX_TENSOR_BYTES: u64 = 1 << 31;

/// Short names as TensorFlow prints them ("expects dtype int64 but float is provided").
pub fn dtype_name(dtype: i32) -> String {
    let name = match dtype {
        DT_FLOAT => "float",
        DT_DOUBLE => "double",
        DT_INT32 => "int32",
        DT_UINT8 => "uint8",
        DT_INT16 => "int16",
        DT_INT8 => "int8",
        DT_STRING => "string",
        DT_COMPLEX64 => "complex64",
        DT_INT64 => "int64",
        DT_BOOL => "bool",
        DT_BFLOAT16 => "bfloat16",
        DT_UINT16 => "uint16",
        DT_COMPLEX128 => "complex128",
        DT_HALF => "half",
        DT_UINT32 => "uint32",
        DT_UINT64 => "uint64",
        // Types a signature may declare that mpspool does not carry (mpspool/dtypes.py).
        11 => "qint8",
        12 => "quint8",
        13 => "qint32",
        15 => "qint16",
        16 => "quint16",
        20 => "resource",
        21 => "variant",
        24 => "float8_e5m2",
        25 => "float8_e4m3fn",
        26 => "float8_e4m3fnuz",
        27 => "float8_e4m3b11fnuz",
        28 => "float8_e5m2fnuz",
        29 => "int4",
        30 => "uint4",
        31 => "int2",
        32 => "uint2",
        33 => "float4_e2m1fn",
        other => return format!("DataType({other})"),
    };
    name.to_string()
}

/// Bytes per element of a numeric dtype; None for strings and types mpspool does not carry.
pub fn itemsize(dtype: i32) -> Option<usize> {
    match dtype {
        DT_UINT8 | DT_INT8 | DT_BOOL => Some(1),
        DT_INT16 | DT_UINT16 | DT_HALF | DT_BFLOAT16 => Some(2),
        DT_FLOAT | DT_INT32 | DT_UINT32 => Some(4),
        DT_DOUBLE | DT_INT64 | DT_UINT64 | DT_COMPLEX64 => Some(8),
        DT_COMPLEX128 => Some(16),
        _ => None,
    }
}

fn invalid(name: &str, what: impl std::fmt::Display) -> ServingError {
    ServingError::invalid_argument(format!("tensor parsing error: input \"{name}\": {what}"))
}

fn dims_text(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// The dtype and shape a tensor declares, validated (supported dtype, rank, no negative
/// dimension, element count within int64) without reading or expanding any value.
pub fn declared(proto: &TensorProto, name: &str) -> Result<(i32, Vec<i64>), ServingError> {
    let dtype = proto.dtype;
    if dtype != DT_STRING && itemsize(dtype).is_none() {
        return Err(invalid(
            name,
            format!("unsupported dtype {}", dtype_name(dtype)),
        ));
    }
    let shape = shape_of(proto.tensor_shape.as_ref(), name)?;
    if dtype == DT_STRING && shape.len() > MAX_STRING_RANK {
        return Err(invalid(
            name,
            format!(
                "a string tensor of rank {}: the workers take string tensors of rank \
                 {MAX_STRING_RANK} at most (TensorFlow's Python side, which they call the \
                 model through, cannot hold more)",
                shape.len()
            ),
        ));
    }
    Ok((dtype, shape))
}

/// TensorFlow's conversion of string tensors to and from numpy ends the process (SIGSEGV)
/// past 32 dimensions (numeric ones are fine up to MAX_RANK): one request of rank 33 cost up
/// to three workers (found by a hunt). TF Serving, all C++, takes them.
const MAX_STRING_RANK: usize = 32;

fn shape_of(shape: Option<&TensorShapeProto>, name: &str) -> Result<Vec<i64>, ServingError> {
    let Some(shape) = shape else {
        return Ok(Vec::new()); // no shape: a scalar, as in TensorFlow
    };
    // `unknown_rank` is ignored, as TensorFlow's parser does: the dimensions given are the
    // shape (none: a scalar). The vectors hold both cases.
    if shape.dim.len() > MAX_RANK {
        return Err(invalid(
            name,
            format!("rank {} exceeds the maximum of {MAX_RANK}", shape.dim.len()),
        ));
    }
    let dims: Vec<i64> = shape.dim.iter().map(|d| d.size).collect();
    if dims.iter().any(|&d| d < 0) {
        return Err(invalid(
            name,
            format!("negative dimension in shape {}", dims_text(&dims)),
        ));
    }
    // TensorShape::IsValid multiplies dim by dim and rejects the shape as soon as the running
    // product overflows int64, even if a later dimension is 0.
    let mut n: i64 = 1;
    for &d in &dims {
        n = n.checked_mul(d).ok_or_else(|| {
            invalid(
                name,
                format!("shape {} has more than 2^63-1 elements", dims_text(&dims)),
            )
        })?;
    }
    Ok(dims)
}

fn element_count(shape: &[i64]) -> u64 {
    // declared() has bounded the product by i64::MAX.
    shape.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64))
}

fn too_big(name: &str, dtype: i32, shape: &[i64], bytes: u64) -> ServingError {
    invalid(
        name,
        format!(
            "shape {} of {} needs {bytes} bytes, more than the {MAX_TENSOR_BYTES} one tensor may have",
            dims_text(shape),
            dtype_name(dtype)
        ),
    )
}

/// The worker frame for a tensor already declared as (`dtype`, `shape`): little-endian values
/// for numbers (the request's own `tensor_content` buffer when it is present, no copy), or
/// one msgpack array of byte strings for DT_STRING.
pub fn materialize(
    proto: &TensorProto,
    name: &str,
    dtype: i32,
    shape: &[i64],
) -> Result<Bytes, ServingError> {
    let n = element_count(shape);
    if dtype == DT_STRING {
        return materialize_strings(proto, name, shape, n);
    }
    let size = itemsize(dtype)
        .ok_or_else(|| invalid(name, format!("unsupported dtype {}", dtype_name(dtype))))?;
    if n == 0 {
        // Tensor::FromProto reads no values for an empty shape: whatever came along is ignored.
        return Ok(Bytes::new());
    }
    let bytes = n.saturating_mul(size as u64);
    if bytes > MAX_TENSOR_BYTES {
        return Err(too_big(name, dtype, shape, bytes));
    }
    let n = n as usize;
    let content = &proto.tensor_content;
    if !content.is_empty() {
        if content.len() as u64 != bytes {
            return Err(invalid(
                name,
                format!(
                    "tensor_content has {} bytes, shape {} of {} needs {bytes}",
                    content.len(),
                    dims_text(shape),
                    dtype_name(dtype)
                ),
            ));
        }
        if dtype == DT_BOOL && content.iter().any(|&b| b > 1) {
            // TensorFlow refuses bool bytes other than 0 and 1.
            return Err(invalid(
                name,
                "tensor_content of a bool tensor holds bytes other than 0 and 1",
            ));
        }
        return Ok(content.clone());
    }
    let mut out = BytesMut::with_capacity(n * size);
    match dtype {
        DT_FLOAT => fill(&mut out, &proto.float_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DT_DOUBLE => fill(&mut out, &proto.double_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DT_INT32 => fill(&mut out, &proto.int_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        // int_val → narrower integers wraps like static_cast.
        DT_INT16 => fill(&mut out, &proto.int_val, n, |v, o| {
            o.extend_from_slice(&(*v as i16).to_le_bytes())
        }),
        DT_UINT16 => fill(&mut out, &proto.int_val, n, |v, o| {
            o.extend_from_slice(&(*v as u16).to_le_bytes())
        }),
        DT_INT8 => fill(&mut out, &proto.int_val, n, |v, o| {
            o.extend_from_slice(&(*v as i8).to_le_bytes())
        }),
        DT_UINT8 => fill(&mut out, &proto.int_val, n, |v, o| {
            o.extend_from_slice(&(*v as u8).to_le_bytes())
        }),
        DT_INT64 => fill(&mut out, &proto.int64_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DT_UINT32 => fill(&mut out, &proto.uint32_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DT_UINT64 => fill(&mut out, &proto.uint64_val, n, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DT_BOOL => fill(&mut out, &proto.bool_val, n, |v, o| {
            o.extend_from_slice(&[u8::from(*v)])
        }),
        // The low 16 bits are the value's bit pattern.
        DT_HALF | DT_BFLOAT16 => fill(&mut out, &proto.half_val, n, |v, o| {
            o.extend_from_slice(&(*v as u16).to_le_bytes())
        }),
        DT_COMPLEX64 => fill(&mut out, &pairs(&proto.scomplex_val), n, |v, o| {
            o.extend_from_slice(&v[0].to_le_bytes());
            o.extend_from_slice(&v[1].to_le_bytes());
        }),
        DT_COMPLEX128 => fill(&mut out, &pairs(&proto.dcomplex_val), n, |v, o| {
            o.extend_from_slice(&v[0].to_le_bytes());
            o.extend_from_slice(&v[1].to_le_bytes());
        }),
        other => {
            return Err(invalid(
                name,
                format!("unsupported dtype {}", dtype_name(other)),
            ))
        }
    }
    Ok(out.freeze())
}

/// (real, imaginary) pairs; an odd tail is dropped, as TensorFlow does.
fn pairs<T: Copy>(values: &[T]) -> Vec<[T; 2]> {
    values.chunks_exact(2).map(|p| [p[0], p[1]]).collect()
}

/// Write `n` values: those given, the last one repeated, or zeros when none are given.
fn fill<T: Copy + Default>(
    out: &mut BytesMut,
    values: &[T],
    n: usize,
    write: impl Fn(&T, &mut BytesMut),
) {
    let zero = T::default();
    let last = values.last().copied().unwrap_or(zero);
    for value in values.iter().take(n) {
        write(value, out);
    }
    for _ in values.len().min(n)..n {
        write(&last, out);
    }
}

fn materialize_strings(
    proto: &TensorProto,
    name: &str,
    shape: &[i64],
    n: u64,
) -> Result<Bytes, ServingError> {
    if !proto.tensor_content.is_empty() && n > 0 {
        // TensorFlow's own encoding of strings there (Tensor::FromProto reads it first).
        let list = StringList {
            content: &proto.tensor_content,
            n,
        };
        let bytes = list.frame_size().ok_or_else(|| {
            invalid(
                name,
                format!(
                    "tensor_content does not hold {n} strings as TensorFlow encodes them \
                     (each one's length as a varint, then their bytes)"
                ),
            )
        })?;
        if bytes > MAX_TENSOR_BYTES {
            return Err(too_big(name, DT_STRING, shape, bytes));
        }
        // n < 2^30 here: each element takes at least 2 bytes of a frame of at most 2^31.
        let out = wire::encode_strings_iter(n as u32, list.values(), bytes as usize);
        debug_assert_eq!(out.len() as u64, bytes);
        return Ok(Bytes::from(out));
    }
    let values = &proto.string_val;
    let given = values.len() as u64;
    let empty = Bytes::new();
    let last = values.last().unwrap_or(&empty);
    // The frame's exact size, the last value repeated to fill the shape, is bounded before
    // anything is allocated: a few bytes of request must not become gigabytes of frame.
    let bytes = string_val_frame_size(values, n);
    if bytes > MAX_TENSOR_BYTES {
        return Err(too_big(name, DT_STRING, shape, bytes));
    }
    // Written in place, with no list of n references first.
    let sent = values.iter().take(n as usize).map(|v| &v[..]);
    let fill = std::iter::repeat_n(&last[..], n.saturating_sub(given) as usize);
    // n < 2^30 here: each element takes at least 2 bytes of a frame of at most 2^31.
    let out = wire::encode_strings_iter(n as u32, sent.chain(fill), bytes as usize);
    debug_assert_eq!(out.len() as u64, bytes);
    Ok(Bytes::from(out))
}

/// The size of the frame of `n` strings from `values`, the last one repeated to fill them.
fn string_val_frame_size(values: &[Bytes], n: u64) -> u64 {
    let given = values.len() as u64;
    let spelled = values
        .iter()
        .take(n.min(given) as usize)
        .fold(0u64, |sum, v| sum.saturating_add(bin_size(v.len() as u64)));
    let last = values.last().map_or(0, |v| v.len() as u64);
    let repeated = n.saturating_sub(given).saturating_mul(bin_size(last));
    array_header_size(n)
        .saturating_add(spelled)
        .saturating_add(repeated)
}

/// What `materialize` allocates for a tensor declared as (`dtype`, `shape`): its values
/// written out (given one by one, or a last value repeated to fill the shape: a few bytes of
/// request may ask for gigabytes), or none for numbers in `tensor_content` (sent as they
/// came). Read before anything is built, so that the request budget holds it first; 0 where
/// `materialize` refuses the tensor.
pub fn built_bytes(proto: &TensorProto, dtype: i32, shape: &[i64]) -> u64 {
    let n = element_count(shape);
    let bytes = if n == 0 {
        0
    } else if dtype == DT_STRING {
        if proto.tensor_content.is_empty() {
            string_val_frame_size(&proto.string_val, n)
        } else {
            let list = StringList {
                content: &proto.tensor_content,
                n,
            };
            list.frame_size().unwrap_or(0)
        }
    } else if proto.tensor_content.is_empty() {
        itemsize(dtype).map_or(0, |size| n.saturating_mul(size as u64))
    } else {
        0
    };
    // One over the tensor limit is refused as such (INVALID_ARGUMENT, as TensorFlow's).
    if bytes > MAX_TENSOR_BYTES {
        0
    } else {
        bytes
    }
}

/// A string tensor's `tensor_content` as TensorFlow encodes `n` strings there
/// (`port::EncodeStringList`): each one's length as a varint32, then their bytes one after
/// another, exactly filling it. Read twice, never listed: a list of n lengths (n up to the
/// content's size, an empty string taking one byte) was 24 bytes an element before any
/// bound was checked, 12 GiB for a 512 MiB request (found by a review).
struct StringList<'a> {
    content: &'a [u8],
    n: u64,
}

impl<'a> StringList<'a> {
    /// The bytes its strings take as a wire frame (msgpack), or None when it is not `n`
    /// strings in TensorFlow's encoding (`DecodeStringList`'s refusal).
    fn frame_size(&self) -> Option<u64> {
        if self.n > self.content.len() as u64 {
            return None; // each string takes a byte at least (its length)
        }
        let (mut at, mut data, mut frame) = (0usize, 0u64, array_header_size(self.n));
        for _ in 0..self.n {
            let (len, used) = varint32(&self.content[at..])?;
            at += used;
            data = data.checked_add(u64::from(len))?;
            frame = frame.saturating_add(bin_size(u64::from(len)));
        }
        (data == (self.content.len() - at) as u64).then_some(frame)
    }

    /// Its strings in order; only for a list `frame_size` accepted.
    fn values(&self) -> impl Iterator<Item = &'a [u8]> {
        let content = self.content;
        let skip = |at: usize| at + varint32(&content[at..]).map_or(1, |(_, used)| used);
        let mut data = (0..self.n).fold(0, |at, _| skip(at)); // after the n lengths
        let mut length = 0; // where the next length is
        (0..self.n).map(move |_| {
            let (len, used) = varint32(&content[length..]).unwrap_or((0, 1));
            length += used;
            let end = (data + len as usize).min(content.len());
            let value = &content[data..end];
            data = end;
            value
        })
    }
}

/// A varint32 (at most 5 bytes; bits past 32 dropped, as TensorFlow's GetVarint32 does) and
/// the bytes it took.
fn varint32(bytes: &[u8]) -> Option<(u32, usize)> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().take(5).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some((value as u32, i + 1));
        }
    }
    None
}

/// Bytes msgpack spends on an array header of `n` elements.
fn array_header_size(n: u64) -> u64 {
    match n {
        0..16 => 1,
        16..65_536 => 3,
        _ => 5,
    }
}

/// Bytes msgpack spends on a bin element of `len` bytes, header included.
fn bin_size(len: u64) -> u64 {
    len + match len {
        0..256 => 2,
        256..65_536 => 3,
        _ => 5,
    }
}

fn worker_error(what: impl std::fmt::Display) -> ServingError {
    ServingError::new(
        crate::status::Code::Internal,
        format!("a worker sent a bad output tensor: {what}"),
    )
}

/// The element count of an output's shape as a worker declared it.
fn output_elements(shape: &[i64]) -> Result<u64, ServingError> {
    shape.iter().try_fold(1u64, |n, &d| {
        u64::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| worker_error(format!("shape {}", dims_text(shape))))
    })
}

/// An output TensorProto with its dtype and shape and no values yet.
pub(crate) fn output_shell(dtype: i32, shape: &[i64]) -> TensorProto {
    TensorProto {
        dtype,
        tensor_shape: Some(TensorShapeProto {
            dim: shape
                .iter()
                .map(
                    |&size| crate::proto::mpspool::tfs::tensor_shape_proto::Dim {
                        size,
                        name: String::new(),
                    },
                )
                .collect(),
            unknown_rank: false,
        }),
        ..TensorProto::default()
    }
}

/// The values of a worker's DT_STRING frame, which must hold one per element of `shape`.
fn output_strings(shape: &[i64], frame: &Bytes) -> Result<Vec<Bytes>, ServingError> {
    let n = output_elements(shape)?;
    let values = wire::decode_strings(frame).map_err(worker_error)?;
    if values.len() as u64 != n {
        return Err(worker_error(format!(
            "{} strings for shape {}",
            values.len(),
            dims_text(shape)
        )));
    }
    Ok(values)
}

/// Checks that a worker's numeric frame holds exactly `shape` of `dtype`: a client must never
/// get a tensor whose bytes and shape disagree (TensorFlow would refuse to parse it).
fn check_output_frame(dtype: i32, shape: &[i64], frame: &Bytes) -> Result<(), ServingError> {
    let size = itemsize(dtype)
        .ok_or_else(|| worker_error(format!("unsupported dtype {}", dtype_name(dtype))))?;
    let n = output_elements(shape)?;
    if n.checked_mul(size as u64) != Some(frame.len() as u64) {
        return Err(worker_error(format!(
            "{} bytes for shape {} of {}",
            frame.len(),
            dims_text(shape),
            dtype_name(dtype)
        )));
    }
    Ok(())
}

/// A PredictResponse output from a worker's frame: `tensor_content` for numbers, `string_val`
/// for strings (`--enable_serialization_as_tensor_content`). TF Serving would put strings
/// into `tensor_content` too, in TensorFlow's own encoding (each length as a varint, then the
/// bytes); TensorFlow's `Tensor::FromProto` reads either form, but `tf.make_ndarray`, what
/// Python clients call, fails on that one ("cannot create an OBJECT array from memory
/// buffer"), so strings stay in the field every client reads.
pub fn output_tensor(dtype: i32, shape: &[i64], frame: Bytes) -> Result<TensorProto, ServingError> {
    let mut proto = output_shell(dtype, shape);
    if dtype == DT_STRING {
        proto.string_val = output_strings(shape, &frame)?;
    } else {
        check_output_frame(dtype, shape, &frame)?;
        proto.tensor_content = frame;
    }
    Ok(proto)
}

/// A PredictResponse output with its values in the typed field, as TF Serving answers by
/// default (`Tensor::AsProtoField`): clients that read `float_val` and the like directly need
/// this form. Half and bfloat16 go into `half_val` as bit patterns, complex numbers as
/// (real, imaginary) pairs, 8- and 16-bit integers into `int_val`.
pub fn output_tensor_typed(
    dtype: i32,
    shape: &[i64],
    frame: Bytes,
) -> Result<TensorProto, ServingError> {
    let mut proto = output_shell(dtype, shape);
    if dtype == DT_STRING {
        proto.string_val = output_strings(shape, &frame)?;
        return Ok(proto);
    }
    check_output_frame(dtype, shape, &frame)?;
    let f = &frame[..];
    match dtype {
        DT_FLOAT => proto.float_val = decode(f, f32::from_le_bytes),
        DT_DOUBLE => proto.double_val = decode(f, f64::from_le_bytes),
        DT_INT32 => proto.int_val = decode(f, i32::from_le_bytes),
        DT_INT16 => proto.int_val = decode(f, |b| i32::from(i16::from_le_bytes(b))),
        DT_UINT16 => proto.int_val = decode(f, |b| i32::from(u16::from_le_bytes(b))),
        DT_INT8 => proto.int_val = decode(f, |b: [u8; 1]| i32::from(b[0] as i8)),
        DT_UINT8 => proto.int_val = decode(f, |b: [u8; 1]| i32::from(b[0])),
        DT_INT64 => proto.int64_val = decode(f, i64::from_le_bytes),
        DT_UINT32 => proto.uint32_val = decode(f, u32::from_le_bytes),
        DT_UINT64 => proto.uint64_val = decode(f, u64::from_le_bytes),
        DT_BOOL => proto.bool_val = decode(f, |b: [u8; 1]| b[0] != 0),
        DT_HALF | DT_BFLOAT16 => {
            proto.half_val = decode(f, |b| i32::from(u16::from_le_bytes(b)));
        }
        DT_COMPLEX64 => proto.scomplex_val = decode(f, f32::from_le_bytes),
        DT_COMPLEX128 => proto.dcomplex_val = decode(f, f64::from_le_bytes),
        other => return Err(worker_error(format!("unsupported dtype {other}"))),
    }
    Ok(proto)
}

/// Little-endian values of `N` bytes each; `bytes` holds a whole number of them (checked).
fn decode<T, const N: usize>(bytes: &[u8], from: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|chunk| {
            let mut b = [0u8; N];
            b.copy_from_slice(chunk);
            from(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::mpspool::tfs::tensor_shape_proto::Dim;
    use crate::status::Code;
    use crate::wire::unhex;

    fn tensor(dtype: i32, dims: &[i64]) -> TensorProto {
        TensorProto {
            dtype,
            tensor_shape: Some(TensorShapeProto {
                dim: dims
                    .iter()
                    .map(|&size| Dim {
                        size,
                        name: String::new(),
                    })
                    .collect(),
                unknown_rank: false,
            }),
            ..TensorProto::default()
        }
    }

    fn frame(proto: &TensorProto) -> Result<Bytes, ServingError> {
        let (dtype, shape) = declared(proto, "x")?;
        materialize(proto, "x", dtype, &shape)
    }

    #[test]
    fn typed_values_repeat_the_last_one_to_fill_the_shape() {
        let mut t = tensor(DT_INT64, &[2, 2]);
        t.int64_val = vec![1, 2];
        let expect: Vec<u8> = [1i64, 2, 2, 2]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(&frame(&t).unwrap()[..], &expect[..]);
    }

    #[test]
    fn no_values_are_zeros_and_other_fields_are_ignored() {
        let mut t = tensor(DT_INT64, &[3]);
        t.bool_val = vec![true, true, true];
        assert_eq!(&frame(&t).unwrap()[..], &[0u8; 24][..]);
    }

    #[test]
    fn tensor_content_must_be_exact() {
        let mut t = tensor(DT_FLOAT, &[2]);
        t.tensor_content = Bytes::from_static(&[0; 7]);
        let err = frame(&t).unwrap_err();
        assert_eq!(
            err.message,
            "tensor parsing error: input \"x\": tensor_content has 7 bytes, shape [2] of float needs 8"
        );
    }

    #[test]
    fn huge_declared_shapes_are_refused_without_allocating() {
        let mut t = tensor(DT_STRING, &[1 << 21, 16]);
        t.string_val = vec![Bytes::from_static(b"abcdefgh")];
        // 2^25 copies of a 8-byte string: 436 MB of frame, under 2 GiB: allowed. Grow it.
        let mut t2 = t.clone();
        t2.tensor_shape = tensor(DT_STRING, &[1 << 28, 16]).tensor_shape;
        assert!(frame(&t2)
            .unwrap_err()
            .message
            .contains("more than the 2147483648"));
        let mut f = tensor(DT_FLOAT, &[1 << 40]);
        f.float_val = vec![1.0];
        assert!(frame(&f)
            .unwrap_err()
            .message
            .contains("more than the 2147483648"));
        t.tensor_shape = tensor(DT_STRING, &[4]).tensor_shape;
        assert_eq!(wire::decode_strings(&frame(&t).unwrap()).unwrap().len(), 4);
    }

    #[test]
    fn shapes_are_validated() {
        let t = tensor(DT_FLOAT, &[-1]);
        assert!(declared(&t, "x")
            .unwrap_err()
            .message
            .contains("negative dimension"));
        let t = tensor(DT_FLOAT, &[1 << 40, 1 << 40, 0]);
        assert!(declared(&t, "x")
            .unwrap_err()
            .message
            .contains("more than 2^63-1"));
        let t = tensor(99, &[1]);
        assert!(declared(&t, "x")
            .unwrap_err()
            .message
            .contains("unsupported dtype DataType(99)"));
    }

    #[test]
    fn bools_and_narrow_integers() {
        let mut t = tensor(DT_BOOL, &[2]);
        t.tensor_content = Bytes::from_static(&[1, 2]);
        assert!(frame(&t).is_err());
        let mut t = tensor(DT_UINT8, &[2]);
        t.int_val = vec![257, -1];
        assert_eq!(&frame(&t).unwrap()[..], &[1, 255]);
        let mut t = tensor(DT_BFLOAT16, &[1]);
        t.half_val = vec![0x3f80];
        assert_eq!(&frame(&t).unwrap()[..], &[0x80, 0x3f]);
    }

    #[test]
    fn complex_values_are_pairs() {
        let mut t = tensor(DT_COMPLEX64, &[2]);
        t.scomplex_val = vec![1.0, 2.0, 3.0];
        let expect: Vec<u8> = [1.0f32, 2.0, 1.0, 2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(&frame(&t).unwrap()[..], &expect[..]);
    }

    /// tests/vectors/tensor_proto.json: serialized protos and what TensorFlow's C++ parser
    /// makes of them (tests/vectors/make_vectors.py writes it; tests/test_vectors.py checks it
    /// against TensorFlow), or the error the front door must answer.
    #[test]
    fn shared_vectors_parse_as_tensorflow_does() {
        use prost::Message;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/vectors/tensor_proto.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        assert!(cases.len() > 500);
        for case in &cases {
            let name = case["name"].as_str().unwrap();
            let proto =
                TensorProto::decode(Bytes::from(unhex(case["proto"].as_str().unwrap()))).unwrap();
            let expect = &case["expect"];
            let got = frame(&proto);
            if let Some(error) = expect.get("error") {
                let err = got.expect_err(name);
                assert_eq!(err.code, Code::InvalidArgument, "{name}");
                assert!(
                    err.message.contains(error.as_str().unwrap()),
                    "{name}: {}",
                    err.message
                );
                continue;
            }
            let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
            let (dtype, shape) = declared(&proto, "x").unwrap();
            assert_eq!(
                i64::from(dtype),
                expect["dtype"].as_i64().unwrap(),
                "{name}"
            );
            let want_shape: Vec<i64> = expect["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap())
                .collect();
            assert_eq!(shape, want_shape, "{name}");
            // Both output forms, serialized and parsed back by the TensorFlow-checked rules,
            // give the same frame: what the client's make_ndarray will see.
            for output in [output_tensor, output_tensor_typed] {
                let out =
                    output(dtype, &shape, got.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
                let back = TensorProto::decode(out.encode_to_vec().as_slice()).unwrap();
                assert_eq!(frame(&back).unwrap(), got, "{name}: output round trip");
            }
            if let Some(strings) = expect.get("strings") {
                let values = wire::decode_strings(&got).unwrap();
                let want: Vec<Vec<u8>> = strings
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| unhex(s.as_str().unwrap()))
                    .collect();
                let values: Vec<Vec<u8>> = values.iter().map(|v| v.to_vec()).collect();
                assert_eq!(values, want, "{name}");
            } else {
                assert_eq!(
                    got.to_vec(),
                    unhex(expect["content"].as_str().unwrap()),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn string_frames_are_sized_exactly_and_bounded_before_allocating() {
        let long = |n: usize| Bytes::from(vec![b'z'; n]);
        for (values, n) in [
            (vec![], 3usize),
            (vec![Bytes::new()], 15),
            (vec![long(255)], 16),
            (vec![long(1), long(256)], 17),
            (vec![long(65_535), long(3)], 2),
            (vec![long(65_536)], 3),
            (vec![long(2), long(7)], 65_536),
        ] {
            let mut t = tensor(DT_STRING, &[n as i64]);
            t.string_val = values.clone();
            let got = frame(&t).unwrap();
            let mut want: Vec<Bytes> = values.iter().take(n).cloned().collect();
            want.resize(n, values.last().cloned().unwrap_or_default());
            assert_eq!(got.to_vec(), wire::encode_strings(&want), "{n} values");
            let header = array_header_size(n as u64);
            let sizes: u64 = want.iter().map(|v| bin_size(v.len() as u64)).sum();
            assert_eq!(got.len() as u64, header + sizes, "{n} values");
        }
        // 2^30 empty strings: 2 bytes each, one frame of 2^31 + 5 bytes: refused unbuilt.
        let mut t = tensor(DT_STRING, &[1 << 30]);
        t.string_val = vec![Bytes::new()];
        assert!(frame(&t)
            .unwrap_err()
            .message
            .ends_with("needs 2147483653 bytes, more than the 2147483648 one tensor may have"));
    }

    #[test]
    fn outputs_must_match_their_declared_shape() {
        let err = output_tensor(DT_FLOAT, &[2], Bytes::from_static(&[0; 4])).unwrap_err();
        assert_eq!(err.code, Code::Internal);
        assert_eq!(
            err.message,
            "a worker sent a bad output tensor: 4 bytes for shape [2] of float"
        );
        let err = output_tensor_typed(DT_INT8, &[-1], Bytes::new()).unwrap_err();
        assert_eq!(err.code, Code::Internal);
        let strings = Bytes::from(wire::encode_strings(&[b"a".as_slice()]));
        for output in [output_tensor, output_tensor_typed] {
            let err = output(DT_STRING, &[2], strings.clone()).unwrap_err();
            assert_eq!(
                err.message,
                "a worker sent a bad output tensor: 1 strings for shape [2]"
            );
            assert!(output(DT_STRING, &[1], Bytes::from_static(&[0x91])).is_err());
            assert!(output(DT_STRING, &[], strings.clone()).is_ok());
        }
    }

    #[test]
    fn typed_outputs_fill_the_field_tensorflow_fills() {
        let out = output_tensor_typed(DT_INT8, &[2], Bytes::from_static(&[0xff, 1])).unwrap();
        assert_eq!(out.int_val, vec![-1, 1]);
        assert!(out.tensor_content.is_empty());
        let out = output_tensor_typed(DT_UINT8, &[2], Bytes::from_static(&[0xff, 1])).unwrap();
        assert_eq!(out.int_val, vec![255, 1]);
        let out = output_tensor_typed(DT_UINT16, &[1], Bytes::from_static(&[0xff, 0xff])).unwrap();
        assert_eq!(out.int_val, vec![65_535]);
        let out = output_tensor_typed(DT_INT16, &[1], Bytes::from_static(&[0xff, 0xff])).unwrap();
        assert_eq!(out.int_val, vec![-1]);
        // Half and bfloat16: the 16-bit pattern, never sign-extended.
        let out = output_tensor_typed(DT_HALF, &[1], Bytes::from_static(&[0x00, 0xbc])).unwrap();
        assert_eq!(out.half_val, vec![0xbc00]);
        let out = output_tensor_typed(DT_BOOL, &[3], Bytes::from_static(&[1, 0, 1])).unwrap();
        assert_eq!(out.bool_val, vec![true, false, true]);
        let c: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let out = output_tensor_typed(DT_COMPLEX64, &[1], Bytes::from(c)).unwrap();
        assert_eq!(out.scomplex_val, vec![1.5, -2.0]);
        let out = output_tensor_typed(DT_FLOAT, &[0, 3], Bytes::new()).unwrap();
        assert!(out.float_val.is_empty());
        assert_eq!(out.tensor_shape.unwrap().dim.len(), 2);
    }

    #[test]
    fn outputs_carry_bytes_or_strings() {
        let out = output_tensor(DT_FLOAT, &[1], Bytes::from_static(&[0, 0, 128, 63])).unwrap();
        assert_eq!(&out.tensor_content[..], &[0, 0, 128, 63]);
        let strings = Bytes::from(wire::encode_strings(&[b"a".as_slice(), b"bc"]));
        let out = output_tensor(DT_STRING, &[2], strings).unwrap();
        assert_eq!(
            out.string_val,
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")]
        );
    }
}
