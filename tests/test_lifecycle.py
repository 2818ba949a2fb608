"""Starting and stopping a real pool: graceful stop and SIGTERM under load, refusals at
start, and a controller killed outright — nothing may be left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.config import ConfigError
from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd
from streamer import Streamer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def watch_health(pool: Pool, seen: list[int], stop: threading.Event) -> None:
    with pool.channel() as channel:
        while not stop.is_set():
            try:
                seen.append(pool.health(channel))
            except grpc.RpcError:
                seen.append(-1)  # the server stopped accepting
            time.sleep(0.05)


def supervisord_of(pool: Pool) -> psutil.Process:
    assert pool.proc is not None
    (found,) = [
        p
        for p in psutil.Process(pool.proc.pid).children()
        if "supervisor.supervisord" in " ".join(p.cmdline())
    ]
    return found


# SIGHUP: the terminal of a foreground `start` closing; it ended the pool with no drain.
# SIGQUIT (Ctrl-\), an exit request to supervisord: it ended the controller as kill -9 does.
@pytest.mark.parametrize("how", ["mpspool stop", "SIGTERM", "Ctrl-C", "SIGHUP", "SIGQUIT"])
def test_graceful_stop_under_load(tmp_path: Path, demo_model_dir: Path, how: str) -> None:
    pool = Pool(tmp_path, demo_model_dir, 1, "--shutdown-delay", "1.5")
    # A pool started where SIGHUP is ignored (nohup; a CI runner may run the tests so) keeps
    # ignoring it, by design: this one starts where it is not, as from a terminal.
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        pool.start()
    finally:
        signal.signal(signal.SIGHUP, hangup)
    try:
        pool.wait_ready(1)
        assert pool.proc is not None
        supervisord = supervisord_of(pool)
        # supervisord (and through it the front door and workers) in a process group of its
        # own, so that a Ctrl-C reaches the controller alone and the pool drains in order;
        # in the controller's session, so that under autogroup scheduling (a CPU group per
        # session) the pool is one group with what its launcher runs beside it, and the
        # SCHED_IDLE of a loading version yields to those too (it yields within a group).
        assert os.getpgid(supervisord.pid) == supervisord.pid != os.getpgid(pool.proc.pid)
        assert os.getsid(supervisord.pid) == os.getsid(pool.proc.pid)
        streamer = Streamer(pool.port, DEMO_ROWS, threads=3).start()
        seen: list[int] = []
        stop_watch = threading.Event()
        watcher = threading.Thread(target=watch_health, args=(pool, seen, stop_watch))
        watcher.start()
        try:
            streamer.wait_for_successes(30)
            signalled_at = time.monotonic()
            if how in ("SIGTERM", "SIGHUP", "SIGQUIT"):
                pool.signal(getattr(signal, how))
                code = pool.proc.wait(60)
            elif how == "Ctrl-C":
                pool.ctrl_c()
                code = pool.proc.wait(60)
            else:
                code = pool.stop(cli=True)
        finally:
            stop_watch.set()
            watcher.join()
            streamer.stop()
        assert code == 0, pool.output()
        # Health went SERVING → NOT_SERVING while the server still answered.
        assert SERVING in seen
        assert NOT_SERVING in seen[seen.index(SERVING) :]
        # Every request sent before the signal was answered.
        assert streamer.failed(sent_before=signalled_at) == []
        assert len(streamer.ok()) >= 30
        assert pool.leftovers() == []
    finally:
        pool.kill()


def _front_door_draining(pool: Pool) -> Path:
    """Once the front door has begun the drain the controller asked for: its log."""
    router_log = pool.log_dir / "router.log"
    deadline = time.monotonic() + 30
    while "draining (Controller)" not in router_log.read_text():
        assert time.monotonic() < deadline, router_log.read_text()[-2000:]
        time.sleep(0.1)
    return router_log


def test_a_second_ctrl_c_ends_the_front_doors_drain_too(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """The controller stopped waiting at a second signal, but the front door went on with
    its delay (then supervisord's stop of it waited until it killed it): a second Ctrl-C
    left the pool up for the whole delay (found by an operator test)."""
    pool = Pool(tmp_path, demo_model_dir, 1, "--shutdown-delay", "30").start()
    try:
        pool.wait_ready(1)
        assert pool.proc is not None
        pool.ctrl_c()
        pool.wait_for(lambda s: s["pool"]["phase"] == "draining", what="draining")
        router_log = _front_door_draining(pool)
        second = time.monotonic()
        pool.ctrl_c()
        assert pool.proc.wait(60) == 0, pool.output()
        took = time.monotonic() - second
        assert "asked to drain again: delay 0ns, grace 0ns" in router_log.read_text()
        supervisord_log = (pool.log_dir / "supervisord.log").read_text()
        assert "router (terminated by SIGKILL)" not in supervisord_log, supervisord_log
        assert took < 20, f"{took:.1f} s after the second Ctrl-C"  # the delay was 30 s
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_a_front_door_signalled_during_the_controllers_drain_ends_without_another(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """The controller killed in the middle of its drain: supervisord (following it) sends the
    front door SIGTERM, which cuts the drain short; the front door must then end, not wait
    for a signal it already had until supervisord kills it (found by a review)."""
    pool = Pool(tmp_path, demo_model_dir, 1, "--shutdown-delay", "30").start()
    try:
        pool.wait_ready(1)
        assert pool.proc is not None
        router = psutil.Process(pool.status()["pool"]["router_pid"])
        pool.ctrl_c()
        _front_door_draining(pool)
        killed = time.monotonic()
        pool.proc.kill()
        router.wait(60)
        took = time.monotonic() - killed
        supervisord_log = (pool.log_dir / "supervisord.log").read_text()
        assert "router (terminated by SIGKILL)" not in supervisord_log, supervisord_log
        assert took < 20, f"the front door ended {took:.1f} s after"  # SIGKILL came at 45
    finally:
        pool.kill()


def test_a_model_not_there_yet_is_waited_for_then_served(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """As TF Serving at start: a base path with no version (a sidecar still syncing the
    model) is read every poll wait, said once in TF Serving's words, and the pool starts
    once a version is there; it exited 2 at once before."""
    base = tmp_path / "models"
    base.mkdir()
    pool = Pool(tmp_path, base, 1, "--file_system_poll_wait_seconds", "0.2")
    # Its log dir's parents made by the pool, and the pool started under umask 000: what it
    # makes is private all the same (the parents were 0777, its admin socket srwxrwxrwx).
    pool.log_dir = tmp_path / "parent" / "logs"
    pool.args[pool.args.index("--log-dir") + 1] = str(pool.log_dir)
    umask = os.umask(0)
    try:
        pool.start()
    finally:
        os.umask(umask)
    try:
        deadline = time.monotonic() + 30
        while "No versions of servable demo found" not in pool.output():
            assert pool.proc is not None and pool.proc.poll() is None, pool.output()
            assert time.monotonic() < deadline, pool.output()
            time.sleep(0.2)
        time.sleep(1.0)  # five more reads of the base path: still waiting, said once
        assert pool.proc is not None and pool.proc.poll() is None, pool.output()
        assert pool.output().count("No versions of servable demo found") == 1
        # A second start in the same run dir is refused while the first waits (it has no
        # controller file yet; its log dir says it is there), as once it runs.
        again = subprocess.run(
            mpspool_cmd("start", "--model-base-path", str(demo_model_dir),
                        "--run-dir", str(pool.run_dir), "--log-dir", str(pool.log_dir)),
            cwd=tmp_path, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert again.returncode == 2, again.stderr
        assert "a start of one waits for its model" in again.stderr, again.stderr
        staging = tmp_path / "staging"
        shutil.copytree(demo_model_dir / "1", staging)
        staging.rename(base / "1")  # whole at once, as a sync tool moves a finished copy
        # A client started beside the pool, calling from the moment the port opens: until the
        # version serves, every answer is UNAVAILABLE, which clients retry (TF Serving's port
        # opens only once its models load: its clients meet a refused connection, which they
        # read as UNAVAILABLE). NOT_FOUND, which they do not retry, is never said.
        codes = _codes_until_served(pool)
        assert codes[-1] == grpc.StatusCode.OK, codes
        assert set(codes[:-1]) <= {grpc.StatusCode.UNAVAILABLE}, codes
        pool.wait_ready(1)
        made = [pool.log_dir.parent, *pool.log_dir.iterdir(), *pool.run_dir.iterdir()]
        shared = {str(p): oct(p.lstat().st_mode & 0o777) for p in made if p.lstat().st_mode & 0o077}
        assert shared == {}, shared
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()
    # A flag the pool refuses is refused at once, not after the wait.
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run(
        mpspool_cmd("start", "--model-base-path", str(empty), "--worker-inflight", "-1",
                    "--run-dir", str(tmp_path / "r2")),
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "--worker-inflight and --split-rows must be >= 0" in refused.stderr


def _codes_until_served(pool: Pool, timeout: float = 90.0) -> list[grpc.StatusCode]:
    """Each Predict's code, called from when the pool's port is known until one is answered.
    Health is asked before each: once it says SERVING, a Predict must be served (a readiness
    probe sends traffic on it). It said SERVING a controller tick before the version was
    AVAILABLE, and 8 to 14 Predicts polled every 5 ms then failed as still loading (found by
    a README hunt)."""
    deadline = time.monotonic() + timeout
    listen = None
    while listen is None:
        assert time.monotonic() < deadline, pool.output()
        try:
            listen = pool.status()["pool"]["listen"]
        except ConfigError:  # the controller is not up yet
            pass
        time.sleep(0.05)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for name, value in demo_inputs(1, DEMO_ROWS).items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(listen) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        while not codes or codes[-1] != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, codes
            try:
                serving = pool.health(channel) == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                serving = False
            try:
                stub.Predict(request, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                assert not serving, f"health said SERVING, then Predict: {exc.details()}"
                codes.append(exc.code())
                time.sleep(0.005)
    return codes


def test_refusals_at_start(tmp_path: Path, demo_model_dir: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        mpspool_cmd(
            "start",
            "--model-base-path",
            str(tmp_path / "missing"),
            # Polling off: nothing to wait for (with it, the pool waits for the model).
            "--file_system_poll_wait_seconds",
            "0",
            "--run-dir",
            str(tmp_path / "r"),
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert time.monotonic() - started < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0], result.stderr

    pool = Pool(tmp_path, demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        again = subprocess.run(
            mpspool_cmd(
                "start", "--model-base-path", str(demo_model_dir), "--run-dir", str(pool.run_dir)
            ),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert again.returncode == 2
        assert "already running" in again.stderr
        assert pool.slot("cpu-0")["state"] == "READY"  # the running pool is untouched
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_killed_controller_takes_its_processes_along(tmp_path: Path, demo_model_dir: Path) -> None:
    """kill -9 of `mpspool start`: supervisord and through it every worker and the router
    die with it; a start at once in that run directory (a restart loop's) waits for them,
    then cleans what was left there, the dead pool's shared-memory weights included. It
    cleaned under them before, and the dead supervisord, exiting, removed the new pool's
    socket: that pool failed."""
    pool = Pool(tmp_path, demo_model_dir, 1).start()
    second = Pool(tmp_path / "again", demo_model_dir, 1, run_dir=pool.run_dir)
    (tmp_path / "again").mkdir()
    try:
        pool.wait_ready(1)
        stale = pool.segments()
        streamer = Streamer(pool.port, DEMO_ROWS).start()
        try:
            streamer.wait_for_successes(10)
            # Its supervisord held stopped for a moment, so that the second start surely
            # meets the dead pool's processes. Stopped only once the controller is dead: a
            # process group holding a stopped process when it is orphaned (its leader's
            # parent dies) gets SIGHUP and SIGCONT from Linux, which resumed a supervisord
            # stopped before the kill at once, and the start, late under load, met nothing.
            stopped = supervisord_of(pool)
            pool.signal(signal.SIGKILL)
            assert pool.proc is not None
            pool.proc.wait(timeout=10)
            stopped.suspend()
            deadline = time.monotonic() + 5  # SIGSTOP takes effect when it is next scheduled
            while stopped.status() != psutil.STATUS_STOPPED:
                assert time.monotonic() < deadline, "supervisord ended before it was held"
                time.sleep(0.01)
            status = subprocess.run(
                mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
                cwd=tmp_path,
                capture_output=True,
                text=True,
            )
            assert status.returncode == 2 and "no pool is running" in status.stderr
            second.start()
            deadline = time.monotonic() + 30
            while "waiting for processes of a pool that ended" not in second.output():
                assert time.monotonic() < deadline, second.output()
                time.sleep(0.1)
            killed = time.monotonic()
            stopped.resume()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and [
                x for x in pool.leftovers() if x.startswith("process")
            ]:
                time.sleep(0.2)
            gone_after = time.monotonic() - killed
        finally:
            streamer.stop()
        assert [x for x in pool.leftovers() if x.startswith("process")] == []
        # supervisord stops the front door first: it drains while the worker still answers,
        # so no request is taken in and then failed for want of a worker; clients only find
        # the port closed. And the teardown is that drain, not a wait on held requests.
        held = [o for o in streamer.failed() if "no worker" in o.details]
        assert held == [], held[:3]
        assert {o.code for o in streamer.failed()} <= {grpc.StatusCode.UNAVAILABLE}
        assert gone_after < 6, gone_after
        assert stale, "a killed pool cannot unlink its segment; the next start must"
        second.wait_ready(1)
        assert not any(path.exists() for path in stale)
        assert second.segments()
        assert second.stop() == 0
        assert second.leftovers() == []
    finally:
        pool.kill()
        second.kill()
    leftover = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(pool.run_dir) in " ".join(p.info["cmdline"])
    ]
    assert leftover == []


def test_a_controller_killed_outright_leaves_no_weights_in_shared_memory(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """kill -9 of `mpspool start`, and no start after it: once supervisord has stopped the
    programs (they end with the controller), the pool's weights leave /dev/shm. They stayed
    there, as much memory as the model, until some later start removed them."""
    pool = Pool(tmp_path, demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        segments = pool.segments()
        assert segments
        pool.signal(signal.SIGKILL)
        assert pool.proc is not None
        pool.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while [x for x in pool.leftovers() if x.startswith("process")] or any(
            path.exists() for path in segments
        ):
            assert time.monotonic() < deadline, (pool.leftovers(), pool.segments())
            time.sleep(0.1)
        assert pool.segments() == []
    finally:
        pool.kill()


def test_unreadable_weights_fail_the_start_cleanly(tmp_path: Path, demo_model_dir: Path) -> None:
    """A checkpoint that cannot be published (half its data: a copy in progress): tried
    again as any load (the pool starting meanwhile), then `start` exits 1 with the reason and
    leaves no process, segment or run directory behind."""
    broken = tmp_path / "broken"
    shutil.copytree(demo_model_dir, broken)
    data = broken / "1" / "variables" / "variables.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    retries = ("--max_num_load_retries", "1", "--load_retry_interval_micros", "500000")
    pool = Pool(tmp_path, broken, 1, *retries).start()
    try:
        assert pool.proc is not None
        code = pool.proc.wait(60)
        assert code == 1, pool.output()
        last = pool.output().strip().splitlines()[-1]
        # Its code first (DATA_LOSS: a checkpoint shard that ends early), as GetModelStatus
        # reads it.
        assert last.startswith("mpspool: DATA_LOSS: publishing the weights failed:"), pool.output()
        assert "failed to load (try 1 of 2; tried again in 0.5 s)" in pool.output()
        assert not pool.run_dir.exists()
        pool_id = re.search(r"\(pool (\w+)\)", pool.output()).group(1)
        assert list(Path("/dev/shm").glob(f"mpspool-{pool_id}-*")) == []
    finally:
        pool.kill()


def test_max_connection_age_closes_client_connections(tmp_path: Path, demo_model_dir: Path) -> None:
    """--max-connection-age: the router ends each connection after that long (GOAWAY), so a
    client balancing over several pods re-resolves and finds new ones."""
    pool = Pool(tmp_path, demo_model_dir, 1, "--max-connection-age", "1").start()
    try:
        pool.wait_ready(1)
        states: list[grpc.ChannelConnectivity] = []
        with pool.channel() as channel:
            channel.subscribe(states.append, try_to_connect=True)
            assert pool.health(channel) == SERVING
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and grpc.ChannelConnectivity.IDLE not in states[2:]:
                time.sleep(0.1)
            ready_at = states.index(grpc.ChannelConnectivity.READY)
            assert grpc.ChannelConnectivity.IDLE in states[ready_at:], states
            assert pool.health(channel) == SERVING  # and the client simply reconnects
            channel.unsubscribe(states.append)
        assert pool.stop() == 0
    finally:
        pool.kill()


def test_grpc_channel_arguments_end_idle_connections_and_keep_streaming_ones(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """TF Serving's --grpc_channel_arguments: grpc.max_connection_idle_ms ends a connection
    without a call for that long (GOAWAY: the official client's channel goes IDLE and its next
    call reconnects); a health Watch under way is a call, so its connection stays; an argument
    the front door has no setting for is named in a warning and the pool starts."""
    from grpc_health.v1 import health_pb2_grpc
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    pool = Pool(
        tmp_path, demo_model_dir, 1, "--grpc_channel_arguments",
        "grpc.max_connection_idle_ms=1000,grpc.http2.min_ping_interval_without_data_ms=5000",
    ).start()  # fmt: skip
    try:
        pool.wait_ready(1)
        assert (
            "--grpc_channel_arguments: grpc.http2.min_ping_interval_without_data_ms has no "
            "effect here"
        ) in pool.output()
        # Each channel on a connection of its own (gRPC shares them between channels).
        own = [("grpc.use_local_subchannel_pool", 1)]
        target = f"127.0.0.1:{pool.port}"
        with (
            grpc.insecure_channel(target, options=own) as idle,
            grpc.insecure_channel(target, options=own) as watching,
        ):
            idle_states: list[grpc.ChannelConnectivity] = []
            watch_states: list[grpc.ChannelConnectivity] = []
            idle.subscribe(idle_states.append, try_to_connect=True)
            watching.subscribe(watch_states.append, try_to_connect=True)
            watch = health_pb2_grpc.HealthStub(watching).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert next(watch).status == SERVING
            assert pool.health(idle) == SERVING
            answered, seen = time.monotonic(), len(idle_states)
            while grpc.ChannelConnectivity.IDLE not in idle_states[seen:]:
                assert time.monotonic() < answered + 10, idle_states
                time.sleep(0.02)
            went_idle = time.monotonic() - answered
            assert 0.8 < went_idle < 5, f"IDLE {went_idle:.2f} s after the last call"
            time.sleep(1.5)
            ready_at = watch_states.index(grpc.ChannelConnectivity.READY)
            assert grpc.ChannelConnectivity.IDLE not in watch_states[ready_at:], watch_states
            watch.cancel()
            # The idle channel reconnects on its next call.
            stub = prediction_service_pb2_grpc.PredictionServiceStub(idle)
            assert stub.Predict(_demo_request(), timeout=30).outputs
            idle.unsubscribe(idle_states.append)
            watching.unsubscribe(watch_states.append)
        page = urllib.request.urlopen(pool.status()["pool"]["metrics"], timeout=10).read()
        [closed] = [
            line for line in page.decode().splitlines()
            if line.startswith("mpspool_client_connections_idle_closed_total ")
        ]  # fmt: skip
        assert float(closed.split()[1]) >= 1, closed
        assert pool.stop() == 0
    finally:
        pool.kill()


def _demo_request() -> Any:
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for name, array in demo_inputs(64, DEMO_ROWS).items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return request


def _slots_answering(pool: Pool, send: Callable[[Any], None]) -> list[str]:
    """The worker (placement@version, as the front door's timeline names it) of each request
    ``send`` makes through the pool's front door, in order."""
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    cli = mpspool_cmd("timeline", "--run-dir", str(pool.run_dir), "--clear")
    subprocess.run(cli, check=True, capture_output=True, timeout=30)
    with pool.channel() as channel:
        send(prediction_service_pb2_grpc.PredictionServiceStub(channel))
    out = subprocess.run(cli, check=True, capture_output=True, timeout=30).stdout
    return [slot for slot, _, _ in json.loads(out)["spans"]]


def _rounds_of(request: Any, rounds: int, together: int) -> Callable[[Any], None]:
    """``rounds`` times, ``together`` requests sent at once and all waited for."""

    def send(stub: Any) -> None:
        for _ in range(rounds):
            futures = [stub.Predict.future(request, timeout=30) for _ in range(together)]
            for future in futures:
                future.result()

    return send


@pytest.mark.parametrize(
    ("policy", "rounds", "together", "spread"),
    [
        # One at a time, every request finds the first worker idle and takes it (round-robin,
        # the default, would alternate); 8 at once spread over both.
        ("least-loaded", 6, 1, 8),
        # Up to 4 at once go to the first worker, working or the first idle one (least-loaded
        # would give the second to the idle worker); past 4 in flight the next takes the rest.
        ("packed", 5, 3, 16),
    ],
)
def test_dispatch_keeps_one_worker_busy_at_low_load(
    tmp_path: Path, demo_model_dir: Path, policy: str, rounds: int, together: int, spread: int
) -> None:
    """--dispatch least-loaded and packed: at low load the first worker answers everything;
    more requests at once than it takes spread over both."""
    pool = Pool(tmp_path, demo_model_dir, 2, "--dispatch", policy).start()
    try:
        pool.wait_ready(2)
        request = _demo_request()
        answering = _slots_answering(pool, _rounds_of(request, rounds, together))
        assert answering == ["cpu-0@1"] * (rounds * together)
        assert set(_slots_answering(pool, _rounds_of(request, 5, spread))) == {"cpu-0@1", "cpu-1@1"}
        assert pool.stop() == 0
    finally:
        pool.kill()
