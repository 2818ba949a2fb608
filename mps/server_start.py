"""Starting a GPU's MPS server before its workers connect.

The control daemon starts an MPS server when its first client initialises CUDA, and while
that server initialises (cuInit, then a context: seconds on a GPU without the persistence
daemon) every other client that connects is refused with CUDA_ERROR_MPS_SERVER_NOT_READY
(NVIDIA's MPS troubleshooting guide, "Server Initialization in Progress"). A process cannot
initialise CUDA again after a failure, so a worker refused this way saw no GPU, failed its
load, and was backed off: at every pool start, and after every GPU restart, some of a GPU's
workers started together did.

So the controller runs this module first (`python -m mpspool.mps.server_start`, in the
daemon's environment, as a worker would run): it initialises CUDA through the driver API
(libcuda, no TensorFlow) and makes the device's primary context, which has the daemon start
the server, and exits once the server took it. The server stays for the workers that follow.
Refused while a server initialises or recovers, it exits with NOT_READY_EXIT, and
`start_server` runs it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

# CUresult values (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_MPS_SERVER_NOT_READY = 807
# This module's exit codes: refused while the server is not ready (run again), and no CUDA
# driver to ask (nothing to start).
NOT_READY_EXIT = 75
NO_DRIVER_EXIT = 2
# How long one run may take (a server's start on a GPU without the persistence daemon).
RUN_TIMEOUT_S = 30.0
RETRY_PAUSE_S = 0.5

COMMAND = (sys.executable, "-m", "mpspool.mps.server_start")


def start_server(env: Mapping[str, str], timeout_s: float, command: Sequence[str] = COMMAND) -> str:
    """Run the start in ``env`` (a GPU's daemon's, as its workers get it) until the server
    took it; "" then, else why not (refused past ``timeout_s``, or another failure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, min(RUN_TIMEOUT_S, deadline - time.monotonic()))
        try:
            run = subprocess.Popen(
                list(command),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        except OSError as exc:
            return f"cannot run {command[0]}: {exc}"
        try:
            out, _ = run.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            run.kill()
            # One stuck in the driver (a wedged GPU) may not even die: not waited for long.
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.communicate(timeout=1.0)
            return f"starting it took more than {left:.0f} s"
        lines = out.strip().splitlines()
        # What this module says is its last line; a library's warnings may come before.
        said = [line for line in lines if line.startswith(("cu", "no CUDA driver"))]
        reason = (said or lines or [f"exit status {run.returncode}"])[-1]
        if run.returncode == 0:
            return ""
        if run.returncode != NOT_READY_EXIT:
            return reason
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            return f"{reason} for {timeout_s:.0f} s"
        time.sleep(RETRY_PAUSE_S)


def _call(cuda: ctypes.CDLL, name: str, *args: object) -> None:
    result = int(getattr(cuda, name)(*args))
    if result == CUDA_SUCCESS:
        return
    text = ctypes.c_char_p()
    cuda.cuGetErrorName(result, ctypes.byref(text))
    label = text.value.decode() if text.value else f"CUresult {result}"
    print(f"{name}: {label}", flush=True)
    raise SystemExit(NOT_READY_EXIT if result == CUDA_ERROR_MPS_SERVER_NOT_READY else 1)


def main() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        print(f"no CUDA driver to start it with (libcuda.so.1: {exc})", flush=True)
        return NO_DRIVER_EXIT
    device = ctypes.c_int()
    context = ctypes.c_void_p()
    _call(cuda, "cuInit", ctypes.c_uint(0))
    _call(cuda, "cuDeviceGet", ctypes.byref(device), ctypes.c_int(0))
    # The primary context, as the CUDA runtime (and TensorFlow) makes it: its creation is
    # what connects this client to the server, started for it.
    _call(cuda, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    # The server took this client: done. Its context goes with the process either way
    # (the _v2 name since CUDA 11; the older one before).
    release = getattr(cuda, "cuDevicePrimaryCtxRelease_v2", None) or getattr(
        cuda, "cuDevicePrimaryCtxRelease", None
    )
    if release is not None:
        release(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
