"""Loading at a lower CPU priority (--loading-priority idle), with real processes: an idle
process and every thread it made moved to the serving policy (--worker-policy), the right to
do so detected, refusals said, and the command line that starts a process at its policy from
its first instruction."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from mpspool import process

# A process that makes itself SCHED_IDLE while it is still one thread, then starts three
# threads (as TensorFlow's pools are made after the worker starts), and waits.
IDLE_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.nice(5)
    threads = [threading.Thread(target=threading.Event().wait, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def thread_priorities(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's (scheduling policy, nice value)."""
    return {
        tid: (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
        for tid in map(int, os.listdir(f"/proc/{pid}/task"))
    }


@pytest.fixture
def idle_child() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen(
        [sys.executable, "-c", IDLE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    yield child
    child.kill()
    child.wait()


needs_the_right = pytest.mark.skipif(
    not process.can_restore_priority(),
    reason="this machine's user may not raise a priority (no CAP_SYS_NICE, RLIMIT_NICE < 20)",
)
NORMAL = (os.SCHED_OTHER, 0)
BATCH = (os.SCHED_BATCH, 0)


@needs_the_right
def test_an_idle_process_serves_with_its_main_thread_batch_and_the_others_normal(
    idle_child: subprocess.Popen[str],
):
    before = thread_priorities(idle_child.pid)
    assert len(before) == 4 and set(before.values()) == {(os.SCHED_IDLE, 5)}
    assert process.restore_priority(idle_child.pid) == 4
    after = thread_priorities(idle_child.pid)
    assert after.pop(idle_child.pid) == BATCH  # the serving thread (--worker-policy batch)
    assert set(after.values()) == {NORMAL}
    assert process.restore_priority(idle_child.pid) == 0, "nothing left to change"
    assert process.restore_priority(idle_child.pid, "normal") == 1  # the main thread
    assert set(thread_priorities(idle_child.pid).values()) == {NORMAL}


def test_batch_and_normal_are_reachable_without_the_right() -> None:
    # sched(7): an unprivileged thread may move between SCHED_OTHER and SCHED_BATCH at a nice
    # value its RLIMIT_NICE allows (0 is always allowed from 0): no CAP_SYS_NICE needed, so a
    # pool loading at normal priority still gets its serving threads batch.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
    )
    try:
        assert process.restore_priority(child.pid, "batch") == 1
        assert thread_priorities(child.pid)[child.pid] == BATCH
        assert process.restore_priority(child.pid, "normal") == 1
        assert thread_priorities(child.pid)[child.pid] == NORMAL
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_is_a_lookup_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        process.restore_priority(child.pid)


@needs_the_right
def test_without_cap_sys_nice_the_right_is_missing_and_restoring_is_refused(
    idle_child: subprocess.Popen[str],
):
    """A child that drops CAP_SYS_NICE (setpriv, util-linux) neither claims the right nor
    gets it; the idle process stays idle."""
    probe = textwrap.dedent(
        f"""
        from mpspool import process
        print(process.can_restore_priority())
        try:
            process.restore_priority({idle_child.pid})
        except PermissionError:
            print("refused")
        """
    )
    out = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-sys_nice",
            "--bounding-set=-sys_nice",
            sys.executable,
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["False", "refused"]
    assert set(thread_priorities(idle_child.pid).values()) == {(os.SCHED_IDLE, 5)}


def test_the_loading_command_runs_idle_from_its_first_instruction():
    probe = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
    for priority, policy in (("idle", os.SCHED_IDLE), ("normal", os.sched_getscheduler(0))):
        argv = process.at_loading_priority(probe, priority)
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert int(out) == policy, priority
    assert process.at_loading_priority(probe, "normal") == probe
