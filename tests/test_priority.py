"""Loading at a lower CPU priority (--loading-nice), with real processes: a niced process and
every thread it made put back to nice 0, the right to do so detected, and refusals said."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from mpspool import process

# A process that lowers its priority while it is still one thread, then starts three
# threads (as TensorFlow's pools are made after the worker's os.nice), and waits.
NICED_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    os.nice(10)
    threads = [threading.Thread(target=threading.Event().wait, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def thread_nices(pid: int) -> dict[int, int]:
    return {
        int(tid): os.getpriority(os.PRIO_PROCESS, int(tid))
        for tid in os.listdir(f"/proc/{pid}/task")
    }


@pytest.fixture
def niced_child() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen(
        [sys.executable, "-c", NICED_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    yield child
    child.kill()
    child.wait()


needs_the_right = pytest.mark.skipif(
    not process.can_restore_priority(),
    reason="this machine's user may not raise a priority (no CAP_SYS_NICE, RLIMIT_NICE < 20)",
)


@needs_the_right
def test_every_thread_of_a_niced_process_goes_back_to_0(niced_child: subprocess.Popen[str]):
    before = thread_nices(niced_child.pid)
    assert len(before) == 4 and set(before.values()) == {10}
    assert process.restore_priority(niced_child.pid) == 4
    assert set(thread_nices(niced_child.pid).values()) == {0}
    assert process.restore_priority(niced_child.pid) == 0, "nothing left to change"


def test_a_process_that_is_gone_is_a_lookup_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        process.restore_priority(child.pid)


@needs_the_right
def test_without_cap_sys_nice_the_right_is_missing_and_restoring_is_refused(
    niced_child: subprocess.Popen[str],
):
    """A child that drops CAP_SYS_NICE (setpriv, util-linux) neither claims the right nor
    gets it."""
    probe = textwrap.dedent(
        f"""
        from mpspool import process
        print(process.can_restore_priority())
        try:
            process.restore_priority({niced_child.pid})
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
    assert set(thread_nices(niced_child.pid).values()) == {10}
