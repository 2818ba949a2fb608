"""Read a TensorFlow checkpoint's index (the "tensor bundle" format) to find where each
tensor's bytes lie, so the publisher can read them straight into the weight segment.

TensorFlow's own reader returns each tensor as a fresh array — a second copy of a table
that may be gigabytes, on top of the segment. The bundle format makes that unnecessary:
`variables.index` is a LevelDB-style table mapping each checkpoint key to a
BundleEntryProto (dtype, shape, shard, offset, size, crc32c), and the data shards hold the
tensors' raw little-endian bytes at those offsets.

Table layout (LevelDB's, as TensorFlow writes it: uncompressed blocks): the last 48 bytes
are a footer with the index block's handle and a magic number; the index block maps the
last key of each data block to that block's handle; a block is a run of prefix-compressed
entries followed by restart offsets, and each block on disk is followed by a 5-byte
trailer (compression type, crc).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_TRAILER_SIZE = 5
NO_COMPRESSION = 0


class BundleError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise BundleError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _handle(buf: bytes, pos: int) -> tuple[int, int, int]:
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


def _block(data: bytes, offset: int, size: int) -> bytes:
    if offset + size + BLOCK_TRAILER_SIZE > len(data):
        raise BundleError("block beyond the end of the index file")
    if data[offset + size] != NO_COMPRESSION:
        raise BundleError(f"compressed index block (type {data[offset + size]}) not supported")
    return data[offset : offset + size]


def _entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * num_restarts
    pos = 0
    key = b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        value_len, pos = _varint(block, pos)
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + value_len]
        pos += value_len


def _items(prefix: str | Path) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of `<prefix>.index`, in order."""
    data = Path(f"{prefix}.index").read_bytes()
    if len(data) < FOOTER_SIZE:
        raise BundleError(f"{prefix}.index is too short to be a checkpoint index")
    footer = data[-FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, FOOTER_SIZE - 8)
    if magic != TABLE_MAGIC:
        raise BundleError(f"{prefix}.index is not a checkpoint index (bad magic)")
    _, _, pos = _handle(footer, 0)  # metaindex: unused
    index_offset, index_size, _ = _handle(footer, pos)
    for _, handle in _entries(_block(data, index_offset, index_size)):
        offset, size, _ = _handle(handle, 0)
        yield from _entries(_block(data, offset, size))


def read_index(prefix: str | Path) -> tuple[int, dict[str, Any]]:
    """The number of data shards, and checkpoint key → tensorflow BundleEntryProto, from
    `<prefix>.index`. A variable stored in slices (TF1's partitioned variables; a TF2
    checkpoint saved with a shard size policy) has an entry listing them: `read_slices`
    says where each one lies."""
    # mpspool's wire-compatible copies of TensorFlow's messages: no TensorFlow import.
    from mpspool.protos import tensorflow_pb2 as tensor_bundle_pb2

    entries: dict[str, Any] = {}
    shards = 0
    for key, value in _items(prefix):
        if key.startswith(SLICE_KEY_START):
            continue  # one slice of a variable (`read_slices`)
        if key:
            entries[key.decode()] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
        else:  # the empty key holds the BundleHeaderProto
            shards = tensor_bundle_pb2.BundleHeaderProto.FromString(value).num_shards
    if not shards:
        raise BundleError(f"{prefix}.index has no header entry")
    return shards, entries


# A slice's key: TensorFlow's EncodeTensorNameSlice (saved_tensor_slice_util.cc) in its
# OrderedCode (ordered_code.cc): the number 0, the variable's key, the number of
# dimensions, then each dimension's start and length (-1: the whole dimension).
SLICE_KEY_START = b"\x00"
Extents = tuple[tuple[int, int], ...]


def read_slices(prefix: str | Path) -> dict[tuple[str, Extents], Any]:
    """Each stored slice of a variable: (its variable's key, each dimension's (start,
    length), length -1 for a whole dimension) → its BundleEntryProto (shard, offset, size,
    checksum), so that the publisher reads each straight into its place, as it reads a
    whole variable, instead of TensorFlow's reader assembling a fresh copy of the variable
    (a 1 GiB table: a 2.9 GiB publisher; found by a hunt)."""
    from mpspool.protos import tensorflow_pb2 as tensor_bundle_pb2

    slices = {}
    for key, value in _items(prefix):
        if key.startswith(SLICE_KEY_START):
            name, extents = decode_slice_key(key)
            slices[(name, extents)] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
    return slices


def decode_slice_key(key: bytes) -> tuple[str, Extents]:
    zero, pos = _read_num_increasing(key, 0)
    if zero != 0:
        raise BundleError("a slice key that does not start with 0")
    name, pos = _read_string(key, pos)
    dims, pos = _read_num_increasing(key, pos)
    extents = []
    for _ in range(dims):
        start, pos = _read_signed_num_increasing(key, pos)
        length, pos = _read_signed_num_increasing(key, pos)
        extents.append((start, length))
    if pos != len(key):
        raise BundleError("a slice key with bytes after its last extent")
    return name.decode(), tuple(extents)


def _read_num_increasing(key: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's unsigned number: a length byte, then that many big-endian bytes."""
    if pos >= len(key) or pos + 1 + key[pos] > len(key) or key[pos] > 8:
        raise BundleError("a truncated number in a slice key")
    length = key[pos]
    return int.from_bytes(key[pos + 1 : pos + 1 + length], "big"), pos + 1 + length


def _read_string(key: bytes, pos: int) -> tuple[bytes, int]:
    """OrderedCode's string: 0x00 written 0x00 0xff, 0xff written 0xff 0x00, ended by
    0x00 0x01."""
    out = bytearray()
    while pos + 1 < len(key):
        byte, following = key[pos], key[pos + 1]
        if byte == 0x00 and following == 0x01:
            return bytes(out), pos + 2
        if byte == 0x00 and following == 0xFF:
            out.append(0x00)
            pos += 2
        elif byte == 0xFF and following == 0x00:
            out.append(0xFF)
            pos += 2
        elif byte in (0x00, 0xFF):
            raise BundleError("a badly escaped string in a slice key")
        else:
            out.append(byte)
            pos += 1
    raise BundleError("an unterminated string in a slice key")


# OrderedCode's signed numbers: the bits of the encoding's header, by its length in bytes.
_LENGTH_TO_MASK = (
    0, 0x80, 0xC000, 0xE00000, 0xF0000000, 0xF800000000, 0xFC0000000000, 0xFE000000000000,
    0xFF00000000000000, 0x8000000000000000, 0,
)  # fmt: skip


def _read_signed_num_increasing(key: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's signed number (ReadSignedNumIncreasing): its length in the leading bits
    of its first bytes (inverted for a negative number), then its two's complement."""
    if pos >= len(key):
        raise BundleError("a truncated number in a slice key")
    xor_mask = 0 if key[pos] & 0x80 else 0xFFFFFFFFFFFFFFFF
    first = key[pos] ^ (xor_mask & 0xFF)
    if first != 0xFF:
        length = 7 - ((first ^ 0xFF).bit_length() - 1)
        if pos + length > len(key):
            raise BundleError("a truncated number in a slice key")
        x = xor_mask
        for byte in key[pos : pos + length]:
            x = ((x << 8) | byte) & 0xFFFFFFFFFFFFFFFF
    else:
        length = 8
        if pos + 2 > len(key):
            raise BundleError("a truncated number in a slice key")
        second = key[pos + 1] ^ (xor_mask & 0xFF)
        if second >= 0x80:
            if second < 0xC0:
                length = 9
            elif second == 0xC0 and pos + 3 <= len(key) and key[pos + 2] ^ (xor_mask & 0xFF) < 0x80:
                length = 10
            else:
                raise BundleError("a number in a slice key past 64 bits")
        if pos + length > len(key):
            raise BundleError("a truncated number in a slice key")
        x = int.from_bytes(key[pos + length - 8 : pos + length], "big")
    x ^= _LENGTH_TO_MASK[length]
    return (x - (1 << 64) if x >= 1 << 63 else x), pos + length


def shard_path(prefix: str | Path, shard_id: int, num_shards: int) -> Path:
    return Path(f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}")
