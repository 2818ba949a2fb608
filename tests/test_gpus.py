"""GPU discovery and selection: the CUDA_VISIBLE_DEVICES rule, `--gpus`, and both backends.

This machine has no NVIDIA driver, so the real NvmlBackend is only checked for a clean
NoGpuDriver; its enumeration and Xid loop are exercised against a stub `pynvml` module.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from mpspool.mps import gpus
from mpspool.mps.gpus import (
    FakeGpuBackend,
    GpuError,
    GpuInfo,
    GpuUsage,
    NoGpuDriver,
    NvmlBackend,
    apply_visible_devices,
    compute_mode_warnings,
    parse_gpus,
    select,
    with_mps_warnings,
    without_mps_warnings,
)

A = GpuInfo(0, "GPU-aaaa1111-0000", "NVIDIA A10", 24 * 2**30, "EXCLUSIVE_PROCESS")
B = GpuInfo(1, "GPU-bbbb2222-0000", "NVIDIA A10", 24 * 2**30, "DEFAULT")
C = GpuInfo(2, "GPU-bbbb3333-0000", "NVIDIA L4", 22 * 2**30, "EXCLUSIVE_PROCESS")
PHYSICAL = [A, B, C]

HAS_DRIVER = Path("/proc/driver/nvidia/version").exists()


def uuids(devices: list[GpuInfo]) -> list[str]:
    return [gpu.uuid for gpu in devices]


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------


def test_unset_means_all_in_nvml_order() -> None:
    assert apply_visible_devices(PHYSICAL, None) == PHYSICAL


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,1,2", [A, B, C]),
        ("2,0", [C, A]),  # reordered
        (" 1 , 2 ", [B, C]),
        ("GPU-bbbb3333-0000,0", [C, A]),  # full UUID and index mixed
        ("GPU-aaaa", [A]),  # a unique prefix
        ("gpu-AAAA1111", [A]),  # case does not matter
        ("1,7,0", [B]),  # an index out of range truncates
        ("1,-1,0", [B]),
        ("0,GPU-bbbb,2", [A]),  # an ambiguous prefix names no GPU: truncates
        ("0,GPU-ffff", [A]),  # an unknown UUID truncates
        ("0,0,1", [A]),  # a GPU listed again truncates
        ("0,,1", [A]),
        ("1,junk,0", [B]),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("GPU-", []),
    ],
)
def test_visible_devices_rule(value: str, expected: list[GpuInfo]) -> None:
    seen = apply_visible_devices(PHYSICAL, value)
    assert uuids(seen) == uuids(expected)
    assert [gpu.index for gpu in seen] == list(range(len(expected)))  # re-indexed 0..n-1


# --- --gpus -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"), [("0", [0]), ("0,2", [0, 2]), (" 2 , 0 ", [2, 0]), ("10", [10])]
)
def test_parse_gpus(text: str, expected: list[int]) -> None:
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["", " ", "a", "0,", ",1", "0;1", "-1", "1.5", "0,,1", "all"])
def test_parse_gpus_rejects_junk(text: str) -> None:
    with pytest.raises(GpuError, match=r"expected comma-separated GPU indices") as info:
        parse_gpus(text)
    assert repr(text) in str(info.value)


def test_select_returns_in_the_order_asked() -> None:
    assert select(PHYSICAL, [2, 0], environ={}) == [C, A]
    assert select(PHYSICAL, [], environ={}) == []


def test_select_unknown_index_names_what_is_visible() -> None:
    seen = apply_visible_devices(PHYSICAL, None)[:2]
    with pytest.raises(GpuError) as info:
        select(seen, [0, 2], environ={})
    assert str(info.value) == (
        "--gpus 0,2: no such GPU 2; this process sees 2 GPUs: "
        "0 (NVIDIA A10, GPU-aaaa1111-0000), 1 (NVIDIA A10, GPU-bbbb2222-0000)"
    )


def test_select_mentions_cuda_visible_devices_when_set() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "2"}
    seen = apply_visible_devices(PHYSICAL, env["CUDA_VISIBLE_DEVICES"])
    with pytest.raises(GpuError) as info:
        select(seen, [1], environ=env)
    message = str(info.value)
    assert message.startswith("--gpus 1: no such GPU 1; this process sees 1 GPU: ")
    assert "0 (NVIDIA L4, GPU-bbbb3333-0000)" in message
    assert "CUDA_VISIBLE_DEVICES='2' is set" in message


def test_select_with_no_visible_gpu() -> None:
    with pytest.raises(GpuError, match=r"sees no GPUs \(CUDA_VISIBLE_DEVICES='' is set"):
        select([], [0], environ={"CUDA_VISIBLE_DEVICES": ""})


def test_select_rejects_duplicates() -> None:
    with pytest.raises(GpuError, match=r"^--gpus 0,1,0: GPU 0 is listed twice"):
        select(PHYSICAL, [0, 1, 0], environ={})


# --- Compute mode -----------------------------------------------------------------------------


def test_compute_mode_warnings() -> None:
    prohibited = GpuInfo(3, "GPU-dddd", "NVIDIA T4", 16 * 2**30, "PROHIBITED")
    warnings = compute_mode_warnings([A, B, C, prohibited])
    assert len(warnings) == 2
    default, prohibits = warnings
    assert default.startswith("GPU 1 (NVIDIA A10, GPU-bbbb2222-0000) is in compute mode DEFAULT")
    assert "MPS recommends EXCLUSIVE_PROCESS" in default
    # By UUID: nvidia-smi ignores CUDA_VISIBLE_DEVICES, so our index could name another GPU.
    assert default.endswith("nvidia-smi -i GPU-bbbb2222-0000 -c EXCLUSIVE_PROCESS")
    assert "PROHIBITED" in prohibits and "the MPS server included" in prohibits
    assert all("\n" not in w for w in warnings)
    assert compute_mode_warnings([A, C]) == []


def test_without_mps_an_exclusive_gpu_refuses_more_than_one_context() -> None:
    # A is EXCLUSIVE_PROCESS: one CUDA context at a time, so a second plain worker can't start.
    with pytest.raises(GpuError, match=r"^GPU 0 \(NVIDIA A10, GPU-aaaa1111-0000\) is in compute"
                       r" mode EXCLUSIVE_PROCESS: without MPS it admits one process at a time,"
                       r" and this pool would run 2 on it \(every model's workers count\);"
                       r" drop --no-mps, or run one worker per GPU$"):  # fmt: skip
        without_mps_warnings([B, A], 2)
    # One context fits, but a new version's worker could not start beside it.
    (lone,) = without_mps_warnings([A, B], 1)  # B is DEFAULT: nothing to say of it
    assert "EXCLUSIVE_PROCESS" in lone and "a new model version's worker cannot start" in lone
    assert without_mps_warnings([B], 1) == []  # DEFAULT, one context: nothing to say


def test_without_mps_a_prohibited_gpu_is_refused_whatever_the_count() -> None:
    prohibited = GpuInfo(3, "GPU-dddd", "NVIDIA T4", 16 * 2**30, "PROHIBITED")
    for contexts in (1, 4):
        with pytest.raises(GpuError, match=r"PROHIBITED: no process can use it; .* -c DEFAULT$"):
            without_mps_warnings([prohibited], contexts)


def test_without_mps_shared_gpus_are_warned_of_time_slicing() -> None:
    (warning,) = without_mps_warnings([B], 4)
    assert warning.startswith("--no-mps with 4 CUDA contexts per GPU: each worker's context")
    assert "time-slicing" in warning and "\n" not in warning
    # The compute-mode advice is MPS's: without MPS, DEFAULT is what several contexts need.
    assert "EXCLUSIVE_PROCESS" not in warning


def test_with_mps_more_clients_than_a_version_change_fits_are_warned_of() -> None:
    """Each version serves on contexts of its own, and a new one's start beside them: past
    the 48 clients an MPS server takes, a version change (or the versions a policy serves at
    once) cannot fit. One model rolls at a time: the largest one's contexts are what a roll
    adds."""
    assert with_mps_warnings([(24, 1)], 48) == []
    assert with_mps_warnings([(5, 1)] * 5, 48) == []  # 25 serving, 30 while one rolls
    (warning,) = with_mps_warnings([(25, 1)], 48)
    assert warning.startswith("25 MPS clients per GPU while serving (each model's contexts")
    assert "and 50 while a model loads a new version beside those: more than the 48" in warning
    assert "so a new version cannot load (the workers past 48 fail)" in warning
    (warning,) = with_mps_warnings([(20, 2)], 48)  # latest:2
    assert warning.startswith("40 MPS clients per GPU while serving") and "and 60 while" in warning
    (warning,) = with_mps_warnings([(20, 3)], 48)
    assert "so versions cannot all serve" in warning


# --- FakeGpuBackend ---------------------------------------------------------------------------

FAKE_JSON = json.dumps(
    [
        {
            "uuid": A.uuid,
            "name": A.name,
            "memory_total": A.memory_total,
            "compute_mode": A.compute_mode,
        },
        {
            "uuid": B.uuid,
            "name": B.name,
            "memory_total": B.memory_total,
            "compute_mode": B.compute_mode,
        },
        {"uuid": C.uuid},  # defaults for the rest
    ]
)


def test_backend_is_fake_when_env_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", FAKE_JSON)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpus.backend() as fake:
        assert isinstance(fake, FakeGpuBackend)
        devices = fake.devices()
        assert devices[:2] == [A, B]
        assert devices[2] == GpuInfo(2, C.uuid, "Fake GPU", 16 * 2**30, "EXCLUSIVE_PROCESS")


def test_fake_applies_cuda_visible_devices_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", FAKE_JSON)
    fake = gpus.backend()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb3,0")
    assert [(g.index, g.uuid) for g in fake.devices()] == [(0, C.uuid), (1, A.uuid)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert fake.devices() == []


def test_fake_usage_and_xid_queue() -> None:
    fake = FakeGpuBackend(PHYSICAL, environ={})
    assert fake.usage(A.uuid) == GpuUsage(memory_used=0, utilization_gpu=0)
    fake.set_usage(A.uuid, memory_used=5 * 2**30, utilization_gpu=73)
    assert fake.usage(A.uuid) == GpuUsage(5 * 2**30, 73)
    assert fake.xid_events() == []
    fake.queue_xid(B.uuid, 79)
    fake.queue_xid(A.uuid, 31)
    assert fake.xid_events() == [(B.uuid, 79), (A.uuid, 31)]
    assert fake.xid_events() == []  # drained, like NVML's event set
    with pytest.raises(GpuError, match="no GPU with UUID GPU-nope"):
        fake.usage("GPU-nope")
    with pytest.raises(GpuError, match="no GPU with UUID GPU-nope"):
        fake.queue_xid("GPU-nope", 79)
    fake.close()
    with pytest.raises(GpuError, match="closed"):
        fake.devices()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not valid JSON"),
        ('{"uuid": "GPU-a"}', "expected a JSON list"),
        ("[1]", r"MPSPOOL_FAKE_GPUS\[0\]: expected an object"),
        ('[{"name": "x"}]', r"\[0\]: \"uuid\" must be a string starting with \"GPU-\""),
        ('[{"uuid": "GPU-a"}, {"uuid": "abc"}]', r"\[1\]: \"uuid\" must"),
        ('[{"uuid": "GPU-a", "memory": 1}]', r"unknown keys \['memory'\]"),
        ('[{"uuid": "GPU-a", "memory_total": "16G"}]', "memory_total"),
        ('[{"uuid": "GPU-a", "compute_mode": "EXCLUSIVE"}]', "compute_mode"),
        ('[{"uuid": "GPU-a"}, {"uuid": "GPU-a"}]', "UUIDs must be unique"),
    ],
)
def test_fake_env_is_validated(text: str, match: str) -> None:
    with pytest.raises(GpuError, match=match) as info:
        gpus.backend({"MPSPOOL_FAKE_GPUS": text})
    assert "\n" not in str(info.value)


def test_fake_with_no_gpus_is_no_driver() -> None:
    with pytest.raises(NoGpuDriver, match="run without --gpus to use CPU workers"):
        gpus.backend({"MPSPOOL_FAKE_GPUS": "[]"})


# --- NvmlBackend, real --------------------------------------------------------------------------


@pytest.mark.skipif(HAS_DRIVER, reason="an NVIDIA driver is loaded here")
def test_real_nvml_without_driver_is_one_clean_line() -> None:
    with pytest.raises(NoGpuDriver) as info:
        NvmlBackend()
    message = str(info.value)
    assert message.startswith("no NVIDIA driver: NVML could not be loaded (")
    assert message.endswith("; run without --gpus to use CPU workers")
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.skipif(HAS_DRIVER, reason="an NVIDIA driver is loaded here")
def test_backend_defaults_to_nvml() -> None:
    with pytest.raises(NoGpuDriver):
        gpus.backend({})
    with pytest.raises(NoGpuDriver):
        gpus.backend({"MPSPOOL_FAKE_GPUS": ""})  # empty counts as unset


@pytest.mark.skipif(not HAS_DRIVER, reason="no NVIDIA driver here")
def test_real_nvml_with_driver() -> None:
    with NvmlBackend(environ={}) as nvml:
        devices = nvml.devices()
        assert [g.index for g in devices] == list(range(len(devices)))
        assert all(g.uuid.startswith("GPU-") and g.memory_total > 0 for g in devices)
        assert nvml.usage(devices[0].uuid).memory_used >= 0
        assert isinstance(nvml.xid_events(), list)


def test_missing_pynvml_is_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NoGpuDriver, match=r"^no NVML: the Python package nvidia-ml-py") as info:
        NvmlBackend()
    assert "\n" not in str(info.value)


# --- NvmlBackend against a stub pynvml ------------------------------------------------------------


class StubNvml(types.ModuleType):
    """Just enough of pynvml for NvmlBackend: three GPUs, one without Xid event support."""

    XID = 8

    def __init__(self, *, count: int = 3) -> None:
        super().__init__("pynvml")
        # pynvml's own class names, so the backend's `except nvml.NVMLError_Timeout` finds them.

        class NVMLError(Exception):
            pass

        class NVMLError_Timeout(NVMLError):
            pass

        class NVMLError_NotSupported(NVMLError):
            pass

        class NVMLError_NoPermission(NVMLError):
            pass

        self.NVMLError = NVMLError
        self.NVMLError_Timeout = NVMLError_Timeout
        self.NVMLError_NotSupported = NVMLError_NotSupported
        self.NVMLError_NoPermission = NVMLError_NoPermission
        self.nvmlEventTypeXidCriticalError = self.XID
        # handle -> (uuid bytes as old pynvml returns, name str as new pynvml returns, mode)
        self.gpus = {
            101: (b"GPU-aaaa1111-0000", "NVIDIA A10", 0),
            102: (b"GPU-bbbb2222-0000", "NVIDIA A10", 3),
            103: (b"GPU-bbbb3333-0000", "NVIDIA L4", 3),
        }
        self.count = count
        self.mig: set[int] = set()  # handles with MIG mode on
        self.pending: list[types.SimpleNamespace] = []
        self.registered: list[int] = []
        self.shutdowns = 0
        self.freed = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetMigMode(self, handle: int) -> tuple[int, int]:
        if handle == 101:
            raise self.NVMLError_NotSupported("Not Supported")  # an A10 has no MIG
        return (1, 1) if handle in self.mig else (0, 0)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return 101 + i

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.gpus[handle][0]

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.gpus[handle][1]

    def nvmlDeviceGetComputeMode(self, handle: int) -> int:
        return self.gpus[handle][2]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        if handle in self.mig:
            # NVML tells a MIG GPU's memory only to privileged callers (a container's is not).
            raise self.NVMLError_NoPermission("Insufficient Permissions")
        return types.SimpleNamespace(total=handle * 2**30, used=handle)

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> int:
        for handle, (u, _, _) in self.gpus.items():
            if u == uuid:
                return handle
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=42, memory=7)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types_: int, events: str) -> None:
        if handle == 103:
            raise self.NVMLError_NotSupported("Not Supported")
        self.registered.append(handle)

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> types.SimpleNamespace:
        assert timeout_ms == 0  # never blocks the supervisor's loop
        if not self.pending:
            raise self.NVMLError_Timeout("Timeout")
        return self.pending.pop(0)

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed += 1

    def event(self, handle: int, xid: int, kind: int = XID) -> None:
        self.pending.append(types.SimpleNamespace(device=handle, eventType=kind, eventData=xid))


def test_nvml_enumerates_and_applies_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub = StubNvml()
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    env = {"CUDA_VISIBLE_DEVICES": "2,0"}
    nvml = NvmlBackend(environ=env)
    assert nvml.devices() == [
        GpuInfo(0, "GPU-bbbb3333-0000", "NVIDIA L4", 103 * 2**30, "EXCLUSIVE_PROCESS"),
        GpuInfo(1, "GPU-aaaa1111-0000", "NVIDIA A10", 101 * 2**30, "DEFAULT"),
    ]
    assert nvml.usage("GPU-aaaa1111-0000") == GpuUsage(memory_used=101, utilization_gpu=42)
    with pytest.raises(GpuError, match=r"^GPU GPU-nope: NVML cannot read its usage \(Not Found\)"):
        nvml.usage("GPU-nope")
    nvml.close()
    nvml.close()
    assert stub.shutdowns == 1
    with pytest.raises(GpuError, match="closed"):
        nvml.devices()


def test_a_gpu_with_mig_mode_on_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA sees a MIG-enabled GPU's instances, not the GPU by its UUID: its workers would
    all see no GPU. NVML tells (nvmlDeviceGetMigMode); `--gpus` refuses it at start."""
    stub = StubNvml()
    stub.mig = {103}
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    with NvmlBackend(environ={}) as nvml:
        devices = nvml.devices()
    assert [g.mig for g in devices] == [False, False, True]
    assert select(devices, [0, 1]) == devices[:2]
    refused = r"^--gpus 2: GPU 2 \(NVIDIA L4, GPU-bbbb3333-0000\) has MIG mode on"
    with pytest.raises(GpuError, match=refused):
        select(devices, [2])
    fake = FakeGpuBackend.from_json('[{"uuid": "GPU-m", "mig": true}]', environ={})
    with pytest.raises(GpuError, match="has MIG mode on, so CUDA sees only its MIG instances"):
        select(fake.devices(), [0])


def test_nvml_xid_events_drain_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubNvml()
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    with NvmlBackend(environ={}) as nvml:
        assert nvml.xid_events() == []
        assert stub.registered == [101, 102]  # 103 does not support events: skipped
        stub.event(102, 79)
        stub.event(101, 0, kind=1)  # not an Xid event: ignored
        stub.event(101, 48)
        assert nvml.xid_events() == [("GPU-bbbb2222-0000", 79), ("GPU-aaaa1111-0000", 48)]
        assert nvml.xid_events() == []
    assert stub.freed == 1 and stub.shutdowns == 1


def test_nvml_with_no_gpu_is_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubNvml(count=0)
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    with pytest.raises(NoGpuDriver, match=r"^no NVIDIA GPU: the driver is loaded but lists none"):
        NvmlBackend()
    assert stub.shutdowns == 1


def test_nvml_init_failure_is_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubNvml()

    def fail() -> None:
        raise stub.NVMLError("Driver/library version mismatch\n(reboot?)")

    stub.nvmlInit = fail  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    with pytest.raises(NoGpuDriver) as info:
        NvmlBackend()
    assert str(info.value) == (
        "no NVIDIA driver: NVML could not be loaded (Driver/library version mismatch "
        "(reboot?)); run without --gpus to use CPU workers"
    )
