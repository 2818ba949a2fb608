"""The pool's private run directory: sockets, the supervisord configuration, pool.json.

0700 and owned by the user, because its unix sockets are the admin interface: whoever
can reach them controls the pool. One pool per run directory; a directory left by a pool
that died is recognised (its controller pid is gone) and cleaned before reuse.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import psutil

from mpspool import process
from mpspool.config import ConfigError

CONTROLLER_FILE = "controller.json"


class PoolRunning(ConfigError):
    pass


def read_controller(run_dir: Path) -> dict | None:
    """What the controller file of ``run_dir`` says; None when there is none (or it was
    cut short). ConfigError when the directory cannot be read (not a directory, another
    user's): `status`, `stop` and `timeline` said so with a traceback."""
    try:
        return json.loads((run_dir / CONTROLLER_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    except OSError as exc:
        raise ConfigError(f"run dir {run_dir}: {exc.strerror or exc}") from None


def controller_alive(info: dict | None) -> bool:
    if not info:
        return False
    try:
        pid = int(info["pid"])
        same = process.is_process_started_at(pid, float(info["started"]))
        return same and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError, KeyError, ValueError, TypeError, IndexError):
        return False


def absolute(run_dir: Path) -> Path:
    """``run_dir`` made absolute with its parents resolved but not itself: a link there is
    for `prepare` and `check_owned` to see, not to follow."""
    path = Path(os.path.abspath(run_dir))
    return path.parent.resolve() / path.name if path.name else path


def _not_a_link(run_dir: Path) -> os.stat_result:
    """``run_dir``'s own stat, not followed through a link: another user's link at the
    default /tmp/mpspool-<uid> (where XDG_RUNTIME_DIR is unset) made the pool clean a
    directory of their choosing (found by a hunt). ConfigError for a link."""
    st = run_dir.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"run dir {run_dir} is a symbolic link: pass the directory itself as --run-dir"
        )
    return st


def _check_uid(run_dir: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"run dir {run_dir} belongs to uid {st.st_uid}, not to you ({os.getuid()})"
        )


def check_owned(run_dir: Path) -> None:
    """ConfigError unless ``run_dir`` is a directory of this user, not a link (when it
    exists): what `mpspool stop` acts on, as it may signal the pid its controller file
    names. Another user's link or directory at the default /tmp/mpspool-<uid> could name
    any process."""
    try:
        st = _not_a_link(run_dir)
    except FileNotFoundError:
        return
    _check_uid(run_dir, st)


def prepare(run_dir: Path) -> bool:
    """Create (or check and clean) the run directory; True if it is a pool's to remove at
    exit: this call created it, or a dead pool that had created it left it behind."""
    created = False
    try:
        run_dir.mkdir(mode=0o700, parents=True)
        created = True
    except FileExistsError:
        pass
    st = _not_a_link(run_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"run dir {run_dir} is not a directory")
    _check_uid(run_dir, st)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(
            f"run dir {run_dir} has mode {stat.S_IMODE(st.st_mode):04o}; it must be private: "
            f"chmod 700 {run_dir}, or pass another --run-dir"
        )
    _hold(run_dir, created)
    info = read_controller(run_dir)
    if controller_alive(info):
        raise PoolRunning(
            f"a pool is already running in {run_dir} (pid {info['pid']}); "
            f"stop it with `mpspool stop --run-dir {run_dir}` or pass another --run-dir"
        )
    if info and info.get("created_run_dir"):
        created = True  # inherited from the dead pool that made it
    if info:  # a pool ran here and its controller is gone: its processes may not be yet
        _wait_for_dead_pools_processes(run_dir)
    clean(run_dir)  # whatever a dead pool left behind
    return created


# Held (flock) by the start that prepared the run directory, for its process's life: two
# starts at once both found no live controller there (its file is written after `prepare`,
# and both waited for the same dead pool's processes), and each cleaned the other's files
# (found by a hunt). Not one of POOL_FILES: a start's clean must not remove its own.
LOCK_FILE = ".mpspool-lock"
_held: tuple[Path, int] | None = None


# What a start refused by the lock writes in the lock file when it made the run dir: the
# start that holds it then removes the directory at its exit, as its maker would have (the
# lock, not the mkdir, decides which start runs: a review found the empty directory left).
MADE_BY_A_REFUSED_START = b"made"


def _hold(run_dir: Path, created: bool) -> None:
    """Lock ``run_dir`` for this process: PoolRunning when another holds it."""
    global _held
    if _held is not None and _held[0] == run_dir:
        return
    path = run_dir / LOCK_FILE
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if created:
                os.pwrite(fd, MADE_BY_A_REFUSED_START, 0)
            os.close(fd)
            raise PoolRunning(
                f"a pool is already running or starting in {run_dir}; stop it with "
                f"`mpspool stop --run-dir {run_dir}` or pass another --run-dir"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            _held = (run_dir, fd)
            return
        os.close(fd)  # a pool leaving removed that file meanwhile: lock the one there now
    raise PoolRunning(f"the run dir {run_dir} is being taken and left: try again")


def release(run_dir: Path) -> bool:
    """At the pool's exit, before its run directory is removed: the lock file goes, then
    the lock (a start that opened the file meanwhile sees it gone, and takes the next).
    Whether a start this pool's lock refused had made the directory (`_hold`)."""
    global _held
    fd = _held[1] if _held is not None and _held[0] == run_dir else None
    made = fd is not None and os.pread(fd, len(MADE_BY_A_REFUSED_START), 0) == (
        MADE_BY_A_REFUSED_START
    )
    (run_dir / LOCK_FILE).unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)
        _held = None
    return made


# Set in the environment of a pool's supervisord, and so of every program it runs (front door,
# workers, MPS daemons): the run directory they belong to, so that a start can find the
# processes a killed pool left running there.
RUN_DIR_ENV = "MPSPOOL_RUN_DIR"

# How long a start waits for the processes of a pool whose controller died to end: its
# supervisord stops them (the front door drains first) once it sees its parent gone.
DEAD_POOL_WAIT_S = 60.0


def _wait_for_dead_pools_processes(run_dir: Path) -> None:
    """Wait until no process of a dead pool runs for ``run_dir``: PoolRunning if one still
    does after DEAD_POOL_WAIT_S. A controller killed outright leaves its supervisord, front
    door and workers stopping for some seconds; they own the sockets and files there, and
    supervisord removes its socket and pid file as it exits. Cleaned under them, a start at
    once (a restart loop's) had its own socket removed by the dead pool's supervisord, and
    failed (found by an operator test)."""
    running = _pool_processes(run_dir)
    if not running:
        return
    pids = ", ".join(str(p.pid) for p in running)
    print(
        f"mpspool: waiting for processes of a pool that ended in {run_dir} to end (pids {pids})",
        file=sys.stderr,
        flush=True,
    )
    try:
        _, alive = psutil.wait_procs(running, timeout=DEAD_POOL_WAIT_S)
    except KeyboardInterrupt:  # Ctrl-C while waiting: nothing was started
        raise SystemExit(130) from None
    if alive:
        pids = ", ".join(str(p.pid) for p in alive)
        raise PoolRunning(
            f"processes of a pool that ended are still running in {run_dir} after "
            f"{DEAD_POOL_WAIT_S:.0f} s (pids {pids}); end them, or pass another --run-dir"
        )


def _pool_processes(run_dir: Path) -> list[psutil.Process]:
    """The processes of a pool of ``run_dir`` (RUN_DIR_ENV names it in their environment),
    this one and its ancestors aside."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in mine and proc.environ().get(RUN_DIR_ENV) == str(run_dir):
                found.append(proc)
        except psutil.Error:  # gone, a zombie, or not ours to look at
            continue
    return found


def write_controller(run_dir: Path, info: dict) -> None:
    path = run_dir / CONTROLLER_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


# Every name a pool creates in its run directory. Only these are ever removed: the
# directory may be one the user chose, holding files of their own.
POOL_FILES = (
    "pool.json",
    CONTROLLER_FILE,
    "supervisord.conf",
    "supervisord.sock",
    "supervisord.pid",
    "workers.ipc",
    "control.ipc",
    "admin.ipc",
)


# Directories a pool makes there: the MPS daemons' pipe and log directories, and the workers'
# rewritten copies of the model (worker/gather_rewrite.py; links to the model's files).
POOL_DIRS = ("mps", "models")
MODELS_DIR = "models"


def clean(run_dir: Path) -> None:
    """Remove every file a pool makes in its run directory (not the directory itself)."""
    for name in POOL_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in POOL_FILES:
        (run_dir / name).unlink(missing_ok=True)
        (run_dir / name).with_suffix(".tmp").unlink(missing_ok=True)
