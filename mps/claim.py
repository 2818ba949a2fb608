"""A pool's claim on its GPUs: one pool per GPU on a host.

Two pools given the same GPU each ran an MPS control daemon for it, and each sized its
contexts' memory (and MPS's pinned-memory limit) as if it had the GPU alone: the second
pool's MPS server is refused on a GPU in EXCLUSIVE_PROCESS mode (the mode MPS is run in),
and in the other modes the two pools' workers share the GPU's memory twice over. So a start
takes an exclusive lock per GPU, by UUID, held as long as its controller lives (flock: a
pool killed outright frees it with its process), and a start that finds a GPU held is
refused, naming the pool that holds it.

The lock files live in /dev/shm beside the pools' weight segments (a tmpfs every process of
a host, or of a pod, shares), private to their user (0600). A pool removes its own at exit;
one killed outright leaves an unlocked file that the next start takes over. Their names
start "mpspool." so that nothing looking for stale weight segments ("mpspool-") meets them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

from mpspool.config import ConfigError

CLAIM_DIR = Path("/dev/shm")


class GpuClaimed(ConfigError):
    """A GPU this start selected is another running pool's (``holder``: its run dir)."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def claim_path(uuid: str, claim_dir: Path = CLAIM_DIR) -> Path:
    # UUIDs are "GPU-<hex>" or "MIG-<hex>"; anything else (a test's fake) is made a name.
    return claim_dir / f"mpspool.gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', uuid)}.claim"


class GpuClaims:
    """The locks a pool holds on its GPUs (GPU index and UUID each), its run dir written in
    each, so that a refused start can say which pool holds the GPU."""

    def __init__(self, claim_dir: Path = CLAIM_DIR) -> None:
        self.claim_dir = claim_dir
        self._held: list[tuple[Path, int]] = []

    def take(self, gpus: list[tuple[int, str]], run_dir: Path) -> None:
        """Lock every GPU or none: GpuClaimed for one another pool holds (ConfigError when
        the lock file cannot be had), the ones taken before it released again."""
        try:
            for index, uuid in gpus:
                self._held.append(self._take_one(index, uuid, run_dir))
        except BaseException:
            self.release()
            raise

    def _take_one(self, index: int, uuid: str, run_dir: Path) -> tuple[Path, int]:
        path = claim_path(uuid, self.claim_dir)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                whose = (
                    " (another user's: their pool may be using the GPU; remove the file if none is)"
                    if exc.errno in (errno.EACCES, errno.EPERM)
                    else ""
                )
                raise ConfigError(
                    f"GPU {index} ({uuid}): cannot open its lock file {path}: {exc.strerror}{whose}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip()
                os.close(fd)
                raise GpuClaimed(
                    f"GPU {index} ({uuid}) is in use by the pool running with --run-dir "
                    f"{holder or '(not yet written)'}: give each pool its own GPUs (--gpus)",
                    holder,
                ) from None
            # Its last holder may have removed the file between our open and our lock:
            # a lock on a removed file claims nothing, so take the file now there.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            owner = os.fstat(fd).st_uid
            if same and owner != os.getuid():
                # Another user's file that no pool holds (theirs ended, or it was put there
                # to be adopted: written to, it stayed theirs and readable by all; found by
                # a hunt). Replaced while locked, so no start takes the one going away.
                try:
                    path.unlink()
                except OSError as exc:
                    os.close(fd)
                    raise ConfigError(
                        f"GPU {index} ({uuid}): its lock file {path} belongs to uid {owner} "
                        f"and no pool holds it, but cannot be replaced ({exc.strerror}): "
                        "remove it"
                    ) from None
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(run_dir).encode())
        return path, fd

    def release(self) -> None:
        """Remove the lock files, then let go of the locks (in that order: a start that
        opened one meanwhile finds it removed once it has the lock, and takes a new one)."""
        while self._held:
            path, fd = self._held.pop()
            try:
                path.unlink()
            except OSError:
                pass
            os.close(fd)
