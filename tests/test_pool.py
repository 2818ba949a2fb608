"""A real pool (supervisord, router, 2 TensorFlow workers) queried with the official
tensorflow-serving-api client: answers, metadata, status, health, and every error code."""

from __future__ import annotations

import itertools
import json
import stat
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from grpc_health.v1 import health_pb2
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, memory_mib, mpspool_cmd


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Pool]:
    # A wildcard host, as in a container: its clients on 127.0.0.1 reach a dual-stack
    # socket as ::ffff:127.0.0.1, which must still count as local (admin calls).
    pool = Pool(tmp_path_factory.mktemp("pool"), demo_model_dir, 2, "--host", "0.0.0.0").start()
    try:
        pool.wait_ready(2)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


@pytest.fixture(scope="module")
def stub(pool: Pool) -> Iterator[prediction_service_pb2_grpc.PredictionServiceStub]:
    with pool.channel() as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def make_request(inputs: dict[str, np.ndarray], **spec: object) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value  # type: ignore[assignment]
        else:
            setattr(request.model_spec, key, value)
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return request


def expect_error(stub, request, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details()
    return info.value.details()


@pytest.mark.parametrize("batch", [1, 256])
def test_predict_equals_in_process_tensorflow(stub, reference_model, batch: int) -> None:
    inputs = demo_inputs(batch, DEMO_ROWS, seed=batch)
    response = stub.Predict(make_request(inputs), timeout=30)
    got = tf.make_ndarray(response.outputs["score"])
    want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()
    assert got.shape == (batch, 1)
    assert np.max(np.abs(got - want)) <= 1e-6
    assert response.model_spec.name == "demo"
    assert response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"


def test_requests_are_spread_over_both_workers(pool: Pool, stub) -> None:
    # Counts reach `status` on the controller's next look (every 0.2 s): let earlier
    # tests' requests settle first.
    before: dict[str, int] = {}
    while (now := {s["slot"]: s["served"] for s in pool.status()["slots"]}) != before:
        before = now
        time.sleep(0.5)
    for i in range(10):
        stub.Predict(make_request(demo_inputs(1, DEMO_ROWS, seed=i)), timeout=30)
    # The controller folds the router's counts in on its next look (every 0.2 s).
    status = pool.wait_for(
        lambda st: sum(s["served"] for s in st["slots"]) >= sum(before.values()) + 10,
        10,
        "10 more requests counted",
    )
    after = {s["slot"]: s["served"] for s in status["slots"]}
    assert all(after[slot] - before[slot] == 5 for slot in after), (before, after)


def test_typed_fields_parse_as_tensorflow_does(stub, reference_model) -> None:
    """perf_analyzer 2.51 puts INT64 values in bool_val: TensorFlow reads int64_val only,
    so the ids are all zeros — the pool must answer exactly that, not reject or guess."""
    inputs = demo_inputs(2, DEMO_ROWS, seed=7)
    request = make_request({"dense": inputs["dense"]})
    ids = request.inputs["ids"]
    ids.dtype = tf.int64.as_datatype_enum
    ids.tensor_shape.dim.add(size=2)
    ids.tensor_shape.dim.add(size=16)
    ids.bool_val.extend([True] * 32)
    response = stub.Predict(request, timeout=30)
    zeros = np.zeros((2, 16), np.int64)
    want = reference_model(ids=tf.constant(zeros), dense=tf.constant(inputs["dense"]))[
        "score"
    ].numpy()
    assert np.max(np.abs(tf.make_ndarray(response.outputs["score"]) - want)) <= 1e-6


def test_output_filter_and_version_choices(stub) -> None:
    inputs = demo_inputs(3, DEMO_ROWS)
    request = make_request(inputs, version=1)
    request.output_filter.append("score")
    assert list(stub.Predict(request, timeout=30).outputs) == ["score"]
    assert list(stub.Predict(make_request(inputs, version_label="1"), timeout=30).outputs) == [
        "score"
    ]
    request.output_filter[:] = ["nope"]
    expect_error(
        stub, request, grpc.StatusCode.INVALID_ARGUMENT, "output tensor alias not found", "{score}"
    )


def test_get_model_metadata(pool: Pool) -> None:
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        request.model_spec.name = "demo"
        response = stub.GetModelMetadata(request, timeout=30)
        assert response.model_spec.name == "demo" and response.model_spec.version.value == 1
        signatures = get_model_metadata_pb2.SignatureDefMap()
        assert response.metadata["signature_def"].Unpack(signatures)
        sig = signatures.signature_def["serving_default"]
        assert sig.method_name == "tensorflow/serving/predict"
        dims = {k: [d.size for d in v.tensor_shape.dim] for k, v in sig.inputs.items()}
        assert dims == {"ids": [-1, 16], "dense": [-1, 13]}
        assert sig.inputs["ids"].dtype == tf.int64.as_datatype_enum
        assert sig.inputs["dense"].dtype == tf.float32.as_datatype_enum
        assert [d.size for d in sig.outputs["score"].tensor_shape.dim] == [-1, 1]

        request.ClearField("metadata_field")
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelMetadata(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        request.metadata_field.append("bogus")
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelMetadata(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bogus" in info.value.details()
        # TF Serving's order: each field in turn, the model looked up at "signature_def". A
        # model not served is named only when that field comes before a wrong one.
        request.model_spec.name = "absent"
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelMetadata(request, timeout=30)
        assert info.value.details() == "Metadata field bogus is not supported"
        request.metadata_field[:] = ["signature_def", "bogus"]
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelMetadata(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()


def test_get_model_status_and_health(pool: Pool) -> None:
    with pool.channel() as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "demo"
        response = stub.GetModelStatus(request, timeout=30)
        [status] = response.model_version_status
        assert status.version == 1
        assert status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
        assert status.status.error_code == 0
        request.model_spec.name = "other"
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelStatus(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert pool.health(channel) == health_pb2.HealthCheckResponse.SERVING
        for service in (
            "tensorflow.serving.PredictionService",
            "tensorflow.serving.ModelService",
            "PredictionService",
            "ModelService",
        ):
            assert pool.health(channel, service) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            pool.health(channel, "tensorflow.serving.Nope")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_wildcard_host_serves_ipv4_and_ipv6_clients(pool: Pool) -> None:
    """`--host 0.0.0.0` listens on both families, as TF Serving's wildcard does (gRPC's C
    core opens a dual-stack socket for it, its REST server binds ::): on an IPv6 cluster the
    kubelet's probes, the Service and Prometheus dial the pod's IPv6 address."""
    status = pool.status()["pool"]
    assert status["listen"] == f"0.0.0.0:{pool.port}"
    metrics_port = urllib.parse.urlsplit(status["metrics"]).port
    rest_port = urllib.parse.urlsplit(pool.rest_url).port
    hosts = ["127.0.0.1"] + (["[::1]"] if _has_ipv6_loopback() else [])
    for host in hosts:
        with grpc.insecure_channel(f"{host}:{pool.port}") as channel:
            assert pool.health(channel) == health_pb2.HealthCheckResponse.SERVING, host
        for url in (
            f"http://{host}:{rest_port}/v1/models/demo",
            f"http://{host}:{metrics_port}/metrics",
        ):
            answer = subprocess.run(
                ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", url],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert answer.stdout == "200", (url, answer.stderr)


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_requests_are_answered_as_plain_ones(
    pool: Pool, stub, compression: grpc.Compression
) -> None:
    """A client compressing its messages (gzip, deflate: what gRPC C++ takes) is answered on
    every service; a plain client gets the same answer."""
    request = make_request(demo_inputs(256, DEMO_ROWS, seed=5))
    plain = stub.Predict(request, timeout=30)
    target = f"127.0.0.1:{pool.port}"
    with grpc.insecure_channel(target, compression=compression) as channel:
        compressed = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        reply = compressed.Predict(request, timeout=30)
        assert set(reply.outputs) == set(plain.outputs)
        for name in plain.outputs:
            np.testing.assert_array_equal(
                tf.make_ndarray(reply.outputs[name]), tf.make_ndarray(plain.outputs[name])
            )
        status = get_model_status_pb2.GetModelStatusRequest()
        status.model_spec.name = "demo"
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        [version] = models.GetModelStatus(status, timeout=30).model_version_status
        assert version.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
        assert pool.health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_a_rest_body_too_costly_to_parse_is_refused_without_the_memory(pool: Pool, stub) -> None:
    """40 MB of tiny JSON objects would take the front door ~3.5 GB as a document (serde_json:
    ~90 times its size; it did before the check). Refused with RESOURCE_EXHAUSTED (HTTP 429,
    TF Serving's mapping) before it is built; the front door lives on, its peak memory barely
    moves, and requests are answered as before."""
    router = pool.status()["pool"]["router_pid"]
    before = memory_mib(router, "VmHWM")
    body = b'{"instances":[' + b'{"a":1},' * 5_000_000 + b'{"a":1}]}'
    answer = requests.post(f"{pool.rest_url}/v1/models/demo:predict", data=body, timeout=60)
    assert answer.status_code == 429, answer.text[:500]
    message = answer.json()["error"]
    assert "5000002 objects" in message and "more than the 2048 MiB allowed" in message, message
    assert pool.status()["pool"]["router_pid"] == router
    assert memory_mib(router, "VmHWM") - before < 256, (before, memory_mib(router, "VmHWM"))
    request = make_request(demo_inputs(4, DEMO_ROWS))
    assert stub.Predict(request, timeout=30).outputs


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _length_delimited(field: int, payload: bytes) -> bytes:
    """One protobuf field of wire type 2: its key, its length, its bytes."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def test_a_grpc_request_too_costly_to_decode_is_refused_without_the_memory(
    pool: Pool, stub
) -> None:
    """40 million empty strings are 80 MiB on the wire and 40 million 32-byte values once
    decoded (prost: 1.3-2.6 GB with the vector's growth). Refused with RESOURCE_EXHAUSTED
    before it is decoded; the front door's peak grows by little more than the message it
    received, and requests are answered as before."""
    router = pool.status()["pool"]["router_pid"]
    Path(f"/proc/{router}/clear_refs").write_text("5")
    before = memory_mib(router, "VmHWM")
    strings = b"\x08\x07" + b"\x42\x00" * 40_000_000  # dtype DT_STRING, then string_val ""
    entry = _length_delimited(1, b"ids") + _length_delimited(2, strings)
    body = _length_delimited(1, _length_delimited(1, b"demo")) + _length_delimited(2, entry)
    with pool.channel() as channel, pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary("/tensorflow.serving.PredictionService/Predict")(body, timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert "more than the 2048 MiB allowed" in refused.value.details()
    grown = memory_mib(router, "VmHWM") - before
    assert grown < 300, f"the front door's peak grew {grown:.0f} MiB"
    assert pool.status()["pool"]["router_pid"] == router
    request = make_request(demo_inputs(4, DEMO_ROWS))
    assert stub.Predict(request, timeout=30).outputs


def test_an_error_echoing_a_huge_name_still_reaches_the_client_with_its_code(stub) -> None:
    """A 20 KB model name echoed whole in grpc-message would pass the client's 16 KiB limit on
    trailers (it saw RESOURCE_EXHAUSTED); the message is cut, the code stays NOT_FOUND."""
    request = make_request(demo_inputs(1, DEMO_ROWS))
    request.model_spec.name = "m" * 20_000
    details = expect_error(stub, request, grpc.StatusCode.NOT_FOUND, "Servable not found")
    assert details.endswith("more bytes)") and len(details) <= 4096, details[-80:]


def test_logs_are_readable_by_their_owner_only(pool: Pool) -> None:
    """TensorFlow's errors can quote request values. supervisord applies its config's umask
    only when it daemonizes, and the pool runs it in the foreground: its logs and every
    program's were 0644 in a 0755 directory (found by an operator test)."""
    assert stat.S_IMODE(pool.log_dir.stat().st_mode) == 0o700
    logs = list(pool.log_dir.iterdir())
    assert {p.name for p in logs} >= {"supervisord.log", "router.log", "worker-cpu-0-v1.log"}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) & 0o077 for p in logs} == dict.fromkeys(
        (p.name for p in logs), 0
    )


def test_workers_serve_without_loading_matplotlib(pool: Pool) -> None:
    """Keras would import it with TensorFlow (0.4 s and 28 MiB a worker); workers keep it out
    (worker/serve.py). Its compiled modules would be mapped into the process."""
    for pid in pool.worker_pids():
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "tensorflow" in maps, "a worker with TensorFlow loaded"
        assert "/matplotlib/" not in maps, f"worker {pid} loaded matplotlib"


def test_calls_the_c_core_refuses_by_their_headers_are_refused_alike(
    pool: Pool, tmp_path: Path
) -> None:
    """As gRPC's C core (TF Serving's server) refuses them before any method runs: a GET
    (the front door routed by path alone, and curl's GET ran a Predict) and a POST without
    `te: trailers`, each UNKNOWN in the C core's words. The content type is not checked, as
    the C core does not check it: a proper call with another one is answered."""
    body = make_request(demo_inputs(1, DEMO_ROWS)).SerializeToString()
    framed = tmp_path / "framed"
    framed.write_bytes(b"\0" + len(body).to_bytes(4, "big") + body)
    answer = tmp_path / "answer"
    url = f"http://127.0.0.1:{pool.port}/tensorflow.serving.PredictionService/Predict"

    def call(*args: str) -> dict[str, str]:
        head = subprocess.run(
            ["curl", "-sS", "--http2-prior-knowledge", "-D", "-", "-o", str(answer), *args, url],
            capture_output=True, check=True, timeout=30, text=True,
        ).stdout  # fmt: skip
        lines = (line.partition(":") for line in head.splitlines()[1:])
        got = {name.strip().lower(): value.strip() for name, _, value in lines if name}
        if "grpc-message" in got:  # percent-encoded, as gRPC clients decode it
            got["grpc-message"] = urllib.parse.unquote(got["grpc-message"])
        return got

    got = call()
    assert (got["grpc-status"], got["grpc-message"]) == ("2", "Bad method header"), got
    post = ["--data-binary", f"@{framed}"]
    got = call(*post, "-H", "content-type: application/grpc")
    assert (got["grpc-status"], got["grpc-message"]) == ("2", "Missing :te header"), got
    answer.unlink()
    got = call(*post, "-H", "content-type: application/octet-stream", "-H", "te: trailers")
    assert "grpc-message" not in got, got
    answered = answer.read_bytes()
    response = predict_pb2.PredictResponse.FromString(answered[5:])
    assert int.from_bytes(answered[1:5], "big") == len(answered) - 5
    assert response.model_spec.name == "demo" and response.outputs, response


def test_error_codes_match_tf_serving(pool: Pool, stub) -> None:
    pids = {s["slot"]: s["pid"] for s in pool.status()["slots"]}
    good = demo_inputs(2, DEMO_ROWS)

    request = make_request(good)
    request.model_spec.name = "nope"
    expect_error(
        stub, request, grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"
    )
    expect_error(
        stub, make_request(good, version=7), grpc.StatusCode.NOT_FOUND, "Specific(demo, 7)"
    )
    expect_error(
        stub, make_request(good, version_label="canary"), grpc.StatusCode.INVALID_ARGUMENT, "canary"
    )
    expect_error(
        stub,
        make_request(good, signature_name="predict_v2"),
        grpc.StatusCode.FAILED_PRECONDITION,
        'Serving signature key "predict_v2" not found.',
    )
    expect_error(
        stub,
        make_request({"ids": good["ids"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
        "input size does not match signature",
        "Missing but required: {dense}",
    )
    expect_error(
        stub,
        make_request({**good, "extra": good["dense"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Sent extra: {extra}",
    )
    expect_error(
        stub,
        make_request({"ids": good["ids"].astype(np.float32), "dense": good["dense"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
        '"ids"',
        "int64",
        "float",
    )
    expect_error(
        stub,
        make_request({"ids": good["ids"][:, :8], "dense": good["dense"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
        '"ids"',
        "[2,8]",
        "[-1,16]",
    )
    # Reaches TensorFlow and fails there: an id beyond the table.
    expect_error(
        stub,
        make_request({"ids": good["ids"] + DEMO_ROWS, "dense": good["dense"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not in [0, 1000)",
    )
    # Batch sizes that disagree between inputs: only TensorFlow can tell.
    expect_error(
        stub,
        make_request({"ids": good["ids"], "dense": demo_inputs(3, DEMO_ROWS)["dense"]}),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    broken = make_request(good)
    broken.inputs["dense"].tensor_content = b"\0" * 7
    expect_error(stub, broken, grpc.StatusCode.INVALID_ARGUMENT, "tensor_content")

    # Nothing above cost a worker its life.
    assert {s["slot"]: s["pid"] for s in pool.status()["slots"]} == pids
    assert (
        stub.Predict(make_request(good), timeout=30).outputs["score"].tensor_shape.dim[0].size == 2
    )


def test_prometheus_metrics(pool: Pool, stub) -> None:
    import urllib.request

    from mpspool.router import INFLIGHT_METRIC, READY_WORKERS_METRIC

    stub.Predict(make_request(demo_inputs(1, DEMO_ROWS)), timeout=30)
    with pytest.raises(grpc.RpcError):
        stub.Predict(make_request(demo_inputs(1, DEMO_ROWS), version=7), timeout=30)
    url = pool.status()["pool"]["metrics"]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = _parse_prometheus(text)
    assert samples[f'{INFLIGHT_METRIC}{{model="demo"}}'] == 0.0
    assert samples[READY_WORKERS_METRIC] == 2.0
    # Every state has its row, zeros too (an alert on FATAL > 0 has a series to watch).
    slots = {k: v for k, v in samples.items() if k.startswith("mpspool_worker_slots{")}
    assert slots == {
        f'mpspool_worker_slots{{state="{state}"}}': 2.0 if state == "READY" else 0.0
        for state in ("STARTING", "READY", "DRAINING", "STOPPED", "BACKOFF", "FATAL")
    }
    ok = 'mpspool_requests_total{code="OK",method="Predict",model="demo"}'
    not_found = 'mpspool_requests_total{code="NOT_FOUND",method="Predict",model="demo"}'
    assert samples[ok] >= 1
    assert samples[not_found] >= 1
    assert samples['mpspool_request_duration_seconds_count{method="Predict",model="demo"}'] >= 2


def test_timeline_shows_each_request_on_the_worker_that_ran_it(pool: Pool, stub) -> None:
    def timeline(*flags: str) -> dict:
        done = subprocess.run(
            mpspool_cmd("timeline", "--run-dir", str(pool.run_dir), *flags),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    timeline("--clear")
    before_us = time.time_ns() // 1000
    for i in range(6):
        stub.Predict(make_request(demo_inputs(4, DEMO_ROWS, seed=i)), timeout=30)
    after_us = time.time_ns() // 1000
    taken = timeline("--clear")
    spans = taken["spans"]
    assert len(spans) == 6 and taken["dropped"] == 0
    # The timeline names workers as the front door knows them: placement@version.
    slots = {f"{s['slot']}@{s['version']}" for s in pool.status()["slots"]}
    # Round robin over two workers; one worker runs one request at a time, in order.
    assert {slot for slot, _, _ in spans} == slots
    for _slot, start_us, end_us in spans:
        assert before_us <= start_us <= end_us <= after_us
    for slot in slots:
        mine = [(s, e) for name, s, e in spans if name == slot]
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(mine))
    assert timeline()["spans"] == []  # cleared


def _parse_prometheus(text: str) -> dict[str, float]:
    """Samples by name and labels, the labels put in name order (their order in the text
    carries no meaning in Prometheus's format)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            key = name + "{" + ",".join(sorted(labels.split(","))) + "}"
        samples[key] = float(value)
    return samples
