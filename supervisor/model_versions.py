"""One model's versions, as the controller runs them: which versions the policy wants
(supervisor/versions.py), a group of workers and a weight segment per version, their states
(START → LOADING → AVAILABLE → UNLOADING → END), what the front door is told, and the
publisher child that puts a version's weights into shared memory.

The controller owns the pool (supervisord, the front door link, the MPS daemons, the pool's
phase) and offers it here through `Pool`; this object owns the decisions about its model's
versions and nothing else. Its slots' own states (STARTING, READY, BACKOFF, ...) stay with
the controller's reconciling, which reads them through `groups`.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import xmlrpc.client
from pathlib import Path
from typing import Any, Protocol

from mpspool import process
from mpspool.config import VERSION_BATCHING_FILE, ConfigError, PoolConfig, version_batching
from mpspool.demo_model import versions_on_disk
from mpspool.errors import Code, in_context, status_text
from mpspool.supervisor import background_read, config_reload
from mpspool.supervisor.background_read import BackgroundRead
from mpspool.supervisor.slots import Slot, program_name
from mpspool.supervisor.states import FINAL_STATES, WorkerState
from mpspool.supervisor.supervisord import SPAWN_REFUSALS, program_logs, publisher_environment
from mpspool.supervisor.versions import VersionGroup, VersionPolicy, VersionState

log = logging.getLogger("mpspool.controller")
# A saved_model.pb this large is mostly constants (a graph of ops alone is rarely over a few
# MiB), which are not shared: said at publishing.
GRAPH_WEIGHTS_SAID_BYTES = 32 * 2**20

# Versions listed END in status and GetModelStatus once they are gone (retired, or failed and
# their folder removed); TF Serving keeps them all, this keeps the last few.
RETIRED_SHOWN = 5
# How often the pool's start looks for the first publisher's claim on its segment.
CLAIM_POLL_S = 0.005
# A version's batching file whose read failed to reach it (storage failing) is read again
# this much later.
BATCHING_RETRY_S = 1.0
# How long a load try waits for the earlier processes of its program group to stop
# (`_try_waits_for_stop`): supervisord SIGKILLs a worker 10 s after its stop (stopwaitsecs);
# one still there long after sits in the kernel, and the try fails.
STOP_WAIT_BOUND_S = 60.0
# How long a failed load's count waits for the look at its folder (the common case answers at
# once; storage that stopped answering holds the loop this long, the count coming later).
FAILED_LOAD_WAIT_S = 0.05
# Errors that are the file's answer, the same at every read: its version fails at once (a
# version directory the pool's user may not enter was read again every second, for ever;
# found by a review). Any other OSError (EIO, ESTALE, ETIMEDOUT: storage failing) is retried.
FILE_ANSWERS = frozenset(
    {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG}
)


class RouterAsk(Protocol):
    def ask(self, op: str, timeout_s: float = 0.5, **fields: Any) -> dict[str, Any] | None: ...


class Pool(Protocol):
    """What the controller offers a model's versions."""

    config: PoolConfig
    run_dir: Path
    log_dir: Path
    router: RouterAsk

    @property
    def router_pid(self) -> int: ...

    def rpc(self, method: str, *args: Any) -> Any: ...

    def stop_groups(self, groups: list[str]) -> None: ...

    def still_stopping(self, group: str) -> bool: ...

    def sync_supervisord(self) -> None: ...

    def forget(self, slot: Slot, why: str, tell_router: bool = True) -> None: ...

    def fail_pool(self, reason: str) -> None: ...

    def note_spawn_refused(self, program: str, why: str) -> None: ...

    def stop_asked(self) -> bool: ...

    def note_failed_load(self, path: str) -> None: ...

    def failed_loads_at(self, path: str) -> int: ...


class ModelVersions:
    def __init__(self, pool: Pool, name: str, required: bool = True) -> None:
        self.pool = pool
        self.name = name
        # A model the pool started with must serve, or the pool fails (as TF Serving fails
        # to start); one added while serving that cannot load only shows why in its status.
        self.required = required
        # Whether a version of it has served: from then on workers that cannot start (their
        # version's files gone for a moment) wait out FATAL's cool-down, not end the pool.
        self.has_served = False
        # Removed from the configuration while serving: its versions drain and end, then the
        # controller forgets it.
        self.removed = False
        # What tells its slots, programs and groups from other models' ("" for the first).
        self.prefix = pool.config.model_prefix(name)
        config = self.config
        self.policy = VersionPolicy.parse(config.version_policy)
        # Slot key → the restarts its slots had when their versions ended (`new_group`).
        self._restarts_ended: dict[str, int] = {}
        # Model version → its group of workers; the first, the version found at start.
        self.groups: dict[int, VersionGroup] = {}
        first = self.new_group(config.model_version)
        if required:
            first.state = VersionState.LOADING  # published and started by the controller
        self.groups[first.version] = first
        self.aspired = {config.model_version}  # what the policy wants, as last polled
        self.failed: dict[int, str] = {}  # version → why it could not serve (while on disk)
        # Version → the folder its failed loads were counted by (`note_failed_load`), so that
        # the version table, made at every tick, looks at no disk (a hung mount held it).
        self._failed_load_paths: dict[int, str] = {}
        # Failed loads whose folder is being looked for (version, its read, the base path).
        self._failed_load_reads: list[tuple[int, BackgroundRead[str], str]] = []
        # The versions that had failed (END, or waiting to be tried again) when the
        # HandleReloadConfigRequests now waiting were asked: those do not hold them up
        # (`failed_before_reload`).
        self._failed_when_asked: set[int] = set()
        # Versions that ended and are gone → why they failed ("" for retired), oldest first:
        # still listed END, as TF Serving's state monitor keeps every version it ended.
        self.retired: dict[int, str] = {}
        self.on_disk: set[int] = set()  # the versions under the base path, as last read
        self.next_poll = 0.0
        self._poll_error = ""  # the last failure to read the base path, said once
        # Each read of the base path, on a thread of its own: one on storage that stopped
        # answering held the controller's loop, every model's with it (as a hung config
        # file's read did; found by a hunt). `reconcile` polls only a model not removed.
        self._disk_read: BackgroundRead[set[int]] = BackgroundRead(
            lambda: versions_on_disk(self.config.model_base_path), f"poll-{name}"
        )
        # A load retry's look at its folder, just before it publishes it: on a thread too.
        self._retry_read: BackgroundRead[set[int]] = BackgroundRead(
            lambda: versions_on_disk(self.config.model_base_path), f"retry-{name}"
        )
        # Listings begun before this (time.monotonic()) are read again: a new policy's, a
        # reload's (`read_again`). When the last listing taken began.
        self._read_from = 0.0
        self._listed_at = 0.0
        self._labels_held: set[tuple[str, int]] = set()  # labels waiting for their version
        # The labels a HandleReloadConfigRequest waiting to take effect asks for (None: none
        # waits). Written by the controller; given as the config's labels once it succeeds.
        self.labels_asked: dict[str, int] | None = None
        # (router pid, table, labels, starting) last sent to the front door.
        self._versions_told: tuple[int, Any, dict[str, int], bool] | None = None

    @property
    def config(self) -> PoolConfig:
        """The model's configuration: its name, base path, policy, labels and workers, and
        the pool's settings (read from the pool each time: a reload changes them)."""
        return self.pool.config.for_model(self.name)

    @property
    def slots(self) -> dict[str, Slot]:
        """Every version's slots, by key ("cpu-0@2")."""
        return {key: slot for group in self.groups.values() for key, slot in group.slots.items()}

    def new_group(self, version: int) -> VersionGroup:
        config = self.config
        slots = {}
        for name in config.slots:
            slot = Slot(name, version, self.prefix)
            slot.restarts_before = self._restarts_ended.get(slot.key, 0)
            slots[slot.key] = slot
        group = VersionGroup(version, slots, config.segment_for(version), model=self.prefix)
        if config.batching and config.per_model_batching:
            # Read once, as TF Serving reads it when it loads the version (`_batching_known`);
            # its folder looked for there too (version_path reads the base path).
            group.batching_read = BackgroundRead(
                lambda: version_batching(Path(config.version_path(version))),
                f"batching-{self.name}@{version}",
            )
        return group

    def _batching_known(self, group: VersionGroup, now: float) -> bool:
        """Whether the version's batching file has been read (or needs no reading), its
        outcome kept on the group; False while the read runs (begun here if need be), and
        while one that failed to reach the file (storage failing: EIO, ESTALE) waits to be
        read again, BATCHING_RETRY_S later (``now``: the controller's clock)."""
        read = group.batching_read
        if read is None:
            return True
        if now < group.batching_retry_at:
            return False
        outcome = read.look()
        if outcome is None:
            if read.hung() and not group.batching_said:
                group.batching_said = True
                log.warning(
                    "%s: reading its %s has not returned (storage not answering?)",
                    group.label, VERSION_BATCHING_FILE,
                )  # fmt: skip
            return False
        if isinstance(outcome.error, OSError) and outcome.error.errno not in FILE_ANSWERS:
            # Not the file's answer: read again (a version stuck LOADING for ever, its read
            # given up, when the error ended the look; found by a review).
            group.batching_retry_at = now + BATCHING_RETRY_S
            if str(outcome.error) != group.batching_said_error:
                group.batching_said_error = str(outcome.error)
                log.warning(
                    "%s: cannot read its %s (read again): %s",
                    group.label, VERSION_BATCHING_FILE, outcome.error,
                )  # fmt: skip
            return False
        group.batching_read = None
        if isinstance(outcome.error, (ConfigError, OSError)):  # OSError: one of FILE_ANSWERS
            group.batching_error = status_text(
                Code.INVALID_ARGUMENT, f"cannot batch as its directory asks: {outcome.error}"
            )
        elif outcome.error is not None:
            raise outcome.error
        else:
            group.batching = outcome.value
        return True

    # -- publishing ---------------------------------------------------------------
    def prepare_first(self) -> str:
        """Before any process of the pool starts: why the first version cannot load ("" when
        nothing says so yet). Its batching file (`mpspool start` checked it; it may have
        changed since) or, when weights are shared, its publisher, started here: this
        returns once the publisher has claimed its segment (the ".partial" file it writes
        into, renamed into place when complete), or failed.

        The controller then starts the version's workers beside the publisher: a worker
        needs the weights only after importing TensorFlow and loading the graph, and waits
        for the rename there (worker/runtime.py, `_wait_for_publisher`), so the copy and the
        imports overlap. `_advance_loading` sees the publisher end. Later versions, loaded
        while others serve, publish first and start their workers after (`_load`)."""
        group = self.groups[self.config.model_version]
        while not self._batching_known(group, time.monotonic()):
            if self.pool.stop_asked():
                return ""  # (as below: the pool's start ends, and with it this wait)
            time.sleep(CLAIM_POLL_S)
        if group.batching_error:
            return group.batching_error
        if not self.config.share_weights or self.pool.stop_asked():
            return ""  # (a stop asked: the pool's start ends before its workers start)
        publisher = self._start_publisher(group)
        final = Path(group.segment)
        partial = final.with_name(final.name + ".partial")
        # Claimed within tens of ms (the checkpoint's index is read first, no TensorFlow);
        # a worker started before the claim would find no segment at all.
        while publisher.poll() is None and not (partial.exists() or final.exists()):
            if self.pool.stop_asked():
                # The pool's start ends here and its stop ends the publisher: a publisher
                # stuck before its claim (a hung model mount) held the start, deaf to it.
                return ""
            time.sleep(CLAIM_POLL_S)
        try:
            # Held from its claim (the rename keeps the file, and the hold with it), not
            # from when a tick sees the publisher end: the pool starts supervisord and its
            # programs meanwhile, seconds in which only the publisher held it.
            group.hold_segment(partial if partial.exists() else final)
        except OSError:
            pass  # renamed or gone meanwhile: held once published (_published), or failed
        code = publisher.poll()
        return "" if code is None else self._published(group, code)

    def _published(self, group: VersionGroup, code: int) -> str:
        """The publisher of ``group`` ended with ``code``: "" with the segment said in the
        log, or the reason it failed."""
        group.publisher = None
        if code == process.EXIT_LOAD_FAILED:  # it could not read the SavedModel
            self.note_failed_load(group.version)
        if code != 0:
            return in_context("publishing the weights failed: ", self._publish_failure(group, code))
        try:
            group.hold_segment()
            size = Path(group.segment).stat().st_size
        except OSError as exc:  # removed by hand (or by a cleaner) as it was published
            return f"publishing the weights failed: the segment is gone: {exc}"
        log.info(
            "weights of %s published to %s (%.1f MiB) in %.1f s",
            group.label,
            group.segment,
            size / 2**20,
            time.monotonic() - group.publish_started,
        )
        self._say_graph_weights(group)
        return ""

    def _say_graph_weights(self, group: VersionGroup) -> None:
        """A large saved_model.pb holds weights as constants (a frozen graph, tensors a
        function captured), which only variables' values are published beside: said, as
        each worker loads its own copy of them (the pool said `shared 0B` and nothing else;
        found by a hunt). Looked at on a thread of its own, as every read of the model's
        storage: one that stopped answering held the loop here."""
        config, label, version = self.config, group.label, group.version

        def look() -> None:
            graph = Path(config.version_path(version)) / "saved_model.pb"
            try:
                graph_bytes = graph.stat().st_size
            except OSError:
                return  # a text SavedModel (saved_model.pbtxt), or gone: the load says so
            if graph_bytes >= GRAPH_WEIGHTS_SAID_BYTES:
                log.warning(
                    "%s: %s is %.1f MiB: what the graph holds (constants: a frozen graph, "
                    "tensors a function captured) is not shared; each worker loads its own "
                    "copy (only variables are shared)", label, graph, graph_bytes / 2**20,
                )  # fmt: skip

        threading.Thread(target=look, name=f"graph-{label}", daemon=True).start()

    def _start_publisher(self, group: VersionGroup) -> subprocess.Popen[bytes]:
        """The one-shot child that publishes a version's weights (it needs TensorFlow, which
        the controller never loads), now ``group.publisher``; its output is appended to
        `_publish_log_path`, from ``group.publish_log_from`` on."""
        version = group.version
        path = self._publish_log_path(version)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Private, as every log of the pool (supervisor/supervisord.py: its umask).
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
            # What earlier tries and runs wrote stays (the log of the first version is the
            # same file across pool runs): this try's reason is read from here on only.
            group.publish_log_from = os.fstat(out.fileno()).st_size
            group.publisher = subprocess.Popen(
                # Reading and checksumming a checkpoint leaves the cores to the workers that
                # serve (one-shot: it never needs its priority back).
                process.at_loading_priority(
                    [
                        sys.executable,
                        "-m",
                        "mpspool.worker.publish",
                        "--run-dir",
                        str(self.pool.run_dir),
                        # The pool's first model is its default (a name of any shape).
                        *([f"--model={self.name}"] if self.prefix else []),
                        "--version",
                        str(version),
                    ],
                    self.config.loading_priority,
                ),
                cwd=self.pool.run_dir,  # not a source checkout (see supervisord.py)
                env=publisher_environment(os.environ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=process.die_with_parent_sigterm,
            )
        group.publish_started = time.monotonic()
        return group.publisher

    def _publish_log_path(self, version: int) -> Path:
        # "publish-v2.log", "publish@ranker@v2.log": '@' is in no model name, so no two
        # models' logs can share a name.
        first = version == self.config.model_version
        name = "publish" + (f"@{self.prefix}" if self.prefix else "")
        sep = "@" if self.prefix else "-"
        return self.pool.log_dir / (f"{name}.log" if first else f"{name}{sep}v{version}.log")

    def _publish_failure(self, group: VersionGroup, code: int) -> str:
        """Why ``group``'s publisher ended with ``code``: its own fatal line in what this try
        wrote to its log (an earlier try's, or an earlier run's, said the wrong reason for a
        publisher killed since; found by a review), else how it ended."""
        path = self._publish_log_path(group.version)
        see = str(path)
        try:
            with open(path, "rb") as log_file:
                log_file.seek(group.publish_log_from)
                reason = process.fatal_reason(log_file.read().decode(errors="replace"))
        except OSError as exc:  # unreadable now: how it ended is still known
            reason, see = "", f"{path} (unreadable: {exc.strerror or exc})"
        if reason:
            return reason
        if code < 0:  # killed: SIGBUS is a page of /dev/shm it could not get
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {-code}"
            return f"the publisher was killed by {name}, see {see}"
        return f"exit code {code}, see {see}"

    def start_added(self, now: float) -> None:
        """A model added while the pool serves: its first version loads as any new version
        does (its weights published by a child, then its workers started)."""
        self._load(self.groups[self.config.model_version], now, "model added")

    def remove(self, now: float) -> None:
        """The model leaves the configuration: versions loading end at once, those serving
        retire (drain, then end); nothing new is loaded."""
        log.info("model %s removed from the configuration: its versions retire", self.name)
        self.removed = True
        self.aspired = set()
        self.next_poll = math.inf
        for group in list(self.groups.values()):
            if group.state in (VersionState.START, VersionState.LOADING):
                self.end_group(group, now, "model removed")

    # -- what serves ----------------------------------------------------------------
    def available_versions(self) -> set[int]:
        return {v for v, g in self.groups.items() if g.state is VersionState.AVAILABLE}

    def serving_version(self) -> int | None:
        """Where requests that name no version go: the newest AVAILABLE version."""
        return max(self.available_versions(), default=None)

    def set_policy(self, policy: VersionPolicy, now: float) -> None:
        """A new version policy, in force from now: the base path is read again at once."""
        self.policy = policy
        self.read_again(now)

    def read_again(self, now: float) -> None:
        """The base path read again at once; a listing begun before now is not taken."""
        self.next_poll = now
        self._read_from = time.monotonic()

    def listed_since_asked(self) -> bool:
        """Whether the base path was read since `read_again` asked (a removed model is not
        read: nothing to wait for), or its read hangs: then the last listing stands, as the
        pool serves on from it (a reload waiting on one hung mount held every reload, those
        of other models too; found by a review) — once there is one, and once the ask has
        waited SLOW_S itself (a slow listing begun before it is no answer to it)."""
        if self.removed or self._listed_at >= self._read_from:
            return True
        asked_s = time.monotonic() - self._read_from
        slow_s = background_read.SLOW_S
        return self._listed_at > 0 and asked_s >= slow_s and self._disk_read.hung()

    # -- reconciling ---------------------------------------------------------------
    def reconcile(self, now: float, snap: dict[str, Any], router_answered: bool) -> None:
        """Poll the base path (`--file_system_poll_wait_seconds`), start the versions the
        policy wants, move each group along, and tell the front door when anything changed."""
        if not self.removed and (now >= self.next_poll or self._disk_read.running()):
            self._poll_versions(now)
        if self._failed_load_reads:
            self._count_failed_loads()
        # Newest first: a version that became AVAILABLE retires the one it replaces in the
        # same tick.
        for version in sorted(self.groups, reverse=True):
            if version in self.groups:
                self._advance(self.groups[version], now, snap)
        self._tell_router_versions(router_answered)

    def labels_told(self) -> dict[str, int]:
        """The labels the front door was last given."""
        return dict(self._versions_told[2]) if self._versions_told else {}

    def _labels_for_router(self) -> dict[str, int]:
        """The configured labels whose version is AVAILABLE: a label moves to a version only
        once it serves (as TF Serving, which refuses a label on a version not loaded); until
        then the label stays where it was told last, or is unknown. With
        --allow_version_labels_for_unavailable_models a label the front door does not have on
        another version is given at once (its requests: NOT_FOUND until the version serves)."""
        available = self.available_versions()
        before = self.labels_told()
        allowed = self.config.allow_version_labels_for_unavailable_models
        # Said once per (label, version) while configured: a pair configured no more goes,
        # or each label moved away before its version served stayed here for good.
        self._labels_held &= set(self.config.version_labels.items())
        labels = {}
        for label, version in sorted(self.config.version_labels.items()):
            if version in available or config_reload.label_may_wait_for(
                label, version, before, allowed
            ):
                labels[label] = version
                self._labels_held.discard((label, version))
                continue
            asked = (self.labels_asked or {}).get(label)
            if asked in available and before.get(label) not in available:
                # Its version no longer serves (a reload's policy retired it) and the reload,
                # still waiting on other versions, asks for one that does: there, not nowhere.
                labels[label] = asked
                continue
            if before.get(label) == version:
                # Its version served and was retired since (a policy that left it out): the
                # label stays, as TF Serving keeps its label map, and its requests get
                # NOT_FOUND for that version rather than "Unrecognized servable version label".
                labels[label] = version
                continue
            if label in before and (allowed or before[label] in available):
                # Where it was told last: a version that serves, or with the flag one ahead
                # (moving a label in use waits for its new version in either case).
                labels[label] = before[label]
            if (label, version) not in self._labels_held:
                self._labels_held.add((label, version))
                log.info(
                    "label %r of model %s waits for version %d to be AVAILABLE",
                    label, self.name, version,
                )  # fmt: skip
        return labels

    def _poll_versions(self, now: float) -> None:
        if not self._disk_read.running():
            wait = self.config.file_system_poll_wait_s
            self.next_poll = now + wait if wait > 0 else math.inf  # 0: once, at start
        read = self._disk_read.look()
        if read is not None and read.started < self._read_from:
            # A listing begun before the policy changed is not the policy's answer (a
            # reload would be told no version fits): read again, now.
            read = self._disk_read.look()
        if read is None:
            if self._disk_read.hung():
                self._say_poll_error("reading it has not returned (storage not answering?)")
            return
        self._listed_at = read.started
        if isinstance(read.error, OSError):
            self._say_poll_error(str(read.error))
            return
        if read.error is not None:
            raise read.error
        on_disk = read.value or set()
        self._poll_error = ""
        self.on_disk = on_disk
        for version in [v for v in self.failed if v not in on_disk]:
            # Gone: if it comes back, it is tried again; meanwhile it stays END with its error.
            self._remember_ended(version, self.failed.pop(version))
            self._failed_when_asked.discard(version)
        self.aspired = self.policy.aspired(on_disk, set(self.failed))
        for version in sorted(self.aspired - set(self.groups)):
            group = self.new_group(version)
            self.groups[version] = group
            self._load(group, now)

    def _say_poll_error(self, what: str) -> None:
        if what != self._poll_error:  # said once, not every poll
            log.warning("cannot read model %s's base path (serving on): %s", self.name, what)
        self._poll_error = what

    def _load(self, group: VersionGroup, now: float, why: str = "new on disk") -> None:
        """START -> LOADING, and its first load try."""
        group.change_state(VersionState.LOADING, now, why)
        self._first_try(group, now)

    def _first_try(self, group: VersionGroup, now: float) -> None:
        """Its first load try, once its batching file is read (`_advance_loading` comes back
        here while the read runs)."""
        if not self._batching_known(group, now):
            return
        if group.batching_error:
            # Its file is read once: trying again would read the same refusal (README: at
            # once, without the load retries).
            self._fail_version(group, group.batching_error, now, retry=False)
            return
        self._start_try(group, now)

    def _start_try(self, group: VersionGroup, now: float) -> None:
        """One load try: publish its weights (a child process, polled by `_advance`), or
        start its workers at once when weights are not shared; once its program group's
        earlier processes have stopped (`_try_waits_for_stop`)."""
        if self._try_waits_for_stop(group, now):
            return
        if not self.config.share_weights:
            self._start_workers_or_fail(group, now)
            return
        try:
            self._start_publisher(group)
        except OSError as exc:  # its log cannot be opened: the version fails, said as such
            self._fail_version(group, f"publishing the weights failed: {exc}", now, publishing=True)

    def _try_waits_for_stop(self, group: VersionGroup, now: float) -> bool:
        """Whether its try waits, processes of its program group (the earlier workers of a
        model removed and added back, of a version rolled back to, of its failed try) still
        stopping: supervisord would spawn nothing for a group it still runs, and the old
        process's end (its SIGKILL) failed the new load; their memory (the segment they
        still map) is not back either, so the weights are not published meanwhile (a
        /dev/shm with room for the served versions refused the new copy). `_advance_loading`
        comes back each tick. Past STOP_WAIT_BOUND_S (a process stuck in the kernel outlives
        its SIGKILL) the try fails, said as such."""
        if not self.pool.still_stopping(group.group):
            group.waits_for_stop_since = None
            return False
        if group.waits_for_stop_since is None:
            group.waits_for_stop_since = now
            log.info(
                "%s: its load starts once the earlier processes of %s have stopped",
                group.label, group.group,
            )  # fmt: skip
        elif now - group.waits_for_stop_since >= STOP_WAIT_BOUND_S:
            group.waits_for_stop_since = None
            reason = (
                f"the earlier processes of {group.group} have not stopped "
                f"{STOP_WAIT_BOUND_S:g} s after their stop (stuck in the kernel?)"
            )
            self._fail_version(group, reason, now, publishing=True)  # (none of it ran)
        return True

    def start_workers(self, group: VersionGroup, why: str, sync: bool = True) -> None:
        """Its program group started in supervisord, its slots STARTING. ``sync``: add the
        group to supervisord's programs first (not needed at the pool's start, where
        supervisord starts with every program)."""
        if sync:
            self.pool.sync_supervisord()
        group.in_supervisord = True
        group.workers_started = True
        for result in self.pool.rpc("startProcessGroup", group.group, False) or []:
            program = f"{result.get('group')}:{result.get('name')}"
            if result.get("status") in SPAWN_REFUSALS:  # its slot says so (`_observe`)
                # Its description is the fault's own text ("NO_FILE: /path").
                self.pool.note_spawn_refused(program, str(result.get("description")))
            else:
                self.pool.note_spawn_refused(program, "")  # spawned: an older refusal is over
        for slot in group.slots.values():
            slot.start_pending = True
            slot.change_state(WorkerState.STARTING, why)

    def _start_workers_or_fail(self, group: VersionGroup, now: float) -> None:
        """`start_workers` for a load try, whose failure (supervisord slow to answer, or gone
        for a moment; its configuration not written) is that try's: tried again later as a
        failed load. It escaped before, with the publisher already forgotten, and the
        version stayed LOADING for ever with nothing left to move it (found by a review)."""
        try:
            self.start_workers(group, f"version {group.version} loading")
        except (OSError, xmlrpc.client.Error) as exc:
            reason = f"starting its workers failed: {exc}"
            self._fail_version(group, reason, now, publishing=True)

    def _advance(self, group: VersionGroup, now: float, snap: dict[str, Any]) -> None:
        if group.state is VersionState.LOADING:
            if (
                group.version not in self.aspired
                and group.retry_at is None  # (one waiting to be tried again: its own rule)
                and self.serving_version() is not None
            ):
                # The policy no longer wants it (a newer version came meanwhile): its load
                # ends now, as TF Serving loads only the newest aspired version. Each version
                # copied in while another loaded went on loading, all at once, and each took
                # the traffic as it came up (found by a hunt). Only while another serves: the
                # pool's first load is seen through.
                self.end_group(group, now, "no longer wanted by the version policy")
                self._remember_ended(group.version, "")
                self._failed_when_asked.discard(group.version)  # wanted again: tried anew
                return
            self._advance_loading(group, now)
        elif group.state is VersionState.AVAILABLE:
            # Retired once a version the policy wants serves in its place: never before,
            # so a version that fails to load leaves the old one serving.
            replaced = any(
                g.state is VersionState.AVAILABLE and g.version in self.aspired
                for g in self.groups.values()
            )
            if self.removed:
                self._retire(group, now, "model removed")
            elif group.version not in self.aspired and replaced:
                self._retire(group, now, "replaced")
        elif group.state is VersionState.UNLOADING:
            if not snap:
                # The front door did not answer this tick (busy copying a large request, or
                # restarting): what its workers hold is unknown, not none. Judged next tick.
                return
            workers = snap.get("workers", {})
            running = sum(int(workers.get(k, {}).get("inflight", 0)) for k in group.slots)
            # Requests of its model waiting for a worker may be pinned to it: wait for them
            # too (another model's queue is none of its business).
            by_model = snap.get("queued_by_model")
            waiting = by_model.get(self.name, 0) if by_model is not None else snap.get("queued", 0)
            unloading_s = now - group.since
            # What its workers hold is answered, however long its calls (TF Serving unloads
            # a version once the requests holding it are done); a call past --call-timeout
            # ends its worker anyway, so that bounds the wait. Cutting at --drain-timeout
            # re-ran a long request from scratch on the new version, or failed one pinned to
            # this version with UNAVAILABLE (found by a user test).
            if running and unloading_s < self._running_calls_bound_s():
                return
            if waiting and unloading_s < self.config.drain_timeout_s:
                return
            self.end_group(group, now, "retired")
            self._remember_ended(group.version, "")

    def _running_calls_bound_s(self) -> float:
        """How long an UNLOADING version waits for the requests its workers hold: each call
        is ended by --call-timeout at the latest (none: as long as they run)."""
        call_timeout = self.config.call_timeout_s
        return self.config.drain_timeout_s + call_timeout if call_timeout > 0 else math.inf

    def _advance_loading(self, group: VersionGroup, now: float) -> None:
        if group.batching_read is not None:
            self._first_try(group, now)
            return
        if group.retry_at is not None:
            self._retry_when_due(group, group.retry_at, now)
            return
        if group.publisher is not None:
            code = group.publisher.poll()
            if code is None:
                return  # workers started beside it (the first version) wait for the segment
            failed = self._published(group, code)
            if failed:
                self._fail_version(group, failed, now, publishing=True)
                return
            if not group.workers_started:
                self._start_workers_or_fail(group, now)
                return
        elif group.waits_for_stop_since is not None:
            self._start_try(group, now)
            return
        slots = list(group.slots.values())
        ready = [s for s in slots if s.state is WorkerState.READY]
        others = self.serving_version() is not None
        if ready and (len(ready) == len(slots) or not others):
            # The first version serves with its first worker; a replacement only when all
            # of its workers are ready, so the pool never serves with fewer.
            group.change_state(VersionState.AVAILABLE, now, f"{len(ready)} workers READY")
            self.has_served = True
            return
        failed = [s for s in slots if s.load_failures and s.state in FINAL_STATES]
        failed += [s for s in slots if s.load_failures and s.state is WorkerState.BACKOFF]
        if failed and (others or not self.required):
            # While another version serves (or for a model added while the pool serves), a
            # version that cannot load ends at once instead of being retried to FATAL; one
            # the pool's settings refuse is not tried again either.
            refused = any(s.refused for s in failed)
            self._fail_version(group, failed[0].reason, now, retry=not refused)

    def first_publish_failed(self, reason: str, now: float) -> None:
        """`prepare_first` said why the first version cannot load: its publisher failed before
        it claimed its segment (a folder still being copied in: its checkpoint index is read
        first), tried again as a later try would be, the pool starting meanwhile without its
        workers; or its batching file is refused, which ends it (and so the pool)."""
        group = self.groups[self.config.model_version]
        group.publisher = None
        # A batching file refused is not retried (`_load`: trying again reads the same file).
        retry = not group.batching_error
        self._fail_version(group, reason, now, retry=retry, publishing=True)

    def _fail_version(
        self,
        group: VersionGroup,
        reason: str,
        now: float,
        retry: bool = True,
        publishing: bool = False,
    ) -> None:
        """A load try of ``group`` failed: tried again later while tries are left (``retry``),
        else it ends (END, with ``reason``). ``publishing``: its weights could not be
        published, or its workers not started (no worker of it ran)."""
        if retry and self._may_retry(group, publishing):
            self._retry_later(group, reason, now)
            return
        log.error("%s cannot serve: %s", group.label, reason)
        group.error = reason
        self.failed[group.version] = reason
        self.end_group(group, now, reason)
        if not self.groups and self.required:
            self.pool.fail_pool(reason)

    def _may_retry(self, group: VersionGroup, publishing: bool = False) -> bool:
        """Whether a failed load of ``group`` gets another try: as TF Serving's LoaderHarness
        (`--max_num_load_retries` more), where ending it would not fail the pool. At the
        pool's start (nothing of a model it started with serves yet) its slots retry with
        their own back-off and the pool fails when they cannot (`Controller._exited`); a
        failed publish has no slot to retry it, so it is retried here then too (TF Serving
        retries its first loads as any other: a start while the newest version was still
        being copied in failed at once)."""
        if group.failed_tries >= self.config.start_retries:
            return False
        return publishing or not self.required or self.serving_version() is not None

    def _retry_later(self, group: VersionGroup, reason: str, now: float) -> None:
        """Stays LOADING (TF Serving's state while it retries; GetModelStatus says no error
        yet) with nothing running, until the next try is due (`_retry_when_due`)."""
        group.failed_tries += 1
        group.last_error = reason
        interval = self.config.load_retry_interval_s
        group.retry_at = now + interval
        log.error(
            "%s failed to load (try %d of %d; tried again in %g s): %s",
            group.label, group.failed_tries, self.config.start_retries + 1, interval, reason,
        )  # fmt: skip
        self._stop_try(group, f"load try {group.failed_tries} failed")

    def _stop_try(self, group: VersionGroup, why: str) -> None:
        """What a failed try left ends: its publisher, its workers (their program group
        stays in supervisord, to be started again), its segment (the next try publishes
        the folder as it is then: a copy in progress may have completed)."""
        group.stop_publisher()
        if group.workers_started:
            self.pool.stop_groups([group.group])
            group.workers_started = False
        for slot in group.slots.values():
            self.pool.forget(slot, why)
            slot.load_failures = 0  # each try gives its slots a fresh count
            slot.start_pending = False
            if slot.state is not WorkerState.STOPPED:
                slot.change_state(WorkerState.STOPPED, why)
        group.unlink_segment()

    def _retry_when_due(self, group: VersionGroup, retry_at: float, now: float) -> None:
        """A version waiting to be tried again: dropped when its folder went or the policy
        no longer wants it (TF Serving cancels the retries of a version no longer aspired),
        else tried again once its interval has passed."""
        if group.version in self.aspired and now < retry_at:
            return  # the base path's poll notices a folder removed meanwhile
        if group.retry_due_since is None:
            group.retry_due_since = time.monotonic()
        on_disk = (
            self._still_on_disk(group.version, group.retry_due_since)
            if group.version in self.aspired
            else False
        )
        if on_disk is None:
            return  # its read has not returned: looked at again at the next tick
        if not on_disk:
            self._failed_when_asked.discard(group.version)
            self.end_group(group, now, "no longer on disk or wanted: not tried again")
            # END with its last error, as TF Serving's loader ends a version whose retries
            # it cancels.
            self._remember_ended(group.version, group.last_error)
            return
        group.retry_at = group.retry_due_since = None
        log.info(
            "%s: load try %d of %d",
            group.label, group.failed_tries + 1, self.config.start_retries + 1,
        )  # fmt: skip
        self._start_try(group, now)

    def _still_on_disk(self, version: int, since: float) -> bool | None:
        """Read now, not at the last poll: a retry must not publish a folder just removed.
        Read on a thread of its own (a hung mount held the loop here); None while it runs.
        A listing begun before ``since`` (when this retry came due) is another's, perhaps
        made before this version was there: read again."""
        read = self._retry_read.look()
        if read is not None and read.started < since:
            read = self._retry_read.look()
        if read is None:
            if self._retry_read.hung():
                self._say_poll_error("reading it has not returned (storage not answering?)")
            return None
        if isinstance(read.error, OSError):
            return True  # unreadable for a moment: the try says what is wrong, if anything
        if read.error is not None:
            raise read.error
        return version in (read.value or set())

    def _retire(self, group: VersionGroup, now: float, why: str) -> None:
        """AVAILABLE -> UNLOADING: the front door sends it nothing new (told at once);
        its workers finish what they have (`_advance`), then stop."""
        group.change_state(VersionState.UNLOADING, now, why)
        for slot in group.slots.values():
            if slot.state in (WorkerState.READY, WorkerState.STARTING):
                slot.change_state(WorkerState.DRAINING, f"version {group.version} retiring")
            elif slot.state in (WorkerState.BACKOFF, WorkerState.FATAL):
                # Not tried again: a FATAL one was started after its cool-down while its
                # version drained (found by a review).
                slot.change_state(WorkerState.STOPPED, f"version {group.version} retiring")

    def end_group(self, group: VersionGroup, now: float, why: str) -> None:
        """Its processes stop, its program group leaves supervisord, its segment is unlinked
        (the memory goes back with the processes that mapped it)."""
        group.stop_publisher()
        if group.in_supervisord:
            self.pool.stop_groups([group.group])
        for slot in group.slots.values():
            self.pool.forget(slot, why)
            self.pool.note_spawn_refused(slot.program, "")  # a refusal no look will read
            if slot.state is not WorkerState.STOPPED:
                slot.change_state(WorkerState.STOPPED, why)
        group.change_state(VersionState.END, now, why)
        for key, slot in group.slots.items():
            self._restarts_ended[key] = slot.restarts
        del self.groups[group.version]
        # Its segment first: a failed sync below escaped before it, and the segment (the
        # model's size in /dev/shm) outlived the pool, no group left to name it (found by a
        # review).
        group.unlink_segment()
        if group.in_supervisord:
            try:
                self.pool.sync_supervisord()
            except (OSError, xmlrpc.client.Error) as exc:
                # Its program group, stopped, stays in supervisord until the next sync (any
                # later change) writes the programs again without it.
                log.warning("removing %s from supervisord failed: %s", group.group, exc)

    def _remember_ended(self, version: int, error: str) -> None:
        """List ``version`` END from now on (the last RETIRED_SHOWN such versions)."""
        self.retired.pop(version, None)  # a version that came back and ended again: newest
        self.retired[version] = error
        for old in list(self.retired)[:-RETIRED_SHOWN]:
            del self.retired[old]
            self._remove_logs(old)

    def _remove_logs(self, version: int) -> None:
        """A version no longer shown loses its workers' logs (supervisord's backups too) and
        its publisher's: a pool that rolls versions for months kept files for every version
        it ever loaded, each worker's up to 60 MB (found by a hunt). The versions status
        still lists keep theirs, to say why they ended. Not while the version is loaded
        again, or failed and still on disk (its logs say why)."""
        if version in self.groups or version in self.failed:
            return
        paths = [
            path
            for slot in self.config.slots
            for path in program_logs(self.pool.log_dir, program_name(slot, version, self.prefix))
        ]
        paths.append(self._publish_log_path(version))
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # the operator's directory: said, never fatal
                log.warning("cannot remove the log of retired version %d: %s", version, exc)

    def note_failed_load(self, version: int) -> None:
        """A load attempt of ``version`` failed to read its SavedModel (counted by its
        folder, by the pool: TensorFlow's load_attempt_count{status="fail"}). Its folder is
        looked for on a thread (`_count_failed_loads`): version_path reads the base path,
        and storage that stopped answering held the loop here."""
        # Where it loads from now (a folder gone and back under another name: that one).
        config = self.config
        read = BackgroundRead(
            lambda: config.version_path(version), f"failed-load-{self.name}@{version}"
        )
        read.start()
        self._failed_load_reads.append((version, read, str(Path(config.model_base_path))))
        self._count_failed_loads(FAILED_LOAD_WAIT_S)

    def _count_failed_loads(self, wait_s: float = 0.0) -> None:
        """Counts the failed loads whose folder is known (the first waited for up to
        ``wait_s``); one whose look failed counts at ``<base>/<version>``."""
        waiting = []
        for version, read, base in self._failed_load_reads:
            outcome = read.wait(wait_s)
            wait_s = 0.0
            if outcome is None:
                waiting.append((version, read, base))
                continue
            path = outcome.value if outcome.value is not None else str(Path(base) / str(version))
            self._failed_load_paths[version] = path
            self.pool.note_failed_load(path)
        self._failed_load_reads = waiting

    def version_table(self) -> list[dict[str, Any]]:
        """What the front door and status report: every group, the failed versions still on
        disk, the last retired ones (END); with a version's failed load attempts, its folder
        (the front door's `model_path` label)."""
        rows: dict[int, dict[str, Any]] = {}
        for version, why in self.retired.items():
            rows[version] = {"version": version, "state": VersionState.END.value, "error": why}
        for version, why in self.failed.items():
            rows[version] = {"version": version, "state": VersionState.END.value, "error": why}
        for group in self.groups.values():
            rows[group.version] = group.describe()
        for version, row in rows.items():
            path = self._failed_load_paths.get(version)
            failed = self.pool.failed_loads_at(path) if path is not None else 0
            if failed:
                row["failed_loads"], row["path"] = failed, path
        return [rows[v] for v in sorted(rows)]

    def status_table(self) -> list[dict[str, Any]]:
        """The version table `mpspool status` shows: a version waiting to be tried again
        says why its last try failed (the front door's table leaves it out, so GetModelStatus
        says LOADING with no error, as TF Serving does between its retries)."""
        rows = self.version_table()
        for row in rows:
            group = self.groups.get(int(row["version"]))
            if group is not None and group.retry_at is not None:
                row["error"] = (
                    f"load try {group.failed_tries} of {self.config.start_retries + 1} failed, "
                    f"tried again {self.config.load_retry_interval_s:g} s after: "
                    f"{group.last_error}"
                )
            elif group is not None and group.waits_for_stop_since is not None:
                # (It said nothing: LOADING, no error, its slots STOPPED; found by a review.)
                row["error"] = (
                    f"its load waits for the earlier processes of {group.group} to stop "
                    "(supervisord SIGKILLs what ignores its stop 10 s after it)"
                )
        return rows

    # -- HandleReloadConfigRequest -----------------------------------------------------
    def failing_versions(self) -> set[int]:
        """The versions that failed (END) or wait to be tried again."""
        return set(self.failed) | {v for v, g in self.groups.items() if g.retry_at is not None}

    def note_reload_asked(self, failing: set[int], first: bool, now: float) -> None:
        """A HandleReloadConfigRequest was taken (``first``: none was waiting) when
        ``failing`` (`failing_versions`, read before the request changed anything) had
        failed: those had failed before every waiting request was asked, if before all.
        The base path is read again before it is answered: a version copied in since the
        last poll was refused a label, or waited for, as the poll's timing fell (found by a
        hunt)."""
        self._failed_when_asked = failing if first else self._failed_when_asked & failing
        self.read_again(now)

    def failed_before_reload(self) -> set[int]:
        """The versions that had failed before the waiting reloads were asked and do not
        serve now: they are neither waited for nor reported (config_reload.outcome)."""
        return self._failed_when_asked - self.available_versions()

    def tell_router_labels(self) -> bool:
        """The labels (and version table) to the front door now, not at the next reconcile:
        a HandleReloadConfigRequest's caller is answered right after, and may call by them.
        Whether the front door has them."""
        return self._tell_router_versions(router_answered=True)

    def _tell_router_versions(self, router_answered: bool) -> bool:
        """The version table, to the front door when it changed or the front door is a new
        one (which starts with the configured version only). Whether it has them now."""
        if not router_answered or self.removed:
            return False  # removed: the front door no longer serves it
        table = self.version_table()
        labels = self._labels_for_router()
        # A model the pool started with that has not served yet: its requests are UNAVAILABLE
        # while its first version loads, as TF Serving's clients meet a port not yet open.
        starting = self.required and not self.has_served
        told = (self.pool.router_pid, table, labels, starting)
        if told == self._versions_told:
            return True
        answer = self.pool.router.ask(
            "versions", model=self.name, versions=table, labels=labels, starting=starting
        )
        if answer is not None and answer.get("ok"):
            self._versions_told = told
            return True
        return False

    def stop(self) -> None:
        """The pool stops: publishers end, every segment is unlinked (the workers that map
        them are gone)."""
        for group in self.groups.values():
            group.stop_publisher()
            group.unlink_segment()
