"""deploy/: the Kubernetes manifests pass strict schema validation offline, and the pod they
describe runs `mpspool start` the way its own parser reads it — GPU, /dev/shm, run dir,
ports, probes, drain budget and the HPA's metric all checked against mpspool's sources.

The image is not built here (no container engine); the Dockerfile is parsed instead."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mpspool import rundir
from mpspool.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30"
# Worker stop time the controller allows after the drain (README: ~10 s), plus a margin
# for supervisord.
WORKER_STOP_S = 10
MARGIN_S = 5
# The MPS daemons' part of a stop on a wedged GPU (mps/control.py): `get_server_list` for
# terminate_client and `quit` wait 5 s each, then supervisord's 10 s before it kills the
# daemon (a hunt measured 37 s for a SIGTERM stop with no requests to drain).
MPS_STOP_S = 5 + 5 + 10
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def deployment() -> dict[str, Any]:
    (doc,) = load("deployment.yaml")
    return doc


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (ctr,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "mpspool"]
    return ctr


def dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, one entry per occurrence (continuations joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT up to and including `mpspool start` (tini in front of it)."""
    (raw,) = dockerfile()["ENTRYPOINT"]
    argv = json.loads(raw)  # exec form: SIGTERM reaches tini, not a shell
    i = argv.index("mpspool")
    assert argv[i : i + 2] == ["mpspool", "start"], argv
    return argv


def start_args() -> argparse.Namespace:
    """The pod's `mpspool start` command line, read by mpspool's own parser."""
    argv = entrypoint()
    ctr = container(deployment())
    assert "command" not in ctr, "the image's ENTRYPOINT must stay in charge"
    return build_parser().parse_args(argv[argv.index("mpspool") + 1 :] + ctr["args"])


def mounts() -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    spec = deployment()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container(deployment())["volumeMounts"]}


def quantity(value: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


# -- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_passes_strict_validation(path: Path) -> None:
    docs = load(path.name)
    assert docs
    for doc in docs:
        # validate() raises on a missing schema too (the CLI only warns), so an apiVersion
        # the pinned Kubernetes lacks fails here.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_unknown_fields() -> None:
    dep = deployment()
    container(dep)["shmSize"] = "2Gi"  # not a Kubernetes field: strict must catch it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_the_manifests() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert all((K8S / name).is_file() for name in listed)
    # hpa.yaml is an example that needs the custom metrics API; everything else ships.
    assert {p.name for p in manifests()} - listed == {"hpa.yaml"}
    images = {i["name"] for i in kustomization["images"]}
    dep = deployment()["spec"]["template"]["spec"]
    assert {c["image"].split(":")[0] for c in dep["containers"] + dep["initContainers"]} <= images


# -- the pod runs `mpspool start` as its parser reads it ---------------------------------------


def test_container_runs_mpspool_start_on_one_gpu() -> None:
    args = start_args()
    assert args.command == "start"
    assert args.host == "0.0.0.0"
    assert Path(args.model_base_path).parent == Path("/models")
    assert "/models" in mounts()
    gpus = args.gpus.split(",")
    limits = container(deployment())["resources"]["limits"]
    requests = container(deployment())["resources"]["requests"]
    assert int(limits["nvidia.com/gpu"]) == int(requests["nvidia.com/gpu"]) == len(gpus) == 1
    # The device plugin exposes the pod's one GPU as index 0.
    assert gpus == ["0"]
    assert args.mps and 1 <= args.contexts_per_gpu <= 48


def test_the_demo_init_container_may_run_again() -> None:
    """Kubernetes may run an init container again over the volume it filled (a pod sandbox
    restarted): the version it wrote is kept, not an error that loops the pod in
    Init:CrashLoopBackOff."""
    (init,) = deployment()["spec"]["template"]["spec"]["initContainers"]
    command = init["command"]
    assert command[0] == "mpspool"
    args = build_parser().parse_args(command[1:])
    assert args.command == "demo-model" and args.exist_ok
    assert str(args.out) == start_args().model_base_path


def test_the_demo_init_container_gets_no_gpu() -> None:
    """It asks for none; a base image's NVIDIA_VISIBLE_DEVICES=all would still have the
    NVIDIA runtime mount every GPU of the node into it, and TensorFlow map them."""
    (init,) = deployment()["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert "nvidia.com/gpu" not in init["resources"].get("limits", {})


def test_the_build_context_leaves_out_the_crates_build_folder() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    # After `!router/`: the last matching line wins in a .dockerignore.
    assert ignore.index("router/target") > ignore.index("!router/")


def test_every_path_the_build_copies_is_in_the_build_context() -> None:
    """Each COPY from the context names a path of the checkout that the ignore file lets
    through (it ignores everything, `**`, then lets each path back in): a path left out
    fails the build at its COPY."""
    ignore = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "**"
    let_in = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    root = DEPLOY.parent
    sources = []
    for line in dockerfile()["COPY"]:
        words = line.split()
        if any(w.startswith("--from") for w in words):
            continue  # from another stage, not the context
        sources += words[:-1]
    assert sources
    for source in sources:
        assert (root / source).exists(), source
        assert source.rstrip("/") in let_in, f"{source} is left out of the build context"


def test_dev_shm_is_memory_backed_and_counted_in_the_memory_limit() -> None:
    shm = mounts()["/dev/shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    limit = quantity(container(deployment())["resources"]["limits"]["memory"])
    # tmpfs pages count against the container's memory limit: leave room for the processes.
    assert 64 * 2**20 < quantity(shm["sizeLimit"]) < limit
    # deploy/README.md's formula: /dev/shm + 2 x contexts x 1.5 Gi a GPU worker (a new
    # version loads on workers of its own beside the serving ones) + 0.5 Gi for the rest +
    # the front door's request budget (4 x --max-message-bytes, at least 256 MiB).
    args = start_args()
    budget = max(4 * args.max_message_bytes, 256 * 2**20)
    workers = 2 * args.contexts_per_gpu * len(args.gpus.split(","))
    need = quantity(shm["sizeLimit"]) + workers * 1.5 * 2**30 + 0.5 * 2**30 + budget
    assert need <= limit, (need / 2**30, limit / 2**30)


def test_run_dir_is_made_by_mpspool_inside_an_emptydir() -> None:
    args = start_args()
    volumes = mounts()
    # mpspool refuses a run dir it does not own or that is not 0700; a volume's root is
    # root-owned 0777, so the volume holds the run dir rather than being it.
    assert str(args.run_dir) not in volumes
    assert "emptyDir" in volumes[str(args.run_dir.parent)]
    assert "emptyDir" in volumes[str(args.log_dir)]
    sockets = [args.run_dir / name for name in rundir.POOL_FILES]
    sockets.append(args.run_dir / "mps" / "gpu0" / "pipe" / "control")
    assert max(len(str(p)) for p in sockets) <= UNIX_PATH_MAX


def test_ports_and_probes_match_mpspool_start() -> None:
    args = start_args()
    ctr = container(deployment())
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"grpc": args.port, "http": args.rest_api_port, "metrics": args.metrics_port}
    assert args.rest_api_port == 8501  # where TF Serving's clients look for REST
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # grpc.health.v1 on the router's port; gRPC probes take numbers, not port names.
        assert ctr[probe]["grpc"] == {"port": args.port}, probe
    # The startup probe covers model load; the liveness probe outlasts a worker restart.
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    liveness = ctr["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(args.metrics_port)


def test_services_route_to_the_container_ports() -> None:
    dep = deployment()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    names = {p["name"] for p in container(dep)["ports"]}
    services = load("service.yaml")
    assert {s["metadata"]["name"] for s in services} == {"mpspool", "mpspool-headless"}
    for svc in services:
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    (headless,) = [s for s in services if s["metadata"]["name"] == "mpspool-headless"]
    assert headless["spec"]["clusterIP"] == "None"


def test_termination_grace_covers_the_drain() -> None:
    defaults = build_parser().parse_args(["start", "--demo"])
    args = start_args()
    spec = deployment()["spec"]["template"]["spec"]
    budget = args.shutdown_delay + args.drain_timeout + WORKER_STOP_S + MPS_STOP_S + MARGIN_S
    assert spec["terminationGracePeriodSeconds"] > budget
    # Endpoint removal lags SIGTERM: the pod waits at least as long as a bare pool would.
    assert args.shutdown_delay >= defaults.shutdown_delay
    assert args.drain_timeout >= defaults.drain_timeout
    # Rolling updates never take a serving pod away before its replacement is Ready.
    rolling = deployment()["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 or rolling["maxSurge"] == 0


def test_pdb_and_hpa_target_the_deployment() -> None:
    from mpspool.router import INFLIGHT_METRIC

    dep = deployment()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (pdb,) = load("pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (hpa,) = load("hpa.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (dep["kind"], dep["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == INFLIGHT_METRIC
    assert hpa["spec"]["minReplicas"] >= 2  # the PDB's maxUnavailable: 1 leaves one serving


# -- the image -----------------------------------------------------------------------------


def test_dockerfile_builds_a_nonroot_gpu_image_running_mpspool_start() -> None:
    df = dockerfile()
    # Every stage on the GPU build of TensorFlow: the image is the last stage, and the wheel's
    # stage links the front door against the glibc the image runs with.
    assert all(re.match(r"tensorflow/tensorflow:\S*-gpu\b", f) for f in df["FROM"]), df["FROM"]
    # mpspool without its `tf` extra: that would install tensorflow-cpu beside the GPU build.
    installs = [r for r in df["RUN"] if "pip install" in r]
    assert installs and not any("[tf" in r for r in installs), installs
    # tini is PID 1 (SIGTERM forwarded to `mpspool start`, orphans reaped), and installed.
    argv = entrypoint()
    assert argv[0] == "/usr/bin/tini" and argv[1] == "--", argv
    assert any(re.search(r"apt-get install .*\btini\b", r) for r in df["RUN"])
    # Numeric UID:GID, not root, and the one the pod's securityContext runs as.
    (user,) = df["USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    pod_security = deployment()["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (int(uid), int(gid))
    assert pod_security["runAsNonRoot"] is True
    # A container's own securityContext overrides the pod's: none may run as another user
    # (root beside runAsNonRoot is refused by the kubelet; another UID is not MPS's user).
    spec = deployment()["spec"]["template"]["spec"]
    for ctr in spec["containers"] + spec.get("initContainers", []):
        own = ctr.get("securityContext", {})
        assert own.get("runAsUser", int(uid)) == int(uid), ctr["name"]
        assert own.get("runAsGroup", int(gid)) == int(gid), ctr["name"]
        assert own.get("runAsNonRoot", True) is True, ctr["name"]

    env: dict[str, str] = {}
    for line in df.get("ENV", []):
        env.update(item.split("=", 1) for item in shlex.split(line))
    assert {"compute", "utility"} <= set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    pod_env = {e["name"]: e.get("value") for e in container(deployment())["env"]}
    assert {"compute", "utility"} <= set(pod_env["NVIDIA_DRIVER_CAPABILITIES"].split(","))

    run = " ".join(df["RUN"])
    assert "libjemalloc2" in run
    # The LD_PRELOAD the pod sets is the file the image build checks exists.
    assert f"test -e {pod_env['LD_PRELOAD']}" in run

    (cmd,) = df["CMD"]
    default = build_parser().parse_args(argv[argv.index("mpspool") + 1 :] + json.loads(cmd))
    assert default.host == "0.0.0.0" and default.gpus == "0"
    exposed = {int(p) for line in df["EXPOSE"] for p in line.split()}
    assert exposed == {default.port, default.rest_api_port, default.metrics_port}
