"""GPU discovery and selection: which NVIDIA GPUs this process sees, and which ones `--gpus` means.

Everything GPU-specific that the rest of mpspool needs goes through one small interface,
`GpuBackend`, so that the supervisor, the metrics and the tests never touch NVML directly:

* `NvmlBackend` asks the driver through NVML (the `nvidia-ml-py` package, imported lazily so
  that this module loads on machines without it).
* `FakeGpuBackend` is the test and development boundary for machines without GPUs. It is built
  from a list of `GpuInfo`, or from the environment variable ``MPSPOOL_FAKE_GPUS``, a JSON list
  such as::

      [{"uuid": "GPU-aaa", "name": "NVIDIA A10", "memory_total": 24000000000,
        "compute_mode": "EXCLUSIVE_PROCESS"}]

  Only ``uuid`` is required. ``MPSPOOL_FAKE_GPUS`` is a test boundary, not a feature: set, it
  replaces the driver entirely (see `backend()`).

Indices are always as *this process* sees them, i.e. after CUDA_VISIBLE_DEVICES, because that
is what a user who typed `--gpus 0` on a machine or in a container means. Workers, on the other
hand, are given UUIDs in their own CUDA_VISIBLE_DEVICES: a UUID names the same GPU whatever
the worker's environment, while an index would be re-interpreted relative to it.

Both backends apply CUDA_VISIBLE_DEVICES with the same function, `apply_visible_devices()`.
It numbers physical GPUs in NVML order, which is PCI bus order; CUDA uses that order only
when CUDA_DEVICE_ORDER=PCI_BUS_ID (its default, FASTEST_FIRST, can differ on machines that mix
GPU models). Workers are unaffected, since they get UUIDs.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

FAKE_GPUS_ENV = "MPSPOOL_FAKE_GPUS"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

DEFAULT = "DEFAULT"
EXCLUSIVE_THREAD = "EXCLUSIVE_THREAD"
PROHIBITED = "PROHIBITED"
EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"
UNKNOWN = "UNKNOWN"
COMPUTE_MODES = (DEFAULT, EXCLUSIVE_THREAD, PROHIBITED, EXCLUSIVE_PROCESS)

# NVML's nvmlComputeMode_t values (stable since NVML's first release).
_NVML_COMPUTE_MODES = {0: DEFAULT, 1: EXCLUSIVE_THREAD, 2: PROHIBITED, 3: EXCLUSIVE_PROCESS}

_CPU_HINT = "run without --gpus to use CPU workers"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as this process sees it."""

    index: int  # as THIS process sees it (after CUDA_VISIBLE_DEVICES)
    uuid: str  # "GPU-...": what workers get in their CUDA_VISIBLE_DEVICES
    name: str
    memory_total: int  # bytes
    compute_mode: str  # one of COMPUTE_MODES, or UNKNOWN where NVML cannot tell
    # MIG mode on: CUDA enumerates the GPU's MIG instances, never the GPU by its own UUID.
    mig: bool = False

    def describe(self) -> str:
        """`0 (NVIDIA A10, GPU-aaa)`: how messages name a GPU so a user can find it."""
        return f"{self.index} ({self.name}, {self.uuid})"


@dataclass(frozen=True)
class GpuUsage:
    """A sample of one GPU's load, for metrics and placement."""

    memory_used: int  # bytes
    utilization_gpu: int  # percent of the last sample period with a kernel running


class GpuError(Exception):
    """A GPU problem a user can meet; its message is one line, meant to be shown as is."""

    def __init__(self, message: str) -> None:
        # Callers print str(error) on one log line or one CLI line; keep it that way even when
        # the message embeds text from a library.
        super().__init__(" ".join(line.strip() for line in str(message).splitlines()))


class NoGpuDriver(GpuError):
    """No usable NVIDIA driver: NVML missing or not loadable, driver not loaded, or no GPUs.

    A separate class because it has a separate remedy: use CPU workers, not another GPU.
    """


class GpuBackend(Protocol):
    """What mpspool needs to know about GPUs, and nothing more."""

    def devices(self) -> list[GpuInfo]:
        """The GPUs this process sees, indexed 0..n-1 after CUDA_VISIBLE_DEVICES."""
        ...

    def usage(self, uuid: str) -> GpuUsage:
        """Memory used and utilisation of one GPU, named by UUID."""
        ...

    def xid_events(self) -> list[tuple[str, int]]:
        """(uuid, xid) for every critical Xid error since the last call; never blocks."""
        ...

    def close(self) -> None:
        """Release the driver's resources; idempotent."""
        ...


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------


def apply_visible_devices(physical: Sequence[GpuInfo], value: str | None) -> list[GpuInfo]:
    """The GPUs a CUDA process would see, given CUDA_VISIBLE_DEVICES=`value`, re-indexed 0..n-1.

    `physical` is every GPU in NVML order, its position being the physical index. The rule is
    CUDA's: unset means all GPUs in that order; otherwise a comma-separated list of physical
    indices and/or UUIDs ("GPU-" followed by enough of the UUID to be unique), taken in the
    listed order and *truncated at the first entry that names no GPU* (an index out of range,
    a negative number, junk, an unknown or ambiguous UUID prefix, a GPU already listed). So an
    empty value, "-1" and "NoDevFiles" (what some batch schedulers set) all mean no GPU, and
    "1,7,0" on a two-GPU machine means just GPU 1. Both backends call this, so that tests of
    the fake exercise the rule the real backend uses.
    """
    if value is None:
        return [replace(gpu, index=i) for i, gpu in enumerate(physical)]
    chosen: list[GpuInfo] = []
    for raw in value.split(","):
        gpu = _resolve_visible_entry(physical, raw.strip())
        if gpu is None or any(g.uuid == gpu.uuid for g in chosen):
            break  # CUDA ignores this entry and everything after it
        chosen.append(gpu)
    return [replace(gpu, index=i) for i, gpu in enumerate(chosen)]


def _resolve_visible_entry(physical: Sequence[GpuInfo], entry: str) -> GpuInfo | None:
    """The GPU one CUDA_VISIBLE_DEVICES entry names, or None if it names none (or several)."""
    if re.fullmatch(r"[0-9]+", entry):
        i = int(entry)
        return physical[i] if i < len(physical) else None
    if entry[:4].upper() == "GPU-" and len(entry) > 4:
        matches = [g for g in physical if g.uuid.lower().startswith(entry.lower())]
        return matches[0] if len(matches) == 1 else None
    return None  # "-1", "NoDevFiles", "" (a trailing comma), MIG-... (not supported here)


# --- Selection and validation -----------------------------------------------------------------


def parse_gpus(text: str) -> list[int]:
    """Parse `--gpus` ("0,2", spaces allowed) into indices as this process sees them."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(re.fullmatch(r"[0-9]+", part) for part in parts):
        raise GpuError(
            f"--gpus {text!r}: expected comma-separated GPU indices as this process sees them, "
            "such as 0 or 0,2"
        )
    return [int(part) for part in parts]


def select(
    devices: Sequence[GpuInfo],
    wanted: Sequence[int],
    environ: Mapping[str, str] | None = None,
) -> list[GpuInfo]:
    """The GPUs `--gpus` asks for, in the order asked; GpuError naming what exists otherwise.

    `devices` is a backend's `devices()`. `environ` (default os.environ) is only read to tell
    the user that CUDA_VISIBLE_DEVICES shaped what this process sees, which is the usual reason
    a GPU that nvidia-smi lists "does not exist" here.
    """
    env = os.environ if environ is None else environ
    flag = "--gpus " + ",".join(str(i) for i in wanted)
    seen: set[int] = set()
    for i in wanted:
        if i in seen:
            raise GpuError(f"{flag}: GPU {i} is listed twice; list each GPU once")
        seen.add(i)
    by_index = {gpu.index: gpu for gpu in devices}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        which = ", ".join(str(i) for i in missing)
        visible = _describe_visible(devices, env.get(VISIBLE_DEVICES_ENV))
        raise GpuError(f"{flag}: no such GPU {which}; {visible}")
    for i in wanted:
        if by_index[i].mig:
            # Its workers, given its UUID, would see no GPU at all (worker/serve.py).
            raise GpuError(
                f"{flag}: GPU {by_index[i].describe()} has MIG mode on, so CUDA sees only its "
                "MIG instances, which mpspool does not place workers on (it shares whole GPUs "
                f"through MPS); turn MIG off (nvidia-smi -i {by_index[i].uuid} -mig 0, as an "
                "administrator) or give the pool another GPU"
            )
    return [by_index[i] for i in wanted]


def _describe_visible(devices: Sequence[GpuInfo], visible: str | None) -> str:
    """ "this process sees 2 GPUs: 0 (...), 1 (...)", plus CUDA_VISIBLE_DEVICES when set."""
    if not devices:
        text = "this process sees no GPUs"
    else:
        noun = "GPU" if len(devices) == 1 else "GPUs"
        listed = ", ".join(gpu.describe() for gpu in devices)
        text = f"this process sees {len(devices)} {noun}: {listed}"
    if visible is not None:
        text += (
            f" (CUDA_VISIBLE_DEVICES={visible!r} is set: indices count from 0 among the GPUs "
            "it lists)"
        )
    return text


def compute_mode_warnings(selected: Sequence[GpuInfo]) -> list[str]:
    """One warning line per selected GPU whose compute mode is not EXCLUSIVE_PROCESS.

    NVIDIA's MPS guide recommends EXCLUSIVE_PROCESS so that the MPS server is the only process
    holding a context on the GPU; in DEFAULT mode a stray non-MPS process can still share it,
    and in PROHIBITED mode nothing (MPS included) can use it. The compute mode is an admin's
    setting (root, and no process on the GPU), so mpspool only warns and never changes it. The
    suggested command names the GPU by UUID because nvidia-smi ignores CUDA_VISIBLE_DEVICES, so
    this process's index could name another GPU there.
    """
    warnings = []
    for gpu in selected:
        if gpu.compute_mode == EXCLUSIVE_PROCESS:
            continue
        if gpu.compute_mode == PROHIBITED:
            effect = "no process, the MPS server included, can use it"
        else:
            effect = "MPS recommends EXCLUSIVE_PROCESS so that only the MPS server uses it"
        warnings.append(
            f"GPU {gpu.describe()} is in compute mode {gpu.compute_mode}: {effect}; mpspool does "
            f"not change it, an administrator can: nvidia-smi -i {gpu.uuid} -c EXCLUSIVE_PROCESS"
        )
    return warnings


def without_mps_warnings(selected: Sequence[GpuInfo], contexts_per_gpu: int) -> list[str]:
    """For `--no-mps`, given the pool's CUDA contexts per GPU (every model's workers): GpuError
    where the GPUs cannot run them at all, else warnings of what will not work well.

    Without MPS every worker holds a CUDA context of its own, and so does a new version's
    worker while the old one still serves. A PROHIBITED GPU admits none. A GPU in an exclusive
    mode admits one context (one process) at a time: several workers on it could never all
    start, which is an error now rather than a restart loop later, and a lone worker's next
    version could not start beside it. In DEFAULT mode the contexts time-slice the GPU: on an
    H200 (bench/RESULTS.md, MPS section, two runs) two to eight processes without MPS served
    0.34-0.47 times the calls one process served alone, where with MPS they served 1.9-8.6
    times as many.
    """
    warnings = []
    for gpu in selected:
        if gpu.compute_mode == PROHIBITED:
            raise GpuError(
                f"GPU {gpu.describe()} is in compute mode PROHIBITED: no process can use it; "
                f"an administrator can change that: nvidia-smi -i {gpu.uuid} -c DEFAULT"
            )
        if gpu.compute_mode not in (EXCLUSIVE_PROCESS, EXCLUSIVE_THREAD):
            continue
        if contexts_per_gpu > 1:
            raise GpuError(
                f"GPU {gpu.describe()} is in compute mode {gpu.compute_mode}: without MPS it "
                f"admits one process at a time, and this pool would run {contexts_per_gpu} "
                "on it (every model's workers count); drop --no-mps, or run one worker per GPU"
            )
        warnings.append(
            f"GPU {gpu.describe()} is in compute mode {gpu.compute_mode}: without MPS it "
            "admits one process at a time, so a new model version's worker cannot start while "
            "the serving one holds it (versions change only across a restart)"
        )
    if contexts_per_gpu > 1:
        warnings.append(
            f"--no-mps with {contexts_per_gpu} CUDA contexts per GPU: each worker's context "
            "gets the GPU in turn (time-slicing) instead of running beside the others; expect "
            "less throughput than one worker per GPU (bench/RESULTS.md, MPS section)"
        )
    return warnings


def with_mps_warnings(groups: Sequence[tuple[int, int]], max_clients: int) -> list[str]:
    """For an MPS pool, given each model's (contexts per GPU, versions its policy serves at
    once): what will not work. Each version serves on contexts of its own, and a new version's
    workers start beside the serving ones, each an MPS client; past the MPS server's
    `max_clients` the workers it refuses see no GPU and fail to load (worker/serve.py), and
    that version never serves."""
    serving = sum(contexts * versions for contexts, versions in groups)
    loading = serving + max((contexts for contexts, _ in groups), default=0)
    if loading <= max_clients:
        return []
    return [
        f"{serving} MPS clients per GPU while serving (each model's contexts, for each version "
        f"its policy serves) and {loading} while a model loads a new version beside those: "
        f"more than the {max_clients} an MPS server takes, so "
        + ("versions cannot all serve" if serving > max_clients else "a new version cannot load")
        + f" (the workers past {max_clients} fail); fewer contexts per GPU, or versions served "
        "at once, let versions change while serving"
    ]


# --- Backends ---------------------------------------------------------------------------------


def backend(environ: Mapping[str, str] | None = None) -> GpuBackend:
    """FakeGpuBackend when MPSPOOL_FAKE_GPUS is set (and not empty), NvmlBackend otherwise."""
    env = os.environ if environ is None else environ
    fake = env.get(FAKE_GPUS_ENV, "")
    if fake.strip():
        return FakeGpuBackend.from_json(fake, environ=environ)
    return NvmlBackend(environ=environ)


class FakeGpuBackend:
    """GPUs made of data, for tests and for development on machines without GPUs.

    Built from the physical GPUs (in the order NVML would list them; their `index` fields are
    ignored and replaced by their position), it applies CUDA_VISIBLE_DEVICES with the same
    function as NvmlBackend. Tests set usage with `set_usage()` and inject Xid errors with
    `queue_xid()`.
    """

    def __init__(
        self, physical: Sequence[GpuInfo], environ: Mapping[str, str] | None = None
    ) -> None:
        if not physical:
            # Mirrors NvmlBackend with a driver but no GPU, so the CPU fallback can be tested.
            raise NoGpuDriver(f"no NVIDIA GPU: the fake GPU list is empty; {_CPU_HINT}")
        uuids = [gpu.uuid for gpu in physical]
        if len(set(uuids)) != len(uuids):
            raise GpuError(f"fake GPUs: UUIDs must be unique, got {uuids}")
        self._physical = [replace(gpu, index=i) for i, gpu in enumerate(physical)]
        self._environ = environ
        self._usage: dict[str, GpuUsage] = {}
        self._xids: deque[tuple[str, int]] = deque()
        self._closed = False

    @classmethod
    def from_json(cls, text: str, environ: Mapping[str, str] | None = None) -> FakeGpuBackend:
        """Parse MPSPOOL_FAKE_GPUS: a JSON list of {"uuid", "name", "memory_total",
        "compute_mode"} objects; only "uuid" (starting with "GPU-") is required."""
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise GpuError(f"{FAKE_GPUS_ENV}: not valid JSON ({e})") from None
        if not isinstance(entries, list):
            raise GpuError(f"{FAKE_GPUS_ENV}: expected a JSON list of GPU objects")
        return cls([_fake_gpu(i, entry) for i, entry in enumerate(entries)], environ=environ)

    def devices(self) -> list[GpuInfo]:
        """The fake GPUs this process sees after CUDA_VISIBLE_DEVICES."""
        self._check_open()
        env = os.environ if self._environ is None else self._environ
        return apply_visible_devices(self._physical, env.get(VISIBLE_DEVICES_ENV))

    def usage(self, uuid: str) -> GpuUsage:
        """What `set_usage()` last set for this GPU (zero until then)."""
        self._check_open()
        self._physical_gpu(uuid)
        return self._usage.get(uuid, GpuUsage(memory_used=0, utilization_gpu=0))

    def set_usage(self, uuid: str, memory_used: int, utilization_gpu: int) -> None:
        """Make `usage(uuid)` return these numbers."""
        self._physical_gpu(uuid)
        self._usage[uuid] = GpuUsage(memory_used=memory_used, utilization_gpu=utilization_gpu)

    def queue_xid(self, uuid: str, xid: int) -> None:
        """Make the next `xid_events()` report Xid `xid` on this GPU."""
        self._physical_gpu(uuid)
        self._xids.append((uuid, xid))

    def xid_events(self) -> list[tuple[str, int]]:
        """The queued Xid events, oldest first, emptying the queue (like the NVML event set)."""
        self._check_open()
        events = list(self._xids)
        self._xids.clear()
        return events

    def close(self) -> None:
        """Further calls raise GpuError, as they would on a closed NvmlBackend."""
        self._closed = True

    def __enter__(self) -> FakeGpuBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _physical_gpu(self, uuid: str) -> GpuInfo:
        for gpu in self._physical:
            if gpu.uuid == uuid:
                return gpu
        raise GpuError(f"no GPU with UUID {uuid}")

    def _check_open(self) -> None:
        if self._closed:
            raise GpuError("the GPU backend is closed")


def _fake_gpu(position: int, entry: Any) -> GpuInfo:
    """One MPSPOOL_FAKE_GPUS entry, validated so a typo fails loudly instead of silently."""
    where = f"{FAKE_GPUS_ENV}[{position}]"
    if not isinstance(entry, dict):
        raise GpuError(f'{where}: expected an object such as {{"uuid": "GPU-aaa"}}')
    unknown = sorted(set(entry) - {"uuid", "name", "memory_total", "compute_mode", "mig"})
    if unknown:
        raise GpuError(f"{where}: unknown keys {unknown}")
    uuid = entry.get("uuid")
    if not isinstance(uuid, str) or not uuid.startswith("GPU-"):
        raise GpuError(f'{where}: "uuid" must be a string starting with "GPU-", got {uuid!r}')
    name = entry.get("name", "Fake GPU")
    memory_total = entry.get("memory_total", 16 * 2**30)
    compute_mode = entry.get("compute_mode", EXCLUSIVE_PROCESS)
    if not isinstance(name, str):
        raise GpuError(f'{where}: "name" must be a string, got {name!r}')
    if isinstance(memory_total, bool) or not isinstance(memory_total, int) or memory_total < 0:
        raise GpuError(f'{where}: "memory_total" must be bytes (an integer >= 0)')
    if compute_mode not in COMPUTE_MODES:
        raise GpuError(
            f'{where}: "compute_mode" must be one of {", ".join(COMPUTE_MODES)}, '
            f"got {compute_mode!r}"
        )
    mig = entry.get("mig", False)
    if not isinstance(mig, bool):
        raise GpuError(f'{where}: "mig" must be true or false, got {mig!r}')
    return GpuInfo(position, uuid, name, memory_total, compute_mode, mig)


class NvmlBackend:
    """The real GPUs, through NVML (nvidia-ml-py's `pynvml`).

    Construction initialises NVML and raises NoGpuDriver when there is nothing to talk to (no
    pynvml, no libnvidia-ml, driver not loaded, no GPU), so that callers can fall back to CPU
    workers with one clear line instead of a ctypes traceback.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self._events: Any = None  # nvmlEventSet_t, created on the first xid_events()
        self._event_uuids: dict[int | None, str] = {}
        self._closed = False
        try:
            import pynvml  # lazy: the module must load where nvidia-ml-py is not installed
        except ImportError as e:
            raise NoGpuDriver(
                f"no NVML: the Python package nvidia-ml-py is not installed ({e}); install it "
                f"or {_CPU_HINT}"
            ) from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as e:  # LibraryNotFound, DriverNotLoaded, LibRmVersionMismatch, ...
            raise NoGpuDriver(
                f"no NVIDIA driver: NVML could not be loaded ({_nvml_text(e)}); {_CPU_HINT}"
            ) from None
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise NoGpuDriver(
                f"no NVIDIA GPU: NVML cannot count GPUs ({_nvml_text(e)}); {_CPU_HINT}"
            ) from None
        if count == 0:
            pynvml.nvmlShutdown()
            raise NoGpuDriver(f"no NVIDIA GPU: the driver is loaded but lists none; {_CPU_HINT}")

    def devices(self) -> list[GpuInfo]:
        """Every GPU NVML lists, then CUDA_VISIBLE_DEVICES applied (read now, not at init)."""
        env = os.environ if self._environ is None else self._environ
        physical = [gpu for gpu, _ in self._physical()]
        return apply_visible_devices(physical, env.get(VISIBLE_DEVICES_ENV))

    def usage(self, uuid: str) -> GpuUsage:
        """Memory used (bytes) and GPU utilisation (percent) from NVML's last sample."""
        nvml = self._open()
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        except nvml.NVMLError as e:
            raise GpuError(f"GPU {uuid}: NVML cannot read its usage ({_nvml_text(e)})") from None
        return GpuUsage(memory_used=int(memory.used), utilization_gpu=int(rates.gpu))

    def xid_events(self) -> list[tuple[str, int]]:
        """Drain NVML's critical-Xid event set without waiting.

        The set is created on the first call (registering every GPU NVML lists, visible or
        not; callers filter by UUID), so events from before that call are not reported. GPUs
        that do not support Xid events are skipped rather than failing the rest.
        """
        nvml = self._open()
        if self._events is None:
            self._events = self._register_xid_events()
        events: list[tuple[str, int]] = []
        while True:
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError_Timeout:
                return events  # nothing (more) pending
            except nvml.NVMLError as e:
                raise GpuError(f"NVML cannot read Xid events ({_nvml_text(e)})") from None
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                uuid = self._event_uuids.get(_handle_key(data.device), "GPU-unknown")
                events.append((uuid, int(data.eventData)))

    def close(self) -> None:
        """Free the event set and shut NVML down; idempotent."""
        if self._closed:
            return
        self._closed = True
        nvml = self._nvml
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # shutting down anyway; nothing useful to tell the caller
        self._events = None

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> Any:
        if self._closed:
            raise GpuError("the GPU backend is closed")
        return self._nvml

    def _physical(self) -> list[tuple[GpuInfo, Any]]:
        """(GpuInfo with the physical index, NVML handle) for every GPU this process may open."""
        nvml = self._open()
        found: list[tuple[GpuInfo, Any]] = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            raise GpuError(f"NVML cannot count GPUs ({_nvml_text(e)})") from None
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except nvml.NVMLError_NoPermission:
                # A GPU whose device node is not in this container: CUDA cannot open it either,
                # so it does not count towards CUDA's indices.
                continue
            except nvml.NVMLError as e:
                raise GpuError(f"NVML GPU {i}: cannot open it ({_nvml_text(e)})") from None
            try:
                mig = nvml.nvmlDeviceGetMigMode(handle)[0] == 1  # (current, pending)
            except nvml.NVMLError:
                mig = False  # NotSupported: a GPU without MIG
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                name = _text(nvml.nvmlDeviceGetName(handle))
                memory_total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            except nvml.NVMLError_NoPermission as e:
                if not mig:
                    raise GpuError(f"NVML GPU {i}: cannot read it ({_nvml_text(e)})") from None
                # NVML tells a MIG GPU's memory only to privileged callers (a container given
                # one of its instances is not): it is refused for its MIG mode (select), which
                # says more than this would.
                memory_total = 0
            except nvml.NVMLError as e:
                raise GpuError(f"NVML GPU {i}: cannot read it ({_nvml_text(e)})") from None
            try:
                mode = _NVML_COMPUTE_MODES.get(nvml.nvmlDeviceGetComputeMode(handle), UNKNOWN)
            except nvml.NVMLError:
                mode = UNKNOWN  # e.g. NotSupported; only used for a warning
            found.append((GpuInfo(len(found), uuid, name, memory_total, mode, mig), handle))
        return found

    def _register_xid_events(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            raise GpuError(f"NVML cannot create an event set ({_nvml_text(e)})") from None
        for gpu, handle in self._physical():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError_NotSupported:
                continue  # e.g. some virtualised GPUs; they simply report no Xid events
            except nvml.NVMLError as e:
                nvml.nvmlEventSetFree(events)
                raise GpuError(
                    f"GPU {gpu.uuid}: NVML cannot watch it for Xid errors ({_nvml_text(e)})"
                ) from None
            # Keyed by handle now, because after an Xid like 79 (fallen off the bus) the GPU
            # may no longer answer nvmlDeviceGetUUID.
            self._event_uuids[_handle_key(handle)] = gpu.uuid
        return events


def _handle_key(handle: Any) -> int | None:
    """The address an NVML device handle points at: equal for handles of the same GPU."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _text(value: str | bytes) -> str:
    """pynvml returns str in recent versions and bytes in older ones."""
    return value.decode() if isinstance(value, bytes) else value


def _nvml_text(error: BaseException) -> str:
    """An NVML error's own words ("Driver Not Loaded"), never a traceback."""
    return str(error).strip() or type(error).__name__
