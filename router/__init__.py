"""The front door: a Rust binary, `mpspool-router`, built from this folder's Cargo crate by the
package's install (setuptools-rust). It speaks TF Serving's gRPC API, routes requests to the
workers over ZeroMQ and watches their liveness; no Python runs per request. This Python
package only tells the controller where the binary is, and names what other parts refer to.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from mpspool.config import ConfigError

log = logging.getLogger("mpspool.router")

BINARY = "mpspool-router"
# For development: run a front door built elsewhere (e.g. `cargo build` in router/).
BINARY_ENV = "MPSPOOL_ROUTER"
# The front door's async-runtime threads (src/main.rs reads it). The controller sets it from
# the CPU placement (mpspool/cpusets.py: front_door_threads) unless `mpspool start` has it.
THREADS_ENV = "MPSPOOL_ROUTER_THREADS"

# Metric names that deploy/ (the HorizontalPodAutoscaler) and the tests refer to; the Rust
# front door's src/metrics.rs exports them.
INFLIGHT_METRIC = "mpspool_inflight_requests"
READY_WORKERS_METRIC = "mpspool_workers_ready"


class BinaryNotFound(ConfigError):
    """The front door's binary is not installed where this Python can find it."""


def runtime_threads(placed: int) -> str:
    """The value of THREADS_ENV the front door gets: the user's when it is a whole number of
    at least 1, else the placement's (the front door would drop anything else for tokio's
    one thread per core, which is neither)."""
    given = os.environ.get(THREADS_ENV, "").strip()
    if given.isdigit() and int(given) >= 1:
        return given
    if given:
        log.warning("%s=%r is not a number of threads (>= 1): using %d", THREADS_ENV, given, placed)
    return str(placed)


def binary_path() -> str:
    """$MPSPOOL_ROUTER, else the binary installed beside this interpreter's scripts, else PATH."""
    override = os.environ.get(BINARY_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise BinaryNotFound(f"{BINARY_ENV}={override} is not an executable file")
        return override
    beside = Path(sys.executable).parent / BINARY
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(BINARY)
    if found:
        return found
    raise BinaryNotFound(
        f"{BINARY} is not installed beside {sys.executable} nor on PATH: install mpspool with "
        "pip (it builds the front door with cargo), or set "
        f"{BINARY_ENV} to a built binary"
    )
