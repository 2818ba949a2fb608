"""Model versions as groups of workers: the version policy, each version's state, and the one
place that changes it.

Every (model, version) the policy wants served gets its own weight segment and its own group
of workers, one per slot. A new version is published and its workers start while the old one
serves; it becomes AVAILABLE (where requests that name no version go) when every one of its
workers is READY; then the versions the policy no longer wants are UNLOADING: the front door
sends them nothing new, their workers finish what they have, stop, and their segment is
unlinked, so their memory goes back with their processes. A version that cannot be published,
loaded or warmed up never takes traffic: it is tried again (`--max_num_load_retries`,
`--load_retry_interval_micros` apart, as TF Serving), then ends (END) with its error, and
whatever served before goes on serving.

States and their names are TF Serving's (`ModelVersionStatus.State`).
"""

from __future__ import annotations

import enum
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpspool import segment as weight_segment
from mpspool.supervisor.background_read import BackgroundRead
from mpspool.supervisor.slots import Slot, group_name

log = logging.getLogger("mpspool.controller")

# How long a publisher asked to end (SIGTERM, then SIGKILL) is waited for, each.
PUBLISHER_STOP_S = 5.0


class VersionState(enum.Enum):
    START = "START"  # wanted by the policy; nothing done yet
    LOADING = "LOADING"  # its weights are being published, or its workers are loading
    AVAILABLE = "AVAILABLE"  # every worker READY: takes requests
    UNLOADING = "UNLOADING"  # no new requests; its workers finish, then stop
    END = "END"  # retired, or failed (with its error)


V = VersionState
ALLOWED: dict[VersionState, frozenset[VersionState]] = {
    V.START: frozenset({V.LOADING, V.END}),
    # LOADING -> END: it could not be published or loaded (or the pool stops).
    V.LOADING: frozenset({V.AVAILABLE, V.END}),
    V.AVAILABLE: frozenset({V.UNLOADING, V.END}),
    V.UNLOADING: frozenset({V.END}),
    V.END: frozenset(),
}


class IllegalVersionTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class VersionPolicy:
    """TF Serving's model_version_policy: the newest `latest` versions (the default, 1), or
    `all` of them, or the `specific` ones listed."""

    latest: int = 1
    all: bool = False
    specific: tuple[int, ...] = ()

    @staticmethod
    def parse(text: str) -> VersionPolicy:
        """`latest`, `latest:N`, `all` or `specific:V[,V...]`; ValueError says what is wrong."""
        kind, _, value = text.strip().partition(":")
        if kind == "latest":
            count = int(value) if value else 1
            if count < 1:
                raise ValueError(f"latest needs at least 1 version, got {count}")
            return VersionPolicy(latest=count)
        if kind == "all" and not value:
            return VersionPolicy(all=True)
        if kind == "specific" and value:
            versions = tuple(sorted({int(v) for v in value.split(",")}))
            if any(v < 0 for v in versions):
                raise ValueError("versions are numbers >= 0")
            return VersionPolicy(specific=versions)
        raise ValueError(f"expected latest[:N], all or specific:V[,V...], got {text!r}")

    def describe(self) -> str:
        if self.all:
            return "all"
        if self.specific:
            return "specific:" + ",".join(str(v) for v in self.specific)
        return f"latest:{self.latest}"

    def aspired(self, on_disk: set[int], failed: set[int]) -> set[int]:
        """The versions to serve: those the policy picks among the ones on disk that did not
        fail (a failed version is passed over, so the one before it stays)."""
        usable = on_disk - failed
        if self.all:
            return usable
        if self.specific:
            return usable & set(self.specific)
        return set(sorted(usable)[-self.latest :])


@dataclass
class VersionGroup:
    version: int
    # Slot key ("cpu-0@2") → slot; one per placement, as the pool's configuration lays out.
    slots: dict[str, Slot]
    segment: str  # its weight segment ("" when weights are not shared)
    state: VersionState = VersionState.START
    error: str = ""
    publisher: subprocess.Popen[bytes] | None = None  # publishing its weights, while running
    since: float = 0.0  # monotonic time of the last state change
    publish_started: float = 0.0  # monotonic time its publisher was started
    publish_log_from: int = 0  # where its publisher's output starts in its log
    in_supervisord: bool = False  # its program group was added to supervisord
    workers_started: bool = False  # its program group was started (its slots STARTING)
    # Since when its load try waits for the processes of its program group to stop (a model
    # removed and added back, a version rolled back to, a load try after a failed one, while
    # the earlier workers of the same group still stop; `ModelVersions._try_waits_for_stop`);
    # None: it does not.
    waits_for_stop_since: float | None = None
    model: str = ""  # its model's prefix (Slot.model): "" for the pool's first model
    # With per-model batching: its batching_params.pbtxt as the front door takes it (None:
    # not batched), read once when its load begins; why that file cannot be used ("": it
    # can). The read runs on a thread of its own (`batching_read`, until its outcome is
    # taken): a version's file on storage that stopped answering held the controller's loop.
    batching: dict[str, Any] | None = None
    batching_error: str = ""
    batching_read: BackgroundRead[dict[str, Any] | None] | None = None
    batching_said: bool = False  # that its read hangs, said once
    batching_retry_at: float = 0.0  # a read that failed to reach the file: read again then
    batching_said_error: str = ""  # the last such failure, said once
    # Its load tries that failed, and while it waits to be tried again (still LOADING, as
    # TF Serving's LoaderHarness stays kLoading between its retries) when the next one
    # starts and why the last one failed.
    failed_tries: int = 0
    retry_at: float | None = None
    # When its retry came due (time.monotonic): its folder is read from then on.
    retry_due_since: float | None = None
    last_error: str = ""
    # The controller's hold on its published segment (mpspool/segment.py, `hold`), if any.
    segment_hold: int | None = None
    # What restore_segment_if_removed last said of a segment it could not write back, so
    # that it is said once, not at every tick.
    segment_trouble: str = ""

    @property
    def group(self) -> str:
        """Its supervisord program group."""
        return group_name(self.version, self.model)

    @property
    def label(self) -> str:
        """What logs call it: "version 2", or "model ranker version 2"."""
        return (
            f"model {self.model} version {self.version}"
            if self.model
            else f"version {self.version}"
        )

    def stop_publisher(self) -> None:
        """End the child publishing its weights, if it still runs. Waited for a bounded time:
        one in uninterruptible I/O (a hung model mount) takes no signal until that I/O
        returns, and waiting for it without end left the controller deaf to its own stop
        (found by a review); it is left to end on its own (its segment is one a later
        pool's start takes for a dead pool's)."""
        publisher, self.publisher = self.publisher, None
        if publisher is None:
            return
        for end in (publisher.terminate, publisher.kill):
            end()
            try:
                publisher.wait(PUBLISHER_STOP_S)
                return
            except subprocess.TimeoutExpired:
                continue
        log.warning(
            "the publisher of %s (pid %d) does not end (uninterruptible I/O?): left behind",
            self.label, publisher.pid,
        )  # fmt: skip

    def hold_segment(self, path: Path | None = None) -> None:
        """Hold its segment (at ``path``: its ".partial" while it is written; by default the
        published one) while the pool runs, so that another pool's start never takes it for
        one left by a dead pool (segment.remove_stale). Once held, held on: a rename keeps
        the file, and the hold with it. OSError when it is not there."""
        if self.segment and self.segment_hold is None:
            self.segment_hold = weight_segment.hold(path or Path(self.segment))

    def restore_segment_if_removed(self) -> str:
        """If someone removed its published segment from /dev/shm, write it back from the
        controller's hold (the file lives on while held), so that a worker started later
        (a crash's replacement) finds it: "" when nothing was removed (or what stops it was
        said before), else what was done. Only once its publisher is done (before, the hold
        is on the file being written), and while it may yet start a worker (LOADING or
        AVAILABLE: one retiring would double /dev/shm for nothing). The copy runs in the
        controller's loop: about a second per GiB of segment, once."""
        if self.publisher is not None or self.segment_hold is None:
            return ""
        if self.state not in (VersionState.LOADING, VersionState.AVAILABLE):
            return ""
        if not weight_segment.removed(self.segment_hold):
            return ""
        path = Path(self.segment)
        if path.exists():
            trouble = f"its segment {path} was replaced by another file: left as it is"
        else:
            try:
                restored = weight_segment.restore(self.segment_hold, path)
            except weight_segment.SegmentError as exc:
                trouble = f"its segment {path} was removed and cannot be written back: {exc}"
            else:
                os.close(self.segment_hold)
                self.segment_hold, self.segment_trouble = restored, ""
                return (
                    f"its segment {path} was removed from outside the pool: written back "
                    "from the copy its workers still map (twice its size until they are "
                    "replaced)"
                )
        if trouble == self.segment_trouble:
            return ""
        self.segment_trouble = trouble
        return trouble

    def unlink_segment(self) -> None:
        """Its weight segment (and a half-written one) leaves /dev/shm; the memory goes back
        with the last process that maps it."""
        if self.segment_hold is not None:
            os.close(self.segment_hold)
            self.segment_hold = None
        if self.segment:
            Path(self.segment).unlink(missing_ok=True)
            Path(self.segment + ".partial").unlink(missing_ok=True)

    def change_state(self, new: VersionState, now: float, why: str = "") -> None:
        if new is self.state:
            return
        if new not in ALLOWED[self.state]:
            raise IllegalVersionTransition(f"{self.label}: {self.state.value} -> {new.value}")
        log.info(
            "%s: %s -> %s%s",
            self.label,
            self.state.value,
            new.value,
            f" ({why})" if why else "",
        )
        self.state = new
        self.since = now

    def describe(self) -> dict[str, object]:
        row: dict[str, object] = {
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
        }
        if self.batching is not None:
            row["batching"] = self.batching
        return row
