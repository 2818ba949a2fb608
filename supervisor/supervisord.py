"""supervisord, driven: render its configuration, start it, talk to it over XML-RPC.

supervisord forks, execs, reaps, restarts crashed programs and captures their logs; the
controller only decides. Its XML-RPC interface is reached over a unix socket inside the
private run directory (never TCP), using the standard library's xmlrpc client — so
nothing here imports supervisord's own `supervisor` package, which this project's
`supervisor/` folder would shadow when run from the repository root.
"""

from __future__ import annotations

import http.client
import os
import re
import resource
import socket
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpspool import process, rundir

CONF_FILE = "supervisord.conf"
SOCKET_FILE = "supervisord.sock"
PID_FILE = "supervisord.pid"

# supervisord's process states (supervisor/states.py ProcessStates).
STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL = 0, 10, 20, 30, 40, 100, 200
# The states a stop ends (STOPPING: one under way).
STOPPABLE_STATES = (STARTING, RUNNING, BACKOFF, STOPPING)
# How much of a program's output log is read for why it stopped.
TAIL_BYTES = 8192
# supervisord's refusals to spawn a program's command at all (xmlrpc.Faults NO_FILE and
# NOT_EXECUTABLE, its checks of the command's first word before it forks): a program refused
# so stays as it was, so the refusal is the only word of it. (A failed fork, SPAWN_ERROR, is
# not one: supervisord retries it and reports it as BACKOFF, then FATAL with its spawnerr.)
SPAWN_REFUSALS = frozenset({20, 21})

# Each program's log keeps this many rotated files beside it (name.log.1, name.log.2).
PROGRAM_LOG_BACKUPS = 2


def program_logs(log_dir: Path, name: str) -> list[Path]:
    """Program ``name``'s log in ``log_dir``, then the rotated files supervisord keeps."""
    log = log_dir / f"{name}.log"
    return [log, *(log.with_name(f"{log.name}.{n}") for n in range(1, PROGRAM_LOG_BACKUPS + 1))]


@dataclass(frozen=True)
class LogEnd:
    """Where a program's output log ended: its file (inode; 0: none yet) and size."""

    ino: int
    size: int


@dataclass
class Program:
    name: str
    command: Sequence[str]
    group: str = ""
    priority: int = 100
    autostart: bool = True
    environment: Mapping[str, str] = field(default_factory=dict)
    autorestart: str = "unexpected"
    exitcodes: Sequence[int] = (0,)
    startsecs: int = 1
    startretries: int = 3
    stopwaitsecs: int = 10

    def render(self, run_dir: Path, log_dir: Path) -> str:
        env = ",".join(f'{k}="{_escape(v)}"' for k, v in self.environment.items())
        lines = [
            f"[program:{self.name}]",
            "command=" + _pct(" ".join(_quote(arg) for arg in self.command)),
            f"directory={_pct(run_dir)}",
            f"priority={self.priority}",
            f"autostart={'true' if self.autostart else 'false'}",
            f"autorestart={self.autorestart}",
            "exitcodes=" + ",".join(str(c) for c in self.exitcodes),
            f"startsecs={self.startsecs}",
            f"startretries={self.startretries}",
            "stopsignal=TERM",
            f"stopwaitsecs={self.stopwaitsecs}",
            # A worker's children (none today, compilers or helpers tomorrow) go with it.
            "stopasgroup=true",
            "killasgroup=true",
            "redirect_stderr=true",
            # supervisord expands this value twice (4.3.0), so it is escaped twice.
            f"stdout_logfile={_pct(_pct(program_logs(log_dir, self.name)[0]))}",
            "stdout_logfile_maxbytes=20MB",
            f"stdout_logfile_backups={PROGRAM_LOG_BACKUPS}",
        ]
        if env:
            lines.append(f"environment={env}")
        return "\n".join(lines) + "\n"


# supervisord's own default for minfds: it raises the soft open-file limit that far.
MIN_OPEN_FILES = 1024


def min_open_files() -> int:
    """supervisord's minfds: its default, or the hard open-file limit where that is lower.
    Under a lower hard limit supervisord refused to start at all (printing a wrong limit);
    the pool runs with what it may open, its front door keeping fewer client connections
    (and saying so in its log)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MIN_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MIN_OPEN_FILES, hard)


def render_config(
    run_dir: Path, log_dir: Path, identifier: str, programs: Sequence[Program]
) -> str:
    sections = [
        f"""[unix_http_server]
file={_pct(run_dir / SOCKET_FILE)}
chmod=0700

[supervisord]
nodaemon=true
identifier={identifier}
logfile={_pct(log_dir / "supervisord.log")}
logfile_maxbytes=20MB
logfile_backups=2
pidfile={_pct(run_dir / PID_FILE)}
childlogdir={_pct(log_dir)}
directory={_pct(run_dir)}
umask=077
minfds={min_open_files()}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
"""
    ]
    groups: dict[str, list[str]] = {}
    for program in programs:
        sections.append(program.render(run_dir, log_dir))
        if program.group:
            groups.setdefault(program.group, []).append(program.name)
    for group, names in groups.items():
        priority = min(p.priority for p in programs if p.group == group)
        sections.append(f"[group:{group}]\nprograms={','.join(names)}\npriority={priority}\n")
    return "\n".join(sections)


# A Python exception line ("ValueError: ...", "tensorflow.python.framework.errors_impl.
# NotFoundError: ..."), or a log line at error level or worse.
_ERROR_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b|Traceback|Fatal Python error)"
    r"|\b(ERROR|CRITICAL|FATAL)\b|(^|\s)[EF]\d{4} |: [EF] "
)


def last_error_line(text: str) -> str:
    """The last line of ``text`` that reads as an error, or ""."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and _ERROR_LINE.search(line):
            return line[:300]
    return ""


# Where supervisord's configuration parser (configparser, inline_comment_prefixes ";" and
# "#") ends a value: at a ';' or '#' after whitespace, the rest taken for a comment.
_INLINE_COMMENT = re.compile(r"(\s)([#;])")


def _quote(arg: str) -> str:
    """``arg`` as one word of a command supervisord splits with shlex: quoted, and a ';' or
    '#' after whitespace put in its own quotes ("'a '';b'"), so that no comment starts there
    (an install path such as "/opt/v #2/bin/python" was cut at the '#')."""
    if arg and all(c.isalnum() or c in "-_./:=,@+" for c in arg):
        return arg
    quoted = "'" + arg.replace("'", "'\"'\"'") + "'"
    return _INLINE_COMMENT.sub(r"\1''\2", quoted)


def config_value_problem(value: str) -> str:
    """Why supervisord's configuration cannot carry ``value`` as a plain value (a directory,
    a log file: not a command word, which `_quote` protects); "" when it can. Its parser
    strips a value's surrounding whitespace, ends it at a ';' or '#' after whitespace, and
    reads a line break as the start of another line."""
    if value != value.strip():
        return "it begins or ends with whitespace"
    if "\n" in value or "\r" in value:
        return "it has a line break"
    found = _INLINE_COMMENT.search(value)
    if found:
        return f"a {found.group(2)!r} after whitespace starts a comment there"
    return ""


def _pct(value: object) -> str:
    """supervisord expands %(name)s in most values; a literal % must be doubled."""
    return str(value).replace("%", "%%")


def _escape(value: str) -> str:
    # supervisord expands %(name)s in its values; a literal % must be doubled.
    return value.replace("%", "%%").replace('"', '\\"')


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__()
        self._path = path
        self._timeout = timeout

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        return _UnixConnection(self._path, self._timeout)


def pool_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What the pool's processes inherit: the caller's environment without CUDA's MPS
    variables. The pool owns MPS for its workers: each GPU worker is given its own daemon's
    pipe and log directories, and the daemon the pool's defaults (thread percentage, pinned
    memory). An operator's CUDA_MPS_PIPE_DIRECTORY would join a `--no-mps` pool's workers to
    whatever daemon listens there, and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE would cap each
    worker below what `mpspool status` shows."""
    return {k: v for k, v in environ.items() if not k.startswith("CUDA_MPS_")}


def publisher_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a weight publisher runs with: the pool's environment, and no GPU. It reads a
    checkpoint on the CPU, but a TensorFlow with CUDA, at its first eager op (a checkpoint
    only its reader takes), would open every visible GPU outside MPS and map nearly all of
    its memory while the pool's workers load or serve there (or, in EXCLUSIVE_PROCESS mode,
    be refused the GPU the MPS server holds, or hold it from the server)."""
    return {**pool_environment(environ), "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}


class Supervisord:
    """A supervisord child process and its XML-RPC interface."""

    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def rpc(self, timeout: float = 30.0) -> Any:
        proxy = xmlrpc.client.ServerProxy(
            "http://localhost/RPC2",
            transport=_UnixTransport(str(self.run_dir / SOCKET_FILE), timeout),
            allow_none=True,
        )
        return proxy.supervisor

    def start(self, config_text: str, ready_timeout: float = 15.0) -> None:
        conf = self.run_dir / CONF_FILE
        conf.write_text(config_text)
        os.chmod(conf, 0o600)
        # Private: TensorFlow's errors in the logs can quote request values. A log dir that
        # exists already keeps its mode (it may be a volume's root, or shared).
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        err_path = self.log_dir / "supervisord.stderr"
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(err_fd, "wb") as err_file:
            self.proc = self._spawn(conf, err_file)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = err_path.read_text(errors="replace").strip()
                raise RuntimeError(
                    f"supervisord exited at start (code {self.proc.returncode}): {err}"
                )
            try:
                if self.rpc(timeout=1.0).getState()["statename"] == "RUNNING":
                    return
            except (OSError, xmlrpc.client.Error):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"supervisord did not answer within {ready_timeout:.0f} s")

    def _spawn(self, conf: Path, err_file: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                # supervisord's main, and the segments of a controller killed outright
                # removed once its programs have ended (supervisord_run.py).
                "from mpspool.supervisor.supervisord_run import main; main()",
                "-c",
                str(conf),
            ],
            cwd=self.run_dir,  # never the repository root: see the module docstring
            # Inherited by every program: a later start finds a killed pool's processes by it.
            env={**pool_environment(os.environ), rundir.RUN_DIR_ENV: str(self.run_dir)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            # Its own process group: a Ctrl-C in the terminal reaches the controller only,
            # which then drains in order instead of everything dying at once. Not its own
            # session: where Linux groups each session's processes for CPU time (autogroup,
            # on by default outside a cpu cgroup), a session of its own made the front door
            # and workers a group apart from the controller and from any client started
            # beside the pool, and SCHED_IDLE (the loading workers) yields only within a
            # group: a loading version slowed clients 1.8-2.4x at p99 that way, 1.2-1.7x in
            # one session (bench/RESULTS.md, reloading).
            process_group=0,
            preexec_fn=process.die_with_parent_sigterm,
            # supervisord applies its config's umask only when it daemonizes, which it does
            # not here (nodaemon): without this its logs and its programs' were 0644.
            umask=0o077,
        )

    def update(self, config_text: str) -> tuple[list[str], list[str], list[str]]:
        """Rewrite the configuration and have supervisord read it again: the program groups
        (added, changed, removed). Nothing starts or stops by this; the caller adds and
        removes groups (addProcessGroup, removeProcessGroup), as supervisorctl's update."""
        conf = self.run_dir / CONF_FILE
        conf.write_text(config_text)
        os.chmod(conf, 0o600)
        ((added, changed, removed),) = self.rpc().reloadConfig()
        return list(added), list(changed), list(removed)

    def stop_groups(self, groups: Sequence[str], timeout: float = 60.0) -> list[str]:
        """Stops every process of these program groups at once and waits until none runs;
        the programs still running after ``timeout`` (none once supervisord has SIGKILLed
        them after their stopwaitsecs). Not stopProcessGroup(wait=True) group after group:
        supervisord looks at a waiting call once per turn of its main loop, which sleeps up
        to a second when nothing else wakes it, so every group cost about a second even when
        its workers exited at once (a pool of eleven models took eleven seconds to stop).
        Asking for the processes' states wakes that loop, which reaps the exited first."""
        rpc = self.rpc()
        wanted = set(groups)
        deadline = time.monotonic() + timeout
        to_stop = wanted
        while True:
            for group in sorted(to_stop):
                try:
                    rpc.stopProcessGroup(group, False)
                except xmlrpc.client.Fault:  # BAD_NAME: gone already; the look below decides
                    pass
            infos = [i for i in rpc.getAllProcessInfo() if i["group"] in wanted]
            running = [f"{i['group']}:{i['name']}" for i in infos if i["state"] in STOPPABLE_STATES]
            if not running or time.monotonic() >= deadline:
                return running
            # Told to stop, a process is STOPPING: one seen starting or running again was
            # started again meanwhile (a front door that had crashed, autorestarted).
            to_stop = {i["group"] for i in infos if i["state"] in (STARTING, RUNNING, BACKOFF)}
            time.sleep(0.05)

    def process_info(self) -> dict[str, dict[str, Any]]:
        return {f"{i['group']}:{i['name']}": i for i in self.rpc().getAllProcessInfo()}

    def log_end(self, program: str) -> LogEnd | None:
        """Where a program's output log ends now (its file and size), so that `tail_reason`
        reads only what its next process writes; None when it cannot be looked at."""
        try:
            stat = os.stat(self._log_file(program))
        except FileNotFoundError:
            return LogEnd(0, 0)  # none yet: all it will hold is new
        except OSError:
            return None
        return LogEnd(stat.st_ino, stat.st_size)

    def tail_reason(self, program: str, since: LogEnd | None = None) -> str:
        """Why a program says it stopped: its last FATAL_MARKER line, else the last line of
        its output that reads as an error (a Python exception, a fatal log line); "" when
        there is none. Never an informational line (TensorFlow's start-up chatter).
        ``since``: where its log ended when its last process was started (`log_end`): only
        what that process wrote is read. Its log is appended to, so a process that died
        without a word (SIGKILL) was given an earlier one's reason, or an earlier pool's.
        Read from the file, not through supervisord: its tail answers text decoded strictly,
        and a byte cut from a character failed the call (no reason at all)."""
        try:
            with open(self._log_file(program), "rb") as log:
                stat = os.fstat(log.fileno())
                size = stat.st_size
                start = max(0, size - TAIL_BYTES)
                if since is not None and since.ino == stat.st_ino and since.size <= size:
                    start = max(start, since.size)  # the same file, grown: what came since
                # Another file (rotated since, or made since) or a shorter one (truncated):
                # all of it is new.
                log.seek(start)
                text = log.read(size - start).decode("utf-8", errors="replace")
        except OSError:
            return ""
        return process.fatal_reason(text) or last_error_line(text)

    def _log_file(self, program: str) -> Path:
        """The output log of ``program`` ("group:name"), as `Program.render` names it."""
        return program_logs(self.log_dir, program.split(":", 1)[-1])[0]

    def exit_description(self, program: str) -> str:
        """How a program's last process ended, as supervisord logged it ("terminated by
        SIGKILL", "exit status 1"); "" when its log does not say."""
        name = program.split(":", 1)[-1]
        try:
            text = self.rpc().readLog(-16384, 0)
        except (OSError, xmlrpc.client.Error):
            return ""
        found = re.findall(rf"exited: {re.escape(name)} \(([^;)]+)", text)
        return found[-1] if found else ""

    def shutdown(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.rpc(timeout=5.0).shutdown()
        except (OSError, xmlrpc.client.Error):
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
