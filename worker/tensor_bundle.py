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


def read_index(prefix: str | Path) -> tuple[int, dict[str, Any]]:
    """The number of data shards, and checkpoint key → tensorflow BundleEntryProto, from
    `<prefix>.index`."""
    # mpspool's wire-compatible copies of TensorFlow's messages: no TensorFlow import.
    from mpspool.protos import tensorflow_pb2 as tensor_bundle_pb2

    data = Path(f"{prefix}.index").read_bytes()
    if len(data) < FOOTER_SIZE:
        raise BundleError(f"{prefix}.index is too short to be a checkpoint index")
    footer = data[-FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, FOOTER_SIZE - 8)
    if magic != TABLE_MAGIC:
        raise BundleError(f"{prefix}.index is not a checkpoint index (bad magic)")
    _, _, pos = _handle(footer, 0)  # metaindex: unused
    index_offset, index_size, _ = _handle(footer, pos)
    entries: dict[str, Any] = {}
    shards = 0
    for _, handle in _entries(_block(data, index_offset, index_size)):
        offset, size, _ = _handle(handle, 0)
        for key, value in _entries(_block(data, offset, size)):
            if key.startswith(b"\x00"):
                # A slice of a partitioned variable (TensorFlow's binary slice-key encoding):
                # its variable's own entry lists the slices, and only TensorFlow's reader
                # assembles them.
                continue
            if key:
                entries[key.decode()] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
            else:  # the empty key holds the BundleHeaderProto
                shards = tensor_bundle_pb2.BundleHeaderProto.FromString(value).num_shards
    if not shards:
        raise BundleError(f"{prefix}.index has no header entry")
    return shards, entries


def shard_path(prefix: str | Path, shard_id: int, num_shards: int) -> Path:
    return Path(f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}")
