"""Flags `mpspool` must refuse before anything starts (exit 2, one line naming the flag),
and a reader of its output that goes away early (`mpspool status | head -1`)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mpspool import wire
from mpspool.config import ConfigError, PoolConfig

from poolproc import Pool, mpspool_cmd

# Only a safety net: a refusal answers at once; without it the pool would start and serve.
REFUSAL_WAIT_S = 60


def run_start(tmp_path: Path, model: Path, run_dir: Path, *flags: str) -> tuple[int, str]:
    """`mpspool start` of one worker with `flags` appended (the last value of a flag wins);
    its exit status and stderr, once no process it started is left."""
    log_dir = tmp_path / "logs"
    args = [
        "start", "--model-base-path", str(model), "--workers", "1",
        "--port", "0", "--rest-api-port", "0", "--metrics-port", "0",
        "--run-dir", str(run_dir), "--log-dir", str(log_dir), *flags,
    ]  # fmt: skip
    # cwd outside the repository (its supervisor/ folder would shadow supervisord's), and a
    # process group of its own, to take everything along should the refusal not come.
    proc = subprocess.Popen(
        mpspool_cmd(*args),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        _, err = proc.communicate(timeout=REFUSAL_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the controller's processes follow it
        proc.communicate()
        raise AssertionError(f"`mpspool start {' '.join(flags)}` was not refused") from None
    # Nothing left running: not in its process group, nor any process naming its directories.
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    mine = (str(run_dir), str(log_dir))
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and any(d in " ".join(p.info["cmdline"]) for d in mine)
    ]
    assert left == []
    return proc.returncode, err


def assert_one_line(err: str, *parts: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("mpspool: "), err
    for part in parts:
        assert part in lines[0], err
    return lines[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--drain-timeout", "-5"], "--drain-timeout must be seconds >= 0, got -5.0"),
        (["--shutdown-delay", "-1"], "--shutdown-delay must be seconds >= 0, got -1.0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be seconds >= 0, got nan"),
        (["--metrics-port", "99999"], "--metrics-port must be in 0..65535 or -1 (off), got 99999"),
        (["--metrics-port", "-5"], "--metrics-port must be in 0..65535 or -1 (off), got -5"),
        (
            ["--port", "18701", "--metrics-port", "18701"],
            "--metrics-port 18701 is also the gRPC port (--port)",
        ),
        (
            # Refused before these fixes too (the REST port's own check): kept as a guard.
            ["--rest-api-port", "18702", "--metrics-port", "18702"],
            "--rest-api-port 18702 is also the gRPC or the metrics port",
        ),
        (
            # The MPS control daemon reads 0.04 back as 0.0: a GPU share of nothing.
            ["--active-thread-percentage", "0.04"],
            "--active-thread-percentage must be in [0.1, 100] (the MPS daemon keeps one "
            "decimal), got 0.04",
        ),
    ],
    ids=["drain", "delay", "drain-nan", "metrics-high", "metrics-neg", "metrics-grpc",
         "metrics-rest", "thread-percentage"],
)  # fmt: skip
def test_bad_flag_is_refused_before_anything_starts(
    tmp_path: Path, demo_model_dir: Path, flags: list[str], message: str
) -> None:
    run_dir = tmp_path / "run"
    code, err = run_start(tmp_path, demo_model_dir, run_dir, *flags)
    assert code == 2, err
    assert assert_one_line(err) == f"mpspool: {message}"
    # Refused by validation: neither directory was made.
    assert not run_dir.exists()
    assert not (tmp_path / "logs").exists()


def test_run_dir_that_cannot_be_made_is_refused(tmp_path: Path, demo_model_dir: Path) -> None:
    code, err = run_start(tmp_path, demo_model_dir, Path("/proc/x"))
    assert code == 2, err
    assert_one_line(err, "--run-dir /proc/x: ")


def test_a_run_dir_that_is_a_link_is_refused_and_its_target_untouched(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Another user's link at the default /tmp/mpspool-<uid> made the pool clean the
    directory it points to (its models/ and pool files removed)."""
    target = tmp_path / "target"
    (target / "models").mkdir(parents=True)
    target.chmod(0o700)
    (target / "models" / "precious").write_text("kept")
    (target / "pool.json").write_text("{}")
    link = tmp_path / "run"
    link.symlink_to(target)
    code, err = run_start(tmp_path, demo_model_dir, link)
    assert code == 2, err
    assert_one_line(err, f"run dir {link} is a symbolic link: pass the directory itself")
    assert (target / "models" / "precious").read_text() == "kept"
    assert (target / "pool.json").exists()
    # `stop` may signal the pid a controller file names: not through a link either.
    stopped = subprocess.run(
        mpspool_cmd("stop", "--run-dir", str(link)),
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert stopped.returncode == 2, stopped.stderr
    assert_one_line(stopped.stderr, f"run dir {link} is a symbolic link")


@pytest.mark.parametrize(
    "case", ["run-dir-hash", "log-dir-semicolon", "log-dir-space", "not-utf8", "run-dir-bytes"]
)
def test_a_path_the_pool_cannot_carry_is_refused_naming_it(
    tmp_path: Path, demo_model_dir: Path, case: str
) -> None:
    """Found by a hunt: supervisord's configuration cut a run or log dir at " #" or " ;" and
    dropped a trailing space (a traceback naming another directory); a base path that is not
    UTF-8 served until the first `mpspool status` took the pool down; a run dir of 70
    characters but 110 bytes passed the socket-length check and failed in supervisord."""
    model, run_dir, flags = demo_model_dir, tmp_path / "run", []
    if case == "run-dir-hash":
        run_dir = tmp_path / "run #2"
        expected = f"--run-dir '{run_dir}' cannot be used: a '#' after whitespace starts"
    elif case == "log-dir-semicolon":
        flags = ["--log-dir", str(tmp_path / "my logs ;2")]
        expected = f"--log-dir '{tmp_path}/my logs ;2' cannot be used: a ';' after whitespace"
    elif case == "log-dir-space":
        flags = ["--log-dir", f"{tmp_path}/logs "]
        expected = f"--log-dir '{tmp_path}/logs ' cannot be used: it begins or ends with"
    elif case == "not-utf8":
        model = Path(os.fsdecode(os.fsencode(tmp_path) + b"/mod\xe8le"))
        model.mkdir()
        (model / "1").symlink_to(demo_model_dir / "1")
        expected = f"--model-base-path {tmp_path}/mod\\xe8le is not UTF-8 text; rename it"
    else:
        run_dir = tmp_path / ("é" * 40)
        expected = "is too long for unix sockets"
    code, err = run_start(tmp_path, model, run_dir, *flags)
    assert code == 2, err
    assert_one_line(err, expected)
    assert not run_dir.exists()


@pytest.mark.parametrize("kind", ["cannot-be-made", "a-file"])
def test_log_dir_that_cannot_be_made_is_refused(
    tmp_path: Path, demo_model_dir: Path, kind: str
) -> None:
    if kind == "a-file":
        log_dir = tmp_path / "a-file"
        log_dir.write_text("not a directory\n")
    else:
        log_dir = Path("/proc/x")
    run_dir = tmp_path / "run"
    code, err = run_start(tmp_path, demo_model_dir, run_dir, "--log-dir", str(log_dir))
    assert code == 2, err
    assert_one_line(err, f"--log-dir {log_dir}: ")
    assert not run_dir.exists()  # checked before the run directory is made


def test_a_log_dir_another_running_pool_writes_to_is_refused(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Two pools in one log dir (the default is one per user) wrote into each other's logs:
    a second pool's failure to bind went into the first's router.log, and the controller
    reads those logs for the reasons it reports (found by an operator test)."""
    (tmp_path / "a").mkdir()
    pool = Pool(tmp_path / "a", demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        run_dir = tmp_path / "run-b"
        code, err = run_start(
            tmp_path, demo_model_dir, run_dir, "--log-dir", str(pool.log_dir.resolve())
        )
        assert code == 2, err
        assert_one_line(
            err,
            f"--log-dir {pool.log_dir.resolve()} is the log dir of the pool running with "
            f"--run-dir {pool.run_dir.resolve()}: give each pool its own --log-dir",
        )
        assert not run_dir.exists()
        assert pool.slot("cpu-0")["state"] == "READY"
        assert pool.stop() == 0
    finally:
        pool.kill()
    # Once that pool is gone, its hold on the log dir is too.
    fd = os.open(pool.log_dir / ".mpspool-pool", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_run_dir_another_start_holds_is_refused_before_its_controller_file_exists(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Two starts at once on one run dir (a restart loop's, after a controller was killed)
    both found no live controller there, as its file is written only after the run dir is
    prepared, and each cleaned the other's files and segments (found by a hunt). The first
    to prepare it holds it for its life."""
    run_dir = tmp_path / "run"
    # The path in its environment, not its command line (run_start looks for processes
    # naming it there).
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import os, time; from pathlib import Path; from mpspool import rundir; "
            "rundir.prepare(Path(os.environ['HELD'])); print('held', flush=True); "
            "time.sleep(60)",
        ],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "HELD": str(run_dir.resolve())},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert not (run_dir / "controller.json").exists()
        code, err = run_start(tmp_path, demo_model_dir, run_dir)
        assert code == 2, err
        assert_one_line(err, f"a pool is already running or starting in {run_dir.resolve()}")
        assert run_dir.is_dir(), "the holder's run dir is left as it is"
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_the_start_holding_a_run_dir_another_start_made_removes_it_at_exit(
    tmp_path: Path,
) -> None:
    """Two starts at once on a fresh run dir: the lock, not the mkdir, decides which runs;
    when the one refused had made the directory, the one that runs removes it at its exit
    (an empty directory was left: found by a review)."""
    from mpspool import rundir

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    rundir._hold(run_dir, created=False)  # this process: the start that runs
    try:
        refused = subprocess.run(
            [
                sys.executable, "-c",
                "import os; from pathlib import Path; from mpspool import rundir\n"
                "try:\n    rundir._hold(Path(os.environ['RUN']), created=True)\n"
                "except rundir.PoolRunning:\n    print('refused')",
            ],
            env={**os.environ, "RUN": str(run_dir)}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.stdout == "refused\n", refused.stderr
    finally:
        made = rundir.release(run_dir)
    assert made, "the refused start made the run dir: the one that ran removes it"
    assert not (run_dir / rundir.LOCK_FILE).exists()


@pytest.mark.parametrize("command", ["status", "stop", "timeline"])
def test_a_run_dir_that_cannot_be_read_is_one_line(tmp_path: Path, command: str) -> None:
    """A run dir that is a file (or another user's): a traceback, exit 1, before."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = subprocess.run(
        mpspool_cmd(command, "--run-dir", str(not_a_dir)),
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert_one_line(result.stderr, f"run dir {not_a_dir}: Not a directory")


@pytest.mark.parametrize("metrics_port", [-1, 0, 1, 65535])
def test_metrics_ports_still_accepted(
    tmp_path: Path, demo_model_dir: Path, metrics_port: int
) -> None:
    """The range check leaves what the field allows: -1 (off), 0 (a free port), 1..65535;
    and 0 beside a gRPC port of 0 (both pick a free one)."""
    PoolConfig(
        model_name="demo",
        model_base_path=str(demo_model_dir),
        model_version=1,
        run_dir=str(tmp_path / "run"),
        log_dir=str(tmp_path / "logs"),
        workers=1,
        port=0,
        rest_api_port=-1,
        metrics_port=metrics_port,
        drain_timeout_s=0.0,
        shutdown_delay_s=0.0,
    ).validate()


def _gpu_config(run_dir: str, **fields: object) -> PoolConfig:
    uuids = ("GPU-00000000-0000-4000-8000-000000000000", "GPU-11111111-1111-4111-8111-111111111111")
    return PoolConfig(
        **{
            "model_name": "demo", "model_base_path": "/m", "model_version": 1,
            "run_dir": run_dir, "log_dir": "/tmp/logs", "workers": 1, "gpus": (0, 1),
            "gpu_uuids": uuids, "gpu_memory": (16 << 30, 16 << 30), "mps": True,
            "mps_control": "/bin/false", **fields,
        }
    )  # fmt: skip


def test_gpu_settings_are_refused_in_one_line() -> None:
    """Each was a traceback or a pool that could not start (found by a GPU/MPS hunt)."""
    for contexts in (0, -1, 49):  # 0 and -1 divided by zero in the placement
        with pytest.raises(ConfigError, match=r"--contexts-per-gpu must be in 1\.\.48"):
            _gpu_config("/tmp/r", contexts_per_gpu=contexts).validate(models_on_disk=False)
    # A CPU pool does not read it (CONTEXTS_COUNT_PER_GPU=0 in the environment).
    dataclasses.replace(_gpu_config("/tmp/r"), gpus=(), gpu_uuids=(), gpu_memory=(),
                        contexts_per_gpu=0).validate(models_on_disk=False)  # fmt: skip
    # The MPS daemon's privileged socket is the longest socket path: 33 bytes past
    # supervisord.sock, which alone was checked (the daemon failed with an empty log).
    run_dir = "/tmp/" + "r" * 70  # supervisord.sock: 92 bytes, within 100
    _gpu_config(run_dir, mps=False).validate(models_on_disk=False)
    with pytest.raises(ConfigError, match="mps/gpu0/pipe/control_privileged is 108 bytes"):
        _gpu_config(run_dir).validate(models_on_disk=False)
    # Written into supervisord's configuration: a newline there broke the start.
    with pytest.raises(ConfigError, match="holds a control character"):
        dataclasses.replace(_gpu_config("/tmp/r"), model_name="a\nb").validate(models_on_disk=False)


def test_environment_defaults_are_read_only_by_start(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad CONTEXTS_COUNT_PER_GPU is the start flag's refusal, not a traceback of every
    command (it was read while the parser was built); ENABLE_MPS=off turns MPS off."""
    from mpspool.cli import build_parser

    monkeypatch.setenv("CONTEXTS_COUNT_PER_GPU", "four")
    monkeypatch.setenv("ENABLE_MPS", "off")
    assert build_parser().parse_args(["stop", "--run-dir", "/tmp/x"]).command == "stop"
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["start", "--demo"])
    assert refused.value.code == 2
    monkeypatch.setenv("CONTEXTS_COUNT_PER_GPU", "3")
    args = build_parser().parse_args(["start", "--demo"])
    assert (args.contexts_per_gpu, args.mps) == (3, False)


def test_empty_gpus_is_refused_not_a_cpu_pool(tmp_path: Path, demo_model_dir: Path) -> None:
    code, err = run_start(tmp_path, demo_model_dir, tmp_path / "run", "--gpus", "")
    assert code == 2, err
    assert_one_line(err, "--gpus")


def test_stop_refuses_a_negative_timeout(tmp_path: Path) -> None:
    result = subprocess.run(
        mpspool_cmd("stop", "--run-dir", str(tmp_path / "run"), "--timeout", "-5"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    # argparse's refusal: its usage, then the one line that says what is wrong.
    last = result.stderr.strip().splitlines()[-1]
    assert last == "mpspool stop: error: argument --timeout: expected seconds >= 0, got '-5'"


# A pool's answers, as `_ask_pool` returns them: enough for `status` to print its table.
STATUS = {
    "pool": {"pool_id": "p", "pid": 1, "phase": "SERVING", "model": "demo", "version": 1,
             "listen": "127.0.0.1:1", "uptime_s": 1},
    "versions": [{"version": 1, "state": "AVAILABLE", "error": ""}],
    "slots": [{"slot": f"cpu-{i}", "version": 1, "state": "READY", "pid": 1, "uptime_s": 1.0,
               "restarts": 0, "inflight": 0, "served": 0, "reason": ""} for i in range(3)],
}  # fmt: skip
TIMELINE = {"now_us": 1, "spans": [["cpu-0", 1, 2]] * 3, "dropped": 0}


def test_stop_sends_sigterm_to_a_controller_that_does_not_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that is alive but does not answer (stopped, wedged): `stop` gave up after
    5 s with the configuration error's exit status; it now sends the orderly stop's signal
    (after STOP_ANSWER_WAIT_S), then SIGCONT, and waits for the pool to end. Here a
    stand-in that holds no socket, stopped (SIGSTOP, as by Ctrl-Z), that ends on SIGTERM
    (which a stopped process took only once continued: the stop waited out its timeout)."""
    from mpspool import cli, process, rundir

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    # Its admin socket is there (bound, never answering): the pool is unreachable only by
    # not answering.
    holds_socket = (
        "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
        "s.listen(); print('bound', flush=True); time.sleep(120)"
    )
    admin = wire.socket_path(str(run_dir), wire.ADMIN_ENDPOINT)
    stand_in = subprocess.Popen(
        [sys.executable, "-c", holds_socket, admin], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stand_in.stdout is not None and stand_in.stdout.readline() == "bound\n"
        started = process.started_at(stand_in.pid)
        rundir.write_controller(run_dir, {"pid": stand_in.pid, "started": started})
        stand_in.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(cli, "STOP_ANSWER_WAIT_S", 1.0)
        assert cli.main(["stop", "--run-dir", str(run_dir), "--timeout", "10"]) == 0
        assert stand_in.wait(5) == -signal.SIGTERM
        assert "did not answer within 1 s; sending it SIGTERM" in capsys.readouterr().err
    finally:
        stand_in.kill()


def test_a_pool_whose_socket_was_removed_is_said_unreachable_not_busy(
    tmp_path: Path,
) -> None:
    """A live controller whose admin socket is gone (removed by hand, or by a cleaner of
    old files) cannot be reached however long one waits: said so, where status said it
    "did not answer", as of a busy pool."""
    from mpspool import cli, process, rundir

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = process.started_at(stand_in.pid)
        rundir.write_controller(run_dir, {"pid": stand_in.pid, "started": started})
        admin = wire.socket_path(str(run_dir), wire.ADMIN_ENDPOINT)
        with pytest.raises(cli.PoolNotAnswering) as refused:
            cli._ask_pool(run_dir, "status", timeout_s=0.2)
        assert str(refused.value) == (
            f"the pool in {run_dir} (pid {stand_in.pid}) cannot be reached: "
            f"its socket {admin} is gone"
        )
    finally:
        stand_in.kill()


def test_status_says_a_pool_that_could_not_make_its_status_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The controller's refusal to make a status is said as such (it was a KeyError)."""
    from mpspool import cli

    refusal = {"error": "the controller could not answer: OSError: [Errno 5] I/O error"}
    monkeypatch.setattr(cli, "_ask_pool", lambda *args, **kwargs: refusal)
    assert cli.main(["status", "--run-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "mpspool: the pool could not give its status: the controller could not answer: "
        "OSError: [Errno 5] I/O error\n"
    )


def test_a_log_dir_of_another_user_is_refused(tmp_path: Path, demo_model_dir: Path) -> None:
    """Its owner could put links there that the pool's logs are opened through: a pool
    running as root truncated and wrote root's files through another user's directory
    (found by a hunt)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    theirs = tmp_path / "logs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    victim = tmp_path / "victim"
    victim.write_text("root's")
    os.symlink(victim, theirs / "supervisord.stderr")
    code, output = run_start(tmp_path, demo_model_dir, tmp_path / "run", "--log-dir", str(theirs))
    assert code == 2, output
    assert f"--log-dir {theirs} belongs to uid 65534, not to you (0) or root" in output
    assert victim.read_text() == "root's"


def test_status_of_a_starting_pool_prints_no_python_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpspool import cli

    starting = {
        "pool": {**STATUS["pool"], "phase": "starting", "version": None, "listen": None},
        "versions": [],
        "slots": [],
    }
    monkeypatch.setattr(cli, "_ask_pool", lambda *args, **kwargs: starting)
    assert cli.main(["status", "--run-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "pool p (pid 1) starting: model 'demo' version - on no port yet, up 1 s"


def test_status_prints_where_the_pool_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The REST API and the metrics page, as `status --json` gives them (a port picked with
    0 showed only there; found by a hunt)."""
    from mpspool import cli

    urls = {"rest": "http://127.0.0.1:5/v1/models/demo", "metrics": "http://127.0.0.1:6/metrics"}
    answer = {**STATUS, "pool": {**STATUS["pool"], **urls, "models_waiting": ["late", "c"]}}
    monkeypatch.setattr(cli, "_ask_pool", lambda *args, **kwargs: answer)
    assert cli.main(["status", "--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:4] == [
        f"REST API: {urls['rest']}",
        f"metrics: {urls['metrics']}",
        "waiting for a first version (model config file): late, c",
    ], lines


def test_status_says_which_gpu_is_down_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpspool import cli

    down = {
        "index": 1, "uuid": "GPU-1", "mps": "BACKOFF", "defaults": {"x": "1"},
        "down": {"why": "mps-gpu1: the control daemon did not answer within 1 s", "tries": 3},
        "servers": "unavailable: no control daemon answers",
    }  # fmt: skip
    monkeypatch.setattr(cli, "_ask_pool", lambda *args, **kwargs: {**STATUS, "gpus": [down]})
    assert cli.main(["status", "--run-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "GPU 1 GPU-1: DOWN (MPS daemon BACKOFF, try 3): mps-gpu1: the control daemon did not "
        "answer within 1 s"
    )


@pytest.mark.parametrize("command, answer", [("status", STATUS), ("timeline", TIMELINE)])
def test_a_reader_that_went_away_ends_it_quietly(
    tmp_path: Path, command: str, answer: dict
) -> None:
    """`mpspool status | head -1`: the command's real `main` and printing, with the pool's
    answer given in place of a pool's, into a pipe whose reader is closed before it starts
    (so every write meets EPIPE, whatever the timing): exit 1, nothing on stderr."""
    code = (
        "import sys\n"
        "from mpspool import cli\n"
        f"cli._ask_pool = lambda *args, **kwargs: {answer!r}\n"
        f"raise SystemExit(cli.main([{command!r}, '--run-dir', {str(tmp_path)!r}]))\n"
    )
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert result.stderr == ""
    assert result.returncode == 1
