"""The weight segment: one model version's variables in one shared-memory file.

The publisher (worker/publish.py, run once per version by the controller) writes it; every
worker maps it and binds its variables to views of it without copying. Layout:

    [0:16)   magic  b"MPSPOOL-WEIGHTS1"
    [16:24)  little-endian uint64: length of the manifest
    [24:..)  manifest, JSON
    [data_offset:..)  the tensors, each at a 64-byte-aligned offset

64-byte alignment is not cosmetic: TensorFlow's kernels require its 64-byte
EIGEN_MAX_ALIGN_BYTES. A misaligned numpy array handed to TensorFlow is copied on every
call (numpy's default 16 bytes made it copy the whole table each time), and a misaligned
DLPack buffer is adopted as it is and aborts the process at the first kernel, so
AttachedSegment refuses one. The data section starts on a page boundary.

The manifest names the owner (the controller's pid and start time) so that a segment left
by a pool that died can be recognised and removed by the next one. A pid says nothing across
PID namespaces (containers sharing /dev/shm, a container restarted in its pod), so a segment
in use is also held: a shared flock, taken by its publisher while it writes and by its pool's
controller while it serves (`hold`), which ends with the process however it dies. Segments
are mode 0600.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import mmap
import os
import re
import shutil
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import psutil

from mpspool import dtypes, process
from mpspool.errors import Code, code_of_os_error

MAGIC = b"MPSPOOL-WEIGHTS1"
_HEADER = struct.Struct("<16sQ")
ALIGN = 64
PAGE = mmap.PAGESIZE
SHM_DIR = Path("/dev/shm")
PREFIX = "mpspool-"


class SegmentError(RuntimeError):
    """A segment that cannot be made or read; the message says what and where, ``code`` the
    status it is reported with (GetModelStatus of a version whose weights it held back)."""

    def __init__(self, message: str, code: Code = Code.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TensorEntry:
    key: str  # the checkpoint key, e.g. "embedding/.ATTRIBUTES/VARIABLE_VALUE"
    dtype: int  # TensorFlow DataType number (bfloat16 has no numpy dtype string)
    shape: tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    owner_pid: int
    owner_started: float  # process.started_at of the owner: pids get reused
    tensors: tuple[TensorEntry, ...]
    # Checkpointed values that are not plain variables (hash tables, ...): they cannot be
    # shared, and a worker refuses the model rather than serve it without them.
    unshared: tuple[str, ...] = ()
    data_offset: int = 0
    format: int = 1
    extra: dict = field(default_factory=dict)
    # The owner's PID namespace (pid_namespace()): its pid means something only there.
    owner_pid_ns: int = 0

    @property
    def data_bytes(self) -> int:
        return max((t.offset + t.nbytes for t in self.tensors), default=0)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("its manifest is no JSON object")
        tensors = tuple(
            TensorEntry(t["key"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
            for t in data.pop("tensors")
        )
        data["unshared"] = tuple(data.get("unshared", ()))
        return cls(tensors=tensors, **data)


# A segment written this recently is never taken for a dead pool's: see remove_stale.
STALE_MIN_AGE_S = 30.0
# Between a partitioned variable's checkpoint key and one slice's spec, in the key of that
# slice's entry ("emb@10 4 4,3:0,4"): no checkpoint key holds it.
SLICE_MARK = "@"


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def segment_path(
    pool_id: str, model: str, version: int, key: str = "", shm_dir: Path = SHM_DIR
) -> Path:
    """Where a version's weights are published. With ``key`` (the pool's secret, kept in its
    private run directory) the name ends in a keyed digest of the model and version: every
    local user can list /dev/shm, and one who read version 1's name could otherwise create
    version 2's (or its ".partial") first, and version 2 would never load: the publisher
    creates its file exclusively, and a rename over another user's file in the sticky
    /dev/shm is refused."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model)
    name = f"{PREFIX}{pool_id}-{safe}-v{version}"
    if key:
        digest = hmac.new(key.encode(), f"{model}\0{version}".encode(), "sha256").hexdigest()
        name += f"-{digest[:16]}"
    return shm_dir / name


def plan(
    model: str,
    version: int,
    owner_pid: int,
    owner_started: float,
    tensors: Iterable[tuple[str, int, tuple[int, ...]]],
    unshared: Iterable[str] = (),
    same_as: dict[str, str] | None = None,
    extra: dict | None = None,
) -> Manifest:
    """Offsets for each (key, DataType, shape), 64-byte aligned, and where data starts.

    `same_as` maps a key to an earlier key whose bytes are identical (Keras 3's `export()`
    saves each variable under two checkpoint keys): it gets that key's offset, so /dev/shm
    (which is RAM) holds the tensor once."""
    same_as = same_as or {}
    entries = []
    by_key: dict[str, TensorEntry] = {}
    offset = 0
    for key, dt, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtypes.numpy_dtype(dt).itemsize
        original = by_key.get(same_as.get(key, ""))
        if original is not None:
            entry = TensorEntry(key, int(dt), tuple(int(d) for d in shape), original.offset, nbytes)
        else:
            offset = _align(offset, ALIGN)
            entry = TensorEntry(key, int(dt), tuple(int(d) for d in shape), offset, nbytes)
            offset += nbytes
        entries.append(entry)
        by_key[key] = entry
    manifest = Manifest(
        model,
        version,
        owner_pid,
        owner_started,
        tuple(entries),
        tuple(unshared),
        extra=dict(extra or {}),
        owner_pid_ns=pid_namespace(),
    )
    data_offset = _align(_HEADER.size + len(manifest.to_json()) + 64, PAGE)
    # The manifest's own length depends on data_offset's digits: leave room, then fix it.
    return replace(manifest, data_offset=data_offset)


def check_space(need: int, shm_dir: Path = SHM_DIR) -> None:
    free = shutil.disk_usage(shm_dir).free
    if need > free:
        raise SegmentError(
            f"shared memory too small: need {_mib(need)}, {shm_dir} has {_mib(free)} free "
            "(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory at /dev/shm)",
            Code.RESOURCE_EXHAUSTED,
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _allocate(fd: int, size: int, path: Path) -> None:
    """Give the file behind ``fd`` all its ``size`` bytes of /dev/shm now. A file only
    truncated to its size gets its pages as they are first written, through a mapping: if
    another user of /dev/shm took the room since check_space looked, that write is a SIGBUS
    that kills the process with nothing said; here it is this error."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = shutil.disk_usage(path.parent).free
        raise SegmentError(
            f"shared memory too small: need {_mib(size)} for {path.name}, {path.parent} has "
            f"{_mib(free)} free ({exc.strerror}; docker: --shm-size; Kubernetes: an emptyDir "
            "with medium: Memory at /dev/shm)",
            Code.RESOURCE_EXHAUSTED,
        ) from exc


class SegmentWriter:
    """Create a segment under a temporary name; `commit()` renames it into place, so a
    reader never sees a half-written one."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.total = manifest.data_offset + manifest.data_bytes
        check_space(self.total, path.parent)
        self._tmp = path.with_name(path.name + ".partial")
        try:
            fd = os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # taken (another publisher's, or a user's), or not allowed
            raise SegmentError(
                f"cannot create weight segment {self._tmp}: {exc}", code_of_os_error(exc)
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while it is written (see the module's doc)
            _allocate(fd, max(self.total, 1), path)
            self._map = mmap.mmap(fd, max(self.total, 1))
        except BaseException as exc:
            os.close(fd)
            self._tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):  # mmap's ENOMEM (a ulimit -v), say
                raise SegmentError(
                    f"cannot map weight segment {self._tmp}: {exc}", code_of_os_error(exc)
                ) from exc
            raise
        self._held: int | None = fd
        raw = manifest.to_json()
        _HEADER.pack_into(self._map, 0, MAGIC, len(raw))
        self._map[_HEADER.size : _HEADER.size + len(raw)] = raw
        self._entries = {t.key: t for t in manifest.tensors}

    def view(self, key: str) -> np.ndarray:
        """The writable destination of one tensor."""
        entry = self._entries[key]
        start = self.manifest.data_offset + entry.offset
        dtype = dtypes.numpy_dtype(entry.dtype)
        count = entry.nbytes // dtype.itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(entry.shape)

    def commit(self) -> Path:
        self._entries.clear()
        self._map.flush()
        self._map.close()
        try:
            os.rename(self._tmp, self.path)
        except OSError as exc:  # said as the segment's: it read as a checkpoint's before
            raise SegmentError(
                f"cannot publish weight segment {self.path}: {exc}", code_of_os_error(exc)
            ) from exc
        held, self._held = self._held, None
        if held is not None:
            os.close(held)  # the controller holds it from now on (`hold`)
        return self.path

    def abort(self) -> None:
        """Removes the half-written segment; safe after a commit (a SIGTERM's SystemExit may
        come at any point of one)."""
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        self._tmp.unlink(missing_ok=True)
        held, self._held = self._held, None
        if held is not None:
            os.close(held)


def hold(path: Path) -> int:
    """A shared lock on the segment at ``path`` for as long as the returned descriptor is
    open (close it to let go): `remove_stale` leaves a held segment alone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def removed(held_fd: int) -> bool:
    """Whether the segment held by ``held_fd`` (`hold`) no longer has a name: someone
    unlinked it (a cleanup of /dev/shm, `rm`). Workers mapping it keep serving from it;
    one started now would find nothing to map."""
    return os.fstat(held_fd).st_nlink == 0


def restore(held_fd: int, path: Path) -> int:
    """Write the removed segment held by ``held_fd`` back at ``path`` (its content copied
    in the kernel, under a ".partial" name renamed into place as a publisher does) and
    return the hold on the new file; the caller closes the old one. SegmentError when
    /dev/shm has no room or the copy fails; nothing is left behind then. The old pages stay
    while workers map them: until those workers are replaced the segment takes twice its
    size."""
    size = os.fstat(held_fd).st_size
    check_space(size, path.parent)
    partial = path.with_name(path.name + ".partial")
    try:
        out = os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SegmentError(f"cannot write {partial}: {exc}") from exc
    try:
        fcntl.flock(out, fcntl.LOCK_SH)  # held while it is written, as a publisher's
        if size:
            _allocate(out, size, path)
        copied = 0
        while copied < size:
            n = os.copy_file_range(held_fd, out, size - copied, copied, copied)
            if n == 0:
                raise SegmentError(f"{path}: the held segment ended after {copied} bytes")
            copied += n
        os.rename(partial, path)
        try:
            return hold(path)
        except BaseException:
            path.unlink(missing_ok=True)  # unheld, another pool's start could take it
            raise
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SegmentError(f"cannot restore {path}: {exc}") from exc
        raise
    finally:
        os.close(out)


def held(path: Path) -> bool:
    """Whether any process holds ``path`` (`hold`, or its publisher writing it)."""
    try:
        fd = _lock_unless_held(path)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)  # and with it the exclusive lock
    return False


def _lock_unless_held(path: Path) -> int | None:
    """A descriptor holding ``path`` exclusively, or None when someone holds it; OSError when
    it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_manifest(path: Path) -> Manifest:
    try:
        with open(path, "rb") as f:
            magic, length = _HEADER.unpack(f.read(_HEADER.size))
            if magic != MAGIC:
                raise SegmentError(f"{path} is not an mpspool weight segment")
            if length > os.fstat(f.fileno()).st_size - _HEADER.size:
                # Read as asked, a length of 2**63 raised OverflowError, which nothing
                # caught: the controller's start (removing stale segments) failed on a
                # stray file (found by a review).
                raise SegmentError(f"{path}: its manifest's length runs past its end")
            return Manifest.from_json(f.read(length))
    except (
        OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError,
    ) as exc:  # fmt: skip
        # A stray file's manifest of any shape; RecursionError: JSON nested deeper than the
        # parser goes.
        raise SegmentError(f"cannot read weight segment {path}: {exc}") from None


class AttachedSegment:
    """A segment mapped copy-on-write: views are writable (DLPack requires it) but a write
    lands in this process's private copy, never in the shared pages other workers read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        try:
            self._map = np.memmap(path, mode="c")
        except (OSError, ValueError) as exc:
            raise SegmentError(f"cannot map weight segment {path}: {exc}") from None
        self.base = self._map.ctypes.data
        self.size = self._map.size
        end = self.manifest.data_offset + self.manifest.data_bytes
        if self.size < end:
            raise SegmentError(
                f"weight segment {path} is truncated: {self.size} bytes, its manifest needs {end}"
            )
        # TensorFlow adopts a DLPack buffer as it is and aborts the process (Check failed:
        # IsAligned()) when a kernel meets one that is not 64-byte aligned.
        start = self.base + self.manifest.data_offset
        misaligned = [t.key for t in self.manifest.tensors if (start + t.offset) % ALIGN]
        if misaligned:
            raise SegmentError(
                f"weight segment {path} has tensors not aligned to {ALIGN} bytes: "
                + ", ".join(misaligned)
            )

    def view(self, entry: TensorEntry) -> np.ndarray:
        start = self.manifest.data_offset + entry.offset
        raw = self._map[start : start + entry.nbytes]
        return raw.view(dtypes.numpy_dtype(entry.dtype)).reshape(entry.shape)

    def contains(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


def owner_alive(manifest: Manifest) -> bool:
    try:
        same = process.is_process_started_at(manifest.owner_pid, manifest.owner_started)
        return same and psutil.Process(manifest.owner_pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError, ValueError, IndexError, TypeError):
        return False  # TypeError: a stray file's owner fields of another type


def remove_stale(shm_dir: Path = SHM_DIR, min_age_s: float = STALE_MIN_AGE_S) -> list[Path]:
    """Unlink this user's segments whose owning pool is gone (killed, crashed): its owner's
    pid names no live process of its start time here, no process holds it (an owner in
    another PID namespace, whose pid means nothing here, still does), and it was last
    written ``min_age_s`` ago or more when its owner was not in this PID namespace: between
    its publisher's end and its controller's hold, and between its creation and its
    publisher's lock, nobody holds a live one."""
    removed = []
    uid = os.getuid()
    now = time.time()
    for path in shm_dir.glob(f"{PREFIX}*"):
        try:
            info = path.lstat()  # not stat(): a symlink must not pass for its target
        except OSError:
            continue
        if info.st_uid != uid or not stat.S_ISREG(info.st_mode):
            continue  # a directory, a link, another user's: never ours to remove
        try:
            # A ".partial" one too: its header is written first, naming its owner.
            manifest: Manifest | None = read_manifest(path)
        except SegmentError:
            manifest = None  # no manifest to name an owner: stale, unless held
        if manifest is not None and owner_alive(manifest):
            continue
        # An owner in this PID namespace is dead for sure (a pool killed and started again
        # at once gets its memory back at once); another's may live, with a gap in its holds.
        ours = manifest is not None and manifest.owner_pid_ns == pid_namespace() != 0
        if not ours and now - info.st_mtime < min_age_s:
            continue
        if _unlink_unless_held(path):
            removed.append(path)
    return removed


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid); 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _unlink_unless_held(path: Path) -> bool:
    """Unlink ``path`` while holding it exclusively (so no hold can begin between the look
    and the unlink); False when someone holds it or it cannot be removed."""
    try:
        fd = _lock_unless_held(path)
    except OSError:
        return False
    if fd is None:
        return False
    try:
        path.unlink()
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
