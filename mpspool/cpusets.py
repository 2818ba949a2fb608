"""Which CPU cores each worker runs on: the one place that decides it.

The text is DeepRec SessionGroup's ``SESSION_GROUP_CPUSET``: one group of cores per worker,
groups separated by ``;``, cores by ``,``, ranges as ``a-b`` (``"2-4;5-7"`` or
``"2,3,4;5,6,7"``), group *i* for the *i*-th worker slot (``PoolConfig.slots`` order). Or
``auto``: each worker gets cores of its own, and the first usable core is kept for the front
door and the controller when there are enough (see `auto`). Empty: no pinning, as TF Serving.

It also decides how many threads the front door's async runtime runs (`front_door_threads`):
the cores the workers leave, at least one; and, unless --intra-op-threads says, how many
threads each worker's TensorFlow thread pool runs (`Placement.worker_threads`): a pinned
worker's own cores, or the pool's core budget shared among every worker.

Everything here is pure (the usable cores are an argument), so the rule can be tested on
machines of any size; only `pin`, `affinity` and `quota_cores` touch the OS.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpspool.config import ConfigError

AUTO = "auto"
ENV_VAR = "SESSION_GROUP_CPUSET"  # DeepRec's name; the fallback when --cpuset is not given

_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_SYNTAX = (
    "expected one group of cores per worker, groups separated by ';', cores by ',', "
    "ranges as a-b (e.g. '2-4;5-7' or '2,3,4;5,6,7'), or 'auto'"
)


@dataclass(frozen=True)
class Placement:
    """Cores per worker slot (in slot order; empty: no pinning), the cores kept for the front
    door and controller (empty: they are not pinned), the front door's runtime threads, one
    line saying what was done, and the thread-pool size of each unpinned worker."""

    workers: tuple[frozenset[int], ...]
    reserved: frozenset[int]
    explanation: str
    front_door_threads: int
    unpinned_worker_threads: int = 1

    @property
    def pinned(self) -> bool:
        return bool(self.workers)

    def worker_threads(self, index: int) -> int:
        """Threads for the TensorFlow thread pool of worker slot ``index``: its own cores when
        pinned (more threads than cores only preempt each other), else its share of the
        pool's cores."""
        return len(self.workers[index]) if self.pinned else self.unpinned_worker_threads


def format_cores(cores: Iterable[int]) -> str:
    """Cores as compact text: {0, 1, 2, 5} -> "0-2,5"."""
    ordered = sorted(set(cores))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def parse(text: str, workers: int, usable: Iterable[int]) -> tuple[frozenset[int], ...]:
    """One frozenset of cores per worker from SESSION_GROUP_CPUSET text; ConfigError (saying
    what was expected, or which core is not usable) otherwise."""
    allowed = frozenset(usable)
    groups = text.strip().split(";")
    if len(groups) != workers:
        raise ConfigError(
            f"cpuset {text!r} has {len(groups)} group(s) of cores but the pool has {workers} "
            f"worker(s): give one group per worker; {_SYNTAX}"
        )
    sets: list[frozenset[int]] = []
    for n, group in enumerate(groups, 1):
        if not group.strip():
            raise ConfigError(f"cpuset {text!r}: group {n} is empty; {_SYNTAX}")
        cores: set[int] = set()
        for item in group.split(","):
            match = _ITEM.match(item.strip())
            if not match:
                raise ConfigError(f"cpuset {text!r}: {item.strip()!r} in group {n}: {_SYNTAX}")
            low = int(match[1])
            high = int(match[2]) if match[2] is not None else low
            if high < low:
                raise ConfigError(f"cpuset {text!r}: range {low}-{high} in group {n} is reversed")
            cores.update(range(low, high + 1))
        outside = sorted(cores - allowed)
        if outside:
            raise ConfigError(
                f"cpuset {text!r}: core(s) {format_cores(outside)} of group {n} are not usable "
                f"by this process; usable cores: {format_cores(allowed)}"
            )
        sets.append(frozenset(cores))
    return tuple(sets)


def _blocks(cores: Sequence[int], workers: int) -> tuple[frozenset[int], ...]:
    """``cores`` cut into ``workers`` contiguous blocks, the first ones one core larger when
    they do not divide evenly (no core is left idle)."""
    size, extra = divmod(len(cores), workers)
    blocks, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        blocks.append(frozenset(cores[start:end]))
        start = end
    return tuple(blocks)


def auto(workers: int, usable: Iterable[int], busy: int, budget: int) -> Placement:
    """Own cores for each worker where the machine allows (``busy`` and ``budget``: the
    workers and the cores the front door's threads are counted from, as `plan` gives them):
    - cores >= workers + 1: the first core for the front door and controller, the rest split
      into contiguous blocks, one per worker (so request handling never preempts a model call);
    - cores >= workers: all cores split among the workers, the front door shares them;
    - fewer cores than workers: workers share cores round-robin (worker i on core i mod n),
      which only keeps each one's thread pool to one core's size."""
    cores = sorted(set(usable))
    if not cores:
        raise ConfigError("cpuset auto: this process has no usable cores")
    if len(cores) >= workers + 1:
        reserved = frozenset(cores[:1])
        sets = _blocks(cores[1:], workers)
        how = f"core {cores[0]} for the front door and controller"
    elif len(cores) >= workers:
        reserved = frozenset()
        sets = _blocks(cores, workers)
        how = "no core left over for the front door and controller: they share the workers' cores"
    else:
        reserved = frozenset()
        sets = tuple(frozenset([cores[i % len(cores)]]) for i in range(workers))
        how = (
            f"fewer cores than workers: workers share cores round-robin "
            f"({workers - len(cores)} core(s) run two or more workers), the front door shares too"
        )
    per_worker = ", ".join(format_cores(s) for s in sets)
    # A reserved core is the front door's (and the controller's) alone: one thread on it.
    threads = len(reserved) if reserved else front_door_threads(budget, busy)
    return Placement(
        workers=sets,
        reserved=reserved,
        explanation=(
            f"cpuset auto on {len(cores)} usable core(s) ({format_cores(cores)}) for {workers} "
            f"worker(s): {how}; workers on {per_worker}; front door: {threads} thread(s)"
        ),
        front_door_threads=threads,
    )


def front_door_threads(usable: int, busy: int) -> int:
    """The front door's async-runtime threads on ``usable`` cores of which workers keep
    ``busy`` busy: the cores left over, at least one. A runtime thread beyond them competes
    with model calls for a core, and every thread more costs wake-ups as tasks hand requests
    to each other. Measured on 2 cores with 1 and 2 workers (bench/RESULTS.md, "The front
    door's threads"): one thread instead of one per core took the front door's CPU per
    request to 0.84-0.91x (equal with one worker under full load), p50 at concurrency 1
    down by 35-47 us, throughput equal within noise; over echo workers one thread answers
    ~30,000 requests/s, 1.14-1.18x what two did."""
    return max(1, usable - busy)


def plan(
    spec: str,
    workers: int,
    usable: Iterable[int],
    every_worker: int | None = None,
    quota: int | None = None,
) -> Placement:
    """The placement of ``workers`` worker slots for a --cpuset / SESSION_GROUP_CPUSET text
    (``""``: none, ``"auto"``, or explicit groups) over the ``usable`` cores. ``every_worker``
    counts the workers of every model the pool serves (they share these slots' placement;
    default: ``workers``): they are what keeps cores busy beside the front door. ``quota``:
    the cores a CPU quota allows (`quota_cores`), which the front door's threads count
    instead of the usable cores when it is fewer (a pod limited to 4 CPUs on a 64-core node
    sees 64 cores in its affinity); unpinned workers share the same count among them."""
    spec = spec.strip()
    cores = frozenset(usable)
    busy = max(workers, every_worker or 0)
    budget = min(len(cores), quota) if quota else len(cores)
    if not spec:
        # Unpinned workers still keep a core each busy under load, and share the budget:
        # a pool limited to 4 CPUs on a 64-core node runs 4 workers of 1 thread, not of 16
        # (a quota's throttling is what pinning and thread sizing are there to avoid).
        threads = front_door_threads(budget, busy)
        each = max(1, budget // busy)
        return Placement(
            (),
            frozenset(),
            "no CPU pinning (--cpuset or SESSION_GROUP_CPUSET pins); "
            f"workers: {each} thread(s) each; front door: {threads} thread(s)",
            threads,
            each,
        )
    if spec.lower() == AUTO:
        return auto(workers, cores, busy, budget)
    sets = parse(spec, workers, cores)
    per_worker = ", ".join(format_cores(s) for s in sets)
    threads = front_door_threads(budget, len(frozenset().union(*sets)))
    return Placement(
        workers=sets,
        reserved=frozenset(),
        explanation=(
            f"cpuset {spec!r}: workers on {per_worker}; front door and controller unpinned; "
            f"front door: {threads} thread(s)"
        ),
        front_door_threads=threads,
    )


def quota_cores(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Whole cores the CPU quota of this process's cgroup allows (a container's CPU limit),
    rounded up; None without one. cgroup v2: ``cpu.max`` ("400000 100000"; "max" means none)
    in the process's cgroup and each parent up to the root, the smallest; cgroup v1: the
    ``cpu`` controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), in the
    process's cgroup or, inside a container that mounts its own, at the mount's root (a
    quota set only on a parent v1 cgroup is not seen). Files that cannot be read or parsed
    count as no quota."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        relative = path.lstrip("/")
        if controllers == "":  # v2: walk from the process's cgroup up to the root
            here = root / relative
            while True:
                quotas += _quota_v2(here / "cpu.max")
                if here == root or root not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                found = _quota_v1(mount / relative) or _quota_v1(mount)
                if found:
                    quotas += found
                    break
    return math.ceil(min(quotas)) if quotas else None


def _quota_v2(path: Path) -> list[float]:
    try:
        quota, period = path.read_text().split()[:2]
        if quota == "max":
            return []
        cores = int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return []  # unreadable or malformed: no quota known (never a failed start)
    return [cores] if cores > 0 else []


def _quota_v1(folder: Path) -> list[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []  # unreadable or malformed: no quota known (never a failed start)
    return [quota / period] if quota > 0 and period > 0 else []


def pin(pid: int, cores: Iterable[int]) -> None:
    """Every thread of process ``pid`` onto ``cores``. sched_setaffinity acts on one thread
    (the pid is the main thread's id), and a process's threads that already run (ZeroMQ's,
    tokio's) do not follow their main thread; threads started later inherit it."""
    wanted = set(cores)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def affinity(pid: int) -> str:
    """The cores process ``pid`` may run on now, as text ("" when it is gone)."""
    try:
        return format_cores(os.sched_getaffinity(pid))
    except (ProcessLookupError, PermissionError):
        return ""
