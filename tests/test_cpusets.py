"""CPU placement: DeepRec's SESSION_GROUP_CPUSET syntax, `auto`, and a real pool whose
workers are read back on the cores they were given."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpspool import cpusets
from mpspool.cli import build_parser
from mpspool.config import ConfigError, PoolConfig, ServedModel

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd

EIGHT = range(8)


# -- parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["2-4;5-7", "2,3,4;5,6,7", " 2-3,4 ; 5,6-7 ", "4,2,3;7-7,5,6"])
def test_both_syntaxes_give_the_same_sets(text: str) -> None:
    assert cpusets.parse(text, 2, EIGHT) == (frozenset({2, 3, 4}), frozenset({5, 6, 7}))


def test_groups_may_share_cores_and_keep_slot_order() -> None:
    assert cpusets.parse("3;0-1;3", 3, EIGHT) == (
        frozenset({3}),
        frozenset({0, 1}),
        frozenset({3}),
    )


def test_a_core_outside_the_usable_ones_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        cpusets.parse("0-1;8-9", 2, EIGHT)
    message = str(info.value)
    assert "8-9" in message and "group 2" in message and "usable cores: 0-7" in message
    # Usable is this process's affinity, not the machine's core count: a gap is refused too.
    with pytest.raises(ConfigError, match=r"core\(s\) 2 of group 1 .* usable cores: 0-1,3"):
        cpusets.parse("2;3", 2, [0, 1, 3])


def test_group_count_must_equal_workers() -> None:
    with pytest.raises(ConfigError, match=r"3 group\(s\) of cores but the pool has 2 worker"):
        cpusets.parse("0;1;2", 2, EIGHT)
    with pytest.raises(ConfigError, match=r"1 group\(s\) of cores but the pool has 4 worker"):
        cpusets.parse("0-7", 4, EIGHT)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("0;", "group 2 is empty"),
        (";1", "group 1 is empty"),
        ("0,;1", "'' in group 1"),
        ("a;1", "'a' in group 1"),
        ("0-;1", "'0-' in group 1"),
        ("0;1-2-3", "'1-2-3' in group 2"),
        ("-1;0", "'-1' in group 1"),
        ("0 1;2", "'0 1' in group 1"),
        ("3-1;0", "range 3-1 in group 1 is reversed"),
    ],
)
def test_malformed_text_says_what_was_expected(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        cpusets.parse(text, 2, EIGHT)
    assert fragment in str(info.value)
    if "reversed" not in fragment:
        assert "one group of cores per worker" in str(info.value)


def test_no_spec_means_no_pinning() -> None:
    placement = cpusets.plan("", 4, EIGHT)
    assert not placement.pinned and placement.reserved == frozenset()
    assert "no CPU pinning" in placement.explanation


# -- auto -------------------------------------------------------------------------------
def sets(placement: cpusets.Placement) -> list[str]:
    return [cpusets.format_cores(s) for s in placement.workers]


@pytest.mark.parametrize(
    ("cores", "workers", "reserved", "expected", "said"),
    [
        # Enough for one spare core: the front door and controller get it.
        (range(3), 2, "0", ["1", "2"], "core 0 for the front door and controller"),
        (range(8), 2, "0", ["1-4", "5-7"], "core 0 for the front door"),
        (range(16), 2, "0", ["1-8", "9-15"], "core 0 for the front door"),
        (range(16), 4, "0", ["1-4", "5-8", "9-12", "13-15"], "core 0 for the front door"),
        (range(8), 4, "0", ["1-2", "3-4", "5-6", "7"], "core 0 for the front door"),
        # As many cores as workers: all to the workers, the front door shares.
        (range(2), 2, "", ["0", "1"], "they share the workers' cores"),
        (range(4), 4, "", ["0", "1", "2", "3"], "they share the workers' cores"),
        # Fewer cores than workers: round-robin, and the line says so.
        (range(2), 4, "", ["0", "1", "0", "1"], "fewer cores than workers"),
        (range(3), 4, "", ["0", "1", "2", "0"], "1 core(s) run two or more workers"),
        # The usable cores, not 0..n-1: a restricted process (taskset, a container's cpuset).
        ([4, 5, 6, 9], 2, "4", ["5-6", "9"], "core 4 for the front door"),
    ],
)
def test_auto(
    cores: range | list[int], workers: int, reserved: str, expected: list[str], said: str
) -> None:
    placement = cpusets.plan("auto", workers, cores)
    assert sets(placement) == expected
    assert cpusets.format_cores(placement.reserved) == reserved
    assert said in placement.explanation
    assert "\n" not in placement.explanation
    # Every usable core is used by someone.
    used = set(placement.reserved).union(*placement.workers)
    assert used == set(cores)


@pytest.mark.parametrize(
    ("spec", "cores", "workers", "threads"),
    [
        # Unpinned: the workers still keep a core each busy; the front door gets the rest.
        ("", range(2), 2, 1),
        ("", range(2), 1, 1),
        ("", range(16), 4, 12),
        ("", range(2), 4, 1),
        # auto with a spare core: that core is the front door's, one thread on it.
        ("auto", range(16), 4, 1),
        ("auto", range(3), 2, 1),
        # auto without one: the front door shares the workers' cores, with one thread.
        ("auto", range(2), 2, 1),
        ("auto", range(2), 4, 1),
        # Explicit groups: the cores no group names.
        ("0;1", range(8), 2, 6),
        ("0-3;4-7", range(8), 2, 1),
        ("0;0", range(4), 2, 3),
    ],
)
def test_front_door_threads_are_the_cores_workers_leave(
    spec: str, cores: range, workers: int, threads: int
) -> None:
    placement = cpusets.plan(spec, workers, cores)
    assert placement.front_door_threads == threads
    assert f"front door: {threads} thread(s)" in placement.explanation


def test_every_models_workers_count_for_the_front_doors_threads(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpusets, "quota_cores", lambda *_: None)  # whatever this machine has
    # Other models' workers share the first model's placement but keep cores busy too.
    assert cpusets.plan("", 2, range(8), every_worker=5).front_door_threads == 3
    assert cpusets.plan("auto", 2, range(4), every_worker=5).front_door_threads == 1  # reserved
    assert cpusets.plan("auto", 2, range(2), every_worker=5).front_door_threads == 1
    two_models = with_a_ranker(demo_model_dir, cores=8, ranker_workers=3)
    assert len(two_models.slots) == 2
    assert two_models.placement().front_door_threads == 8 - (2 + 3)


def test_a_cpu_quota_caps_the_front_doors_threads() -> None:
    # A pod limited to 4 CPUs on a 64-core node: its affinity still lists 64 cores.
    assert cpusets.plan("", 4, range(64), quota=4).front_door_threads == 1
    assert cpusets.plan("", 4, range(64), quota=12).front_door_threads == 8
    assert cpusets.plan("", 4, range(64)).front_door_threads == 60
    assert cpusets.plan("auto", 4, range(4), quota=2).front_door_threads == 1
    assert cpusets.plan("0;1", 2, range(64), quota=6).front_door_threads == 4


def test_unpinned_workers_share_the_core_budget_among_every_model(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cpusets.plan("", 4, range(64)).worker_threads(3) == 16
    # A pod limited to 4 CPUs on a 64-core node: one thread each, not 16.
    limited = cpusets.plan("", 4, range(64), quota=4)
    assert [limited.worker_threads(i) for i in range(4)] == [1, 1, 1, 1]
    assert "workers: 1 thread(s) each" in limited.explanation
    assert cpusets.plan("", 4, range(2)).worker_threads(0) == 1  # never none
    assert cpusets.plan("", 2, range(8), every_worker=5).worker_threads(1) == 1
    # Pinned: a worker's own cores, whatever the quota.
    assert cpusets.plan("0-2;3", 2, range(4), quota=1).worker_threads(0) == 3
    monkeypatch.setattr(cpusets, "quota_cores", lambda *_: None)  # whatever this machine has
    two_models = with_a_ranker(demo_model_dir, cores=12, ranker_workers=4)
    # 6 workers on 12 cores: 2 threads each for both models' workers (not 12 / 2 = 6 for
    # the first model's).
    assert two_models.threads_per_worker("cpu-1") == 2
    assert two_models.for_model("ranker").threads_per_worker("cpu-3") == 2
    monkeypatch.setattr(cpusets, "quota_cores", lambda *_: 3)
    assert two_models.threads_per_worker("cpu-0") == 1


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_quota_cores_reads_cgroup_v2_up_to_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    root = tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    assert cpusets.quota_cores(proc, root) is None  # no cpu.max anywhere
    write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cpusets.quota_cores(proc, root) is None
    write(root / "kubepods/pod1/cpu.max", "250000 100000\n")  # 2.5 CPUs: 3 cores
    assert cpusets.quota_cores(proc, root) == 3
    write(root / "kubepods/cpu.max", "100000 100000\n")  # a tighter parent wins
    assert cpusets.quota_cores(proc, root) == 1
    # Inside a container with its own cgroup namespace the path is "/".
    write(proc, "0::/\n")
    write(root / "cpu.max", "400000 100000\n")
    assert cpusets.quota_cores(proc, root) == 4
    for text in ("abc 100000\n", "100000 0\n", "100000\n", "0 100000\n", ""):
        write(root / "cpu.max", text)
        assert cpusets.quota_cores(proc, root) is None, text


def test_quota_cores_reads_cgroup_v1(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    root = tmp_path / "cgroup"
    write(proc, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpusets.quota_cores(proc, root) is None
    # The container's own mount: its quota at the mount's root.
    write(root / "cpu,cpuacct/cpu.cfs_quota_us", "200000\n")
    assert cpusets.quota_cores(proc, root) == 2
    # Seen from the host: at the process's path under the mount.
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cpusets.quota_cores(proc, root) == 1
    assert cpusets.quota_cores(tmp_path / "missing", root) is None
    # Malformed files count as no quota, never as a failed start.
    for text in ("-1\n", "abc\n", ""):
        write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", text)
        write(root / "cpu,cpuacct/cpu.cfs_quota_us", text)
        assert cpusets.quota_cores(proc, root) is None
    # A line that is not "id:controllers:path" is skipped.
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(proc, "garbage\n3:cpu,cpuacct:/docker/abc\n")
    assert cpusets.quota_cores(proc, root) == 1


def test_format_cores() -> None:
    assert cpusets.format_cores([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert cpusets.format_cores([]) == ""


# -- config and CLI ---------------------------------------------------------------------
def config(demo_model_dir: Path, **fields: object) -> PoolConfig:
    base = PoolConfig(
        model_name="demo",
        model_base_path=str(demo_model_dir),
        model_version=1,
        run_dir="/tmp/mpspool-cpusets-test",
        log_dir="/tmp/mpspool-cpusets-test-logs",
        workers=2,
    )
    return dataclasses.replace(base, **fields)


def with_a_ranker(demo_model_dir: Path, cores: int, ranker_workers: int) -> PoolConfig:
    """The demo model's 2 workers and a second model's, on ``cores`` usable cores."""
    return config(
        demo_model_dir,
        usable_cpus=tuple(range(cores)),
        models=(
            ServedModel("demo", str(demo_model_dir), 1),
            ServedModel("ranker", str(demo_model_dir), 1, workers=ranker_workers),
        ),
    )


def test_config_validates_and_sizes_threads(demo_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not usable by this process"):
        config(demo_model_dir, cpuset="0;4096").validate()
    pinned = config(demo_model_dir, cpuset="0-2;3", usable_cpus=(0, 1, 2, 3)).validate()
    assert pinned.cpu_set("cpu-0") == frozenset({0, 1, 2})
    assert pinned.threads_per_worker("cpu-0") == 3
    assert pinned.threads_per_worker("cpu-1") == 1
    assert dataclasses.replace(pinned, intra_op_threads=5).threads_per_worker("cpu-1") == 5
    unpinned = config(demo_model_dir)
    assert unpinned.cpu_set("cpu-0") == frozenset()


def _threads(*flags: str) -> dict[str, int]:
    from mpspool import cli

    return cli._thread_fields(build_parser().parse_args(["start", "--demo", *flags]))


def test_tf_servings_threading_flags_are_read_as_its_server_reads_them() -> None:
    assert _threads() == {"intra_op_threads": 0, "inter_op_threads": 1}
    assert _threads("--intra-op-threads", "3", "--inter-op-threads", "0") == {
        "intra_op_threads": 3,
        "inter_op_threads": 0,
    }
    # Session parallelism sets both, unless intra- or inter-op is above 0.
    assert _threads("--tensorflow_session_parallelism", "4") == {
        "intra_op_threads": 4,
        "inter_op_threads": 4,
    }
    assert _threads(
        "--tensorflow_session_parallelism=4", "--tensorflow-intra-op-parallelism=2"
    ) == {"intra_op_threads": 2, "inter_op_threads": 1}
    assert _threads(
        "--tensorflow_inter_op_parallelism", "2", "--tensorflow_session_parallelism", "4"
    ) == {"intra_op_threads": 0, "inter_op_threads": 2}
    # 0, TF Serving's "auto-configured": mpspool's own choice, as if not given.
    assert _threads("--tensorflow_session_parallelism", "0") == _threads()
    assert _threads("--intra-op-threads", "2", "--tensorflow_session_parallelism=0") == {
        "intra_op_threads": 2,
        "inter_op_threads": 1,
    }
    said = r"^Either configure server_options\.tensorflow_session_parallelism or \("
    with pytest.raises(ConfigError, match=said):
        _threads(
            "--tensorflow_intra_op_parallelism=1",
            "--tensorflow_inter_op_parallelism=1",
            "--tensorflow_session_parallelism=1",
        )
    with pytest.raises(ConfigError, match="set the same thing: give one or the other"):
        _threads("--intra-op-threads", "2", "--tensorflow_session_parallelism", "2")
    with pytest.raises(ConfigError, match="must be >= 0, got -1, 0, 0"):
        _threads("--tensorflow_intra_op_parallelism", "-1")


def test_negative_threads_are_refused_at_start_not_by_each_worker(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    done = subprocess.run(
        mpspool_cmd("start", "--model-base-path", str(demo_model_dir),
                    "--run-dir", str(tmp_path / "run"), "--inter-op-threads", "-2"),
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--intra-op-threads and --inter-op-threads must be >= 0, got 0 and -2" in done.stderr


def test_usable_cpus_survive_pool_json(tmp_path: Path, demo_model_dir: Path) -> None:
    # Workers resolve their cores from the start's usable cores, not from their own
    # affinity (which the controller may have narrowed, and which they inherit).
    saved = config(demo_model_dir, cpuset="auto", usable_cpus=(0, 1, 2, 3, 4))
    saved.save(tmp_path)
    loaded = PoolConfig.load(tmp_path)
    assert loaded == saved
    assert loaded.cpu_set("cpu-1") == frozenset({3, 4})


def test_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    required = ["start", "--demo"]
    monkeypatch.delenv("SESSION_GROUP_CPUSET", raising=False)
    assert build_parser().parse_args(required).cpuset == ""
    monkeypatch.setenv("SESSION_GROUP_CPUSET", "2-4;5-7")
    assert build_parser().parse_args(required).cpuset == "2-4;5-7"
    assert build_parser().parse_args([*required, "--cpuset", "auto"]).cpuset == "auto"


def test_pin_moves_every_thread_of_a_process() -> None:
    # A process whose extra thread already runs: pinning only its main thread would leave
    # that one free (ZeroMQ's and tokio's threads are like it).
    code = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        core = min(os.sched_getaffinity(0))
        cpusets.pin(child.pid, {core})
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 2
        assert all(os.sched_getaffinity(t) == {core} for t in tids)
        assert cpusets.affinity(child.pid) == str(core)
    finally:
        child.kill()
        child.wait()


# -- a real pool --------------------------------------------------------------------------
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1 usable")
def test_pool_workers_run_on_their_cores(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from mpspool.demo_model import demo_inputs

    monkeypatch.delenv("MPSPOOL_ROUTER_THREADS", raising=False)  # the placement decides
    # TF Serving's flag for the workers' inter-op threads: it reaches each worker.
    pool = Pool(
        tmp_path, demo_model_dir, 2, "--cpuset", "0;1", "--tensorflow_inter_op_parallelism", "2"
    ).start()
    try:
        status = pool.wait_ready(2)
        by_slot = {s["slot"]: s for s in status["slots"]}
        for slot, core in (("cpu-0", 0), ("cpu-1", 1)):
            pid = by_slot[slot]["pid"]
            # Every thread, TensorFlow's pools included, is on the worker's core.
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({core})}
            assert by_slot[slot]["cpus"] == str(core)
        assert "workers on 0, 1" in status["pool"]["cpu_placement"]
        logs = "".join(p.read_text(errors="replace") for p in pool.log_dir.rglob("*worker*"))
        # Intra-op: the worker's one core (the placement's choice, no flag asked otherwise).
        assert logs.count("TensorFlow threads: intra-op 1, inter-op 2") == 2, logs[-3000:]
        # With explicit sets the front door is not pinned: it keeps every usable core.
        assert status["pool"]["router_cpus"] == cpusets.format_cores(os.sched_getaffinity(0))
        # Its async runtime runs on the cores the workers leave, at least one thread. The
        # pool's start had no MPSPOOL_ROUTER_THREADS (monkeypatched away), so the placement
        # decided. Several threads: a multi-thread runtime, whose workers tokio names
        # "tokio-r…"; one: the current-thread runtime, on the process's main thread.
        router_pid = status["pool"]["router_pid"]
        comms = [
            Path(f"/proc/{router_pid}/task/{t}/comm").read_text().strip()
            for t in os.listdir(f"/proc/{router_pid}/task")
        ]
        cores = len(os.sched_getaffinity(0))
        threads = max(1, min(cores, cpusets.quota_cores() or cores) - 2)
        tokio_workers = sum(c.startswith("tokio-r") for c in comms)
        assert tokio_workers == (threads if threads > 1 else 0), comms

        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        for name, array in demo_inputs(4, DEMO_ROWS, seed=3).items():
            request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
        with pool.channel() as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            for _ in range(4):  # round-robin: both workers answer
                score = tf.make_ndarray(stub.Predict(request, timeout=30).outputs["score"])
                assert score.shape == (4, 1) and np.all(np.isfinite(score))

        table = subprocess.run(
            mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "CPUs: cpuset '0;1': workers on 0, 1" in table
        rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
        assert rows["cpu-0"][8] == "0" and rows["cpu-1"][8] == "1", table
        # The front door has its row too: serving, its pid, never restarted.
        router_pid = pool.status()["pool"]["router_pid"]
        _, _, state, pid, _, restarts = rows["front-door"][:6]
        assert (state, pid, restarts) == ("SERVING", str(router_pid), "0"), table
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()
