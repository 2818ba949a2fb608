"""TF Serving's REST API and its typed gRPC outputs, on real pools, called the ways feature and
ranking services call them: `requests`, `curl`, and the official gRPC client for the same
inputs. Two models: the demo (int64 ids + float features → score) and a model built here with
string, binary and integer inputs and string, `_bytes`, int64 and float outputs."""

from __future__ import annotations

import base64
import gzip
import json
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.config import ConfigError, prometheus_path_from
from mpspool.demo_model import DENSE_FEATURES, demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, memory_mib, prometheus_samples

# Over 256 KiB, the size from which the front door parses a JSON body off its serving threads
# (router/src/rest.rs); its request budget is then its floor, 256 MiB.
MAX_MESSAGE = 1_000_000


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("rest")
    monitoring = tmp / "monitoring.config"
    monitoring.write_text(
        'prometheus_config {\n  enable: true,\n  path: "/monitoring/prometheus/metrics"\n}\n'
    )
    pool = Pool(
        tmp,
        demo_model_dir,
        1,
        "--max-message-bytes",
        str(MAX_MESSAGE),
        "--monitoring_config_file",
        str(monitoring),
    )
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def build_text_model(base: Path) -> Path:
    """Strings in and out: `words` (text), `raw` (binary), `k` (int32) → `upper` (text),
    `raw_bytes` (the binary echoed), `length` (int64), `scores` (float, [n, 2]); and a
    signature `halve`: `x` (float) → `half`, which carries NaN and infinities through on
    any CPU."""

    class TextModel(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = tf.Variable([0.5, 2.0], name="weights")

        @tf.function(
            input_signature=[
                tf.TensorSpec([None], tf.string, name="words"),
                tf.TensorSpec([None], tf.string, name="raw"),
                tf.TensorSpec([None], tf.int32, name="k"),
            ]
        )
        def serve(self, words, raw, k):
            length = tf.cast(tf.strings.length(raw), tf.int64) + tf.cast(k, tf.int64)
            scores = tf.cast(k, tf.float32)[:, None] * self.weights[None, :]
            return {
                "upper": tf.strings.upper(words),
                "raw_bytes": raw,
                "length": length,
                "scores": scores,
            }

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def halve(self, x):
            return {"half": x * 0.5}

    module = TextModel()
    signatures = {"serving_default": module.serve, "halve": module.halve}
    tf.saved_model.save(module, str(base / "1"), signatures=signatures)
    return base


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("rest-text")
    model = build_text_model(tmp / "text")
    # gRPC answers of this pool carry tensor_content (TF Serving's flag); REST is unaffected.
    # Its REST answers carry CORS headers (TF Serving's flag, in TF Serving's spelling).
    pool = Pool(
        tmp,
        model,
        1,
        "--enable-serialization-as-tensor-content",
        "--rest_api_enable_cors_support=true",
    )
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
    finally:
        pool.kill()


def grpc_predict(
    pool: Pool, inputs: dict[str, np.ndarray], signature_name: str = ""
) -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.model_spec.signature_name = signature_name
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        return stub.Predict(request, timeout=30)


def rest(pool: Pool, path: str, body: Any = None, raw: bytes | None = None) -> requests.Response:
    url = f"{pool.rest_url}/v1/models/{path}"
    if raw is None and body is None:
        return requests.get(url, timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(url, data=data, timeout=30)


def curl(pool: Pool, path: str, body: str | None = None) -> tuple[int, Any]:
    command = ["curl", "-sS", "-w", "\n%{http_code}", f"{pool.rest_url}/v1/models/{path}"]
    if body is not None:
        command += ["-X", "POST", "-H", "Content-Type: application/json", "-d", body]
    out = subprocess.run(command, capture_output=True, check=True, timeout=30, text=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), json.loads(text)


# -- gRPC: typed fields --------------------------------------------------------------------
def test_grpc_outputs_fill_the_typed_fields_by_default(demo: Pool, reference_model) -> None:
    inputs = demo_inputs(8, DEMO_ROWS, seed=3)
    response = grpc_predict(demo, inputs)
    score = response.outputs["score"]
    # What a Java, Go or C++ client reads directly.
    assert score.tensor_content == b""
    assert len(score.float_val) == 8
    expected = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"]
    np.testing.assert_array_equal(np.array(score.float_val).reshape(8, 1), tf.make_ndarray(score))
    np.testing.assert_allclose(tf.make_ndarray(score), expected.numpy(), atol=1e-6)


def test_grpc_outputs_in_tensor_content_with_tf_servings_flag(text: Pool) -> None:
    inputs = {
        "words": np.array([b"a", b"b"], dtype=object),
        "raw": np.array([b"\x00\xff", b""], dtype=object),
        "k": np.array([3, 4], dtype=np.int32),
    }
    response = grpc_predict(text, inputs)
    scores = response.outputs["scores"]
    assert scores.float_val == [] and len(scores.tensor_content) == 2 * 2 * 4
    np.testing.assert_array_equal(tf.make_ndarray(scores), [[1.5, 6.0], [2.0, 8.0]])
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["length"]), [5, 4])
    assert list(response.outputs["raw_bytes"].string_val) == [b"\x00\xff", b""]


# -- REST: predict -------------------------------------------------------------------------
def test_rest_row_and_columnar_answers_equal_grpcs(demo: Pool) -> None:
    inputs = demo_inputs(5, DEMO_ROWS, seed=4)
    expected = tf.make_ndarray(grpc_predict(demo, inputs).outputs["score"])
    rows = [{name: inputs[name][i].tolist() for name in inputs} for i in range(5)]
    answer = rest(demo, "demo:predict", {"instances": rows})
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"] == "application/json"
    predictions = np.array(answer.json()["predictions"], dtype=np.float32)
    # TF Serving writes each float so that it parses back to the same float32.
    np.testing.assert_array_equal(predictions, expected)
    columns = {name: array.tolist() for name, array in inputs.items()}
    answer = rest(demo, "demo/versions/1:predict", {"inputs": columns})
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(np.array(answer.json()["outputs"], dtype=np.float32), expected)
    # The version number answers as a label too, as on the gRPC side.
    answer = rest(
        demo, "demo/labels/1:predict", {"signature_name": "serving_default", "inputs": columns}
    )
    assert answer.status_code == 200, answer.text


def test_rest_with_curl(demo: Pool) -> None:
    inputs = demo_inputs(2, DEMO_ROWS, seed=5)
    expected = tf.make_ndarray(grpc_predict(demo, inputs).outputs["score"])
    body = json.dumps({"inputs": {name: array.tolist() for name, array in inputs.items()}})
    code, answer = curl(demo, "demo:predict", body)
    assert code == 200, answer
    np.testing.assert_array_equal(np.array(answer["outputs"], dtype=np.float32), expected)
    code, answer = curl(demo, "demo")
    assert (code, answer) == (
        200,
        {
            "model_version_status": [
                {
                    "version": "1",
                    "state": "AVAILABLE",
                    "status": {"error_code": "OK", "error_message": ""},
                }
            ]
        },
    )
    code, answer = curl(demo, "demo:predict", "{not json")
    assert code == 400 and answer["error"].startswith("JSON Parse error: "), answer

    # Gzipped, as TF Serving's HTTP server takes a body whose Content-Encoding names gzip
    # (`curl --data-binary @body.json.gz`); one that is not gzip says so.
    url = f"{demo.rest_url}/v1/models/demo:predict"
    for encoding, data, want in [
        ("gzip", gzip.compress(body.encode()), 200),
        ("x-gzip", gzip.compress(body.encode()), 200),
        ("gzip", body.encode(), 400),
    ]:
        out = subprocess.run(
            ["curl", "-sS", "-w", "\n%{http_code}", "-H", f"Content-Encoding: {encoding}",
             "--data-binary", "@-", url],
            input=data, capture_output=True, check=True, timeout=30,
        ).stdout.decode()  # fmt: skip
        text, code = out.rsplit("\n", 1)
        assert int(code) == want, text
        if want == 200:
            outputs = np.array(json.loads(text)["outputs"], dtype=np.float32)
            np.testing.assert_array_equal(outputs, expected)
        else:
            assert "Failed to uncompress the gzipped body" in json.loads(text)["error"], text


def test_a_client_that_shuts_its_sending_side_after_the_request_gets_its_answer(
    demo: Pool,
) -> None:
    """`printf ... | nc -N`, socat and scripts send their request, shut their side and read:
    the answer comes, as from TF Serving's HTTP server (it closed the connection unanswered)."""
    body = json.dumps({"inputs": {k: v.tolist() for k, v in demo_inputs(1, DEMO_ROWS).items()}})
    host, port = demo.rest_url.removeprefix("http://").rsplit(":", 1)
    closing = "Connection: close\r\n"
    for version, extra in [("HTTP/1.0", ""), ("HTTP/1.1", closing), ("HTTP/1.1", "")]:
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                f"POST /v1/models/demo:predict {version}\r\nHost: x\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            conn.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        assert answer.startswith(f"{version} 200 OK".encode()) or answer.startswith(
            b"HTTP/1.1 200 OK"
        ), (version, extra, answer[:200])
        assert b'"outputs"' in answer


def test_nan_and_infinity_as_python_writes_them_and_what_rapidjson_ignores(
    demo: Pool, text: Pool
) -> None:
    """Python's json.dumps writes a float NaN as NaN and infinities as Infinity (allow_nan is
    its default); TF Serving's parser reads them as numbers, skips a byte-order mark and
    ignores text after the document. The answer's NaN and infinities come back as TF Serving
    writes them. Through a signature that halves its input: the demo model's relu makes a NaN
    0 on an AVX-512 host (oneDNN's kernels), so its score lost the NaN there."""
    x = np.array([np.nan, np.inf, -np.inf, 3.0], np.float32)
    expected = tf.make_ndarray(grpc_predict(text, {"x": x}, "halve").outputs["half"])
    np.testing.assert_array_equal(expected, [np.nan, np.inf, -np.inf, 1.5])
    body = json.dumps({"signature_name": "halve", "inputs": {"x": x.tolist()}})
    assert "NaN" in body and "-Infinity" in body
    for raw in (body.encode(), b"\xef\xbb\xbf" + body.encode() + b"\n{trailing"):
        answer = rest(text, "demo:predict", raw=raw)
        assert answer.status_code == 200, answer.text
        assert answer.text.replace(" ", "").replace("\n", "") == (
            '{"outputs":[NaN,Infinity,-Infinity,1.5]}'
        ), answer.text
        np.testing.assert_array_equal(np.array(answer.json()["outputs"], np.float32), expected)
    # An int64 input takes no NaN: TF Serving's type error, naming the token.
    inputs = demo_inputs(3, DEMO_ROWS, seed=6)
    ids = inputs["ids"].tolist()
    ids[0][0] = float("nan")
    answer = rest(demo, "demo:predict", {"inputs": {"ids": ids, "dense": inputs["dense"].tolist()}})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == (
        "JSON Value: NaN Type: Number is not of expected type: int64"
    ), answer.json()


def test_whole_numbers_for_a_float_input_are_rounded_as_tf_serving_rounds_them(
    demo: Pool,
) -> None:
    """TF Serving 2.5+ takes any JSON number for a float input, rounded to a float32 (its
    REST guide's example: 1435774380); JSON writers often drop the ".0" of whole floats."""
    inputs = demo_inputs(2, DEMO_ROWS, seed=8)
    dense = inputs["dense"].tolist()
    dense[0][:4] = [1435774380, 16777217, -3, 1e39]
    with np.errstate(over="ignore"):  # 1e39 becomes inf, as the cast in TF Serving makes it
        inputs["dense"] = np.array(dense, dtype=np.float32)  # what TF Serving feeds the model
    assert inputs["dense"][0, 3] == np.inf
    expected = tf.make_ndarray(grpc_predict(demo, inputs).outputs["score"])
    body = {"inputs": {"ids": inputs["ids"].tolist(), "dense": dense}}
    answer = rest(demo, "demo:predict", body)
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(np.array(answer.json()["outputs"], np.float32), expected)


CORS = {
    "access-control-allow-origin": "*",
    "access-control-allow-methods": "POST, GET",
    "access-control-allow-headers": "Content-Type",
}


def _cors(headers: Any) -> dict[str, str]:
    return {name: headers[name] for name in CORS if name in headers}


def test_cors_headers_with_tf_servings_flag_and_preflights_either_way(
    demo: Pool, text: Pool
) -> None:
    """As TF Serving's http_server.cc: a preflight under /v1/ is answered whether or not CORS
    is on (an empty 200 for an http(s) Origin, an empty 400 without one); with
    --rest_api_enable_cors_support every answer there carries the CORS headers, errors too."""
    for pool, headers in ((demo, {}), (text, CORS)):
        url = f"{pool.rest_url}/v1/models/demo"
        out = subprocess.run(
            ["curl", "-sS", "-i", "-X", "OPTIONS", "-H", "Origin: https://app.example.com",
             "-H", "Access-Control-Request-Method: POST", f"{url}:predict"],
            capture_output=True, check=True, timeout=30, text=True,
        ).stdout  # fmt: skip
        head, _, body = out.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 200"), out
        assert body == ""
        got = {
            name.lower(): value.strip()
            for name, _, value in (line.partition(":") for line in head.splitlines()[1:])
        }
        assert _cors(got) == headers
        no_origin = requests.options(f"{url}:predict", timeout=30)
        assert (no_origin.status_code, no_origin.content) == (400, b"")
        assert _cors(no_origin.headers) == headers
        status = requests.get(url, timeout=30)
        assert status.status_code == 200 and _cors(status.headers) == headers
        error = requests.post(f"{url}:predict", data="{not json", timeout=30)
        assert error.status_code == 400 and _cors(error.headers) == headers
    # Outside the REST API (TF Serving's metrics page, unknown paths) nothing changes.
    assert _cors(requests.get(f"{text.rest_url}/nothing", timeout=30).headers) == {}
    # Methods TF Serving's HTTP server (libevent) does not take: 501 on any path, the
    # metrics page's too (a 200 to CONNECT had the connection taken for a tunnel, closed).
    port = int(demo.rest_url.rsplit(":", 1)[1])
    for method in ("TRACE", "CONNECT", "PROPFIND", "FOO"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"{method} /monitoring/metrics HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            said = sock.recv(4096)
            assert said.startswith(b"HTTP/1.1 501"), (method, said)
            sock.sendall(b"GET /v1/models/demo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the connection serves on"


def test_the_cors_flag_reads_as_tf_servings_booleans() -> None:
    from mpspool import cli

    def parsed(*flags: str) -> bool:
        args = cli.build_parser().parse_args(["start", *flags, "--model-base-path", "/m"])
        return args.rest_api_enable_cors_support

    assert parsed() is False
    assert parsed("--rest_api_enable_cors_support") is True
    assert parsed("--rest_api_enable_cors_support=true") is True
    assert parsed("--rest-api-enable-cors-support=false") is False
    with pytest.raises(SystemExit):
        parsed("--rest_api_enable_cors_support=maybe")


def test_rest_strings_binary_and_several_outputs(text: Pool) -> None:
    raw = [b"\x00\x01\xfe\xff", b"plain"]
    rows = [
        {"words": "héllo", "raw": {"b64": base64.b64encode(raw[0]).decode()}, "k": 1},
        {"words": "x y", "raw": {"b64": base64.b64encode(raw[1]).decode()}, "k": 2},
    ]
    answer = rest(text, "demo:predict", {"instances": rows})
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    grpc_answer = grpc_predict(
        text,
        {
            "words": np.array(["héllo".encode(), b"x y"], dtype=object),
            "raw": np.array(raw, dtype=object),
            "k": np.array([1, 2], dtype=np.int32),
        },
    )
    for i, row in enumerate(predictions):
        # An output named *_bytes is written as base64, as TF Serving does.
        assert base64.b64decode(row["raw_bytes"]["b64"]) == raw[i]
        assert row["upper"] == grpc_answer.outputs["upper"].string_val[i].decode()
        assert row["length"] == tf.make_ndarray(grpc_answer.outputs["length"])[i]
        assert row["scores"] == tf.make_ndarray(grpc_answer.outputs["scores"])[i].tolist()
    assert predictions[0]["upper"] == "HéLLO"  # tf.strings.upper leaves non-ASCII alone
    columns = {"words": ["a"], "raw": [{"b64": "AA=="}], "k": [7]}
    answer = rest(text, "demo:predict", {"inputs": columns})
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"] == {
        "length": [8],
        "raw_bytes": [{"b64": "AA=="}],
        "scores": [[3.5, 14.0]],
        "upper": ["A"],
    }
    # Strings that are not UTF-8 are their bytes, as TF Serving's parser (which does not
    # check the encoding) takes them: Latin-1 text, and a byte Python's json.dumps wrote as
    # a lone surrogate (surrogateescape) is its three bytes there. The request was refused.
    body = b'{"inputs": {"words": ["a", "b"], "raw": ["caf\xe9", "x\\udc80"], "k": [0, 0]}}'
    answer = rest(text, "demo:predict", raw=body)
    assert answer.status_code == 200, answer.text
    outputs = answer.json()["outputs"]
    assert [base64.b64decode(b["b64"]) for b in outputs["raw_bytes"]] == [
        b"caf\xe9",
        b"x\xed\xb2\x80",
    ]
    assert outputs["length"] == [4, 4]
    # A member's name is not a string value: one that is not UTF-8 is still refused.
    answer = rest(text, "demo:predict", raw=b'{"inputs": {"w\xe9rds": ["a"]}}')
    assert answer.status_code == 400 and "JSON Parse error" in answer.json()["error"]


def test_rest_status_and_metadata_equal_grpcs(demo: Pool) -> None:
    answer = rest(demo, "demo/versions/1")
    assert answer.status_code == 200
    assert answer.json()["model_version_status"][0]["state"] == "AVAILABLE"
    answer = rest(demo, "demo/metadata")
    assert answer.status_code == 200, answer.text
    meta = answer.json()
    assert meta["model_spec"] == {"name": "demo", "signature_name": "", "version": "1"}
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["method_name"] == "tensorflow/serving/predict"
    assert signature["inputs"]["ids"]["dtype"] == "DT_INT64"
    assert signature["inputs"]["dense"]["dtype"] == "DT_FLOAT"
    assert signature["inputs"]["ids"]["tensor_shape"]["dim"][0]["size"] == "-1"
    assert signature["outputs"]["score"]["dtype"] == "DT_FLOAT"
    assert signature["inputs"]["ids"]["name"].startswith("serving_default_ids")


# -- REST: errors --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("nope:predict", {"inputs": []}, 404, "Servable not found for request: Latest(nope)"),
        (
            "demo/versions/9:predict",
            {"inputs": []},
            404,
            "Servable not found for request: Specific(demo, 9)",
        ),
        (
            "demo/labels/canary:predict",
            {"inputs": []},
            400,
            "Unrecognized servable version label: canary",
        ),
        (
            "demo:predict",
            {"signature_name": "other", "inputs": []},
            400,
            'Serving signature name: "other" not found in signature def',
        ),
        (
            "demo:predict",
            {"signature_name": 3, "inputs": []},
            400,
            "'signature_name' key must be a string value.",
        ),
        ("demo:predict", {"instance": []}, 400, "Missing 'inputs' or 'instances' key"),
        ("demo:predict", {"instances": []}, 400, "No values in 'instances' array"),
        (
            "demo:predict",
            {"instances": [[1, 2]]},
            400,
            "instances is a plain list, but expecting list of objects",
        ),
        (
            "demo:predict",
            {"inputs": {"ids": [[1, 2, 3]]}},
            400,
            "Missing named input: dense in 'inputs' object.",
        ),
        (
            "demo:predict",
            {"instances": [{"ids": [1.5], "dense": [1.0]}]},
            400,
            "JSON Value: 1.5 Type: Number is not of expected type: int64",
        ),
        (
            "demo:predict",
            {"inputs": {"ids": [[1, 2]], "dense": [[1.0] * DENSE_FEATURES]}},
            400,
            'input "ids": shape [1,2] is not compatible with the signature\'s shape [-1,',
        ),
        (
            "demo:predict",
            {"inputs": {"ids": [[1], [2, 3]], "dense": [[1.0]]}},
            400,
            "Encountered list at unexpected size: 2 at level: 1 expected size: 1",
        ),
        # The demo's predict signature has two inputs: not something Classify can run.
        ("demo:classify", {"examples": [{}]}, 400, "Expected one input Tensor."),
        ("demo:explain", {}, 400, "Malformed request: POST /v1/models/demo:explain"),
        # TF Serving matches the path with its query: a query string is no predict there.
        (
            "demo:predict?verbose=1",
            {},
            400,
            "Malformed request: POST /v1/models/demo:predict?verbose=1",
        ),
    ],
)
def test_rest_errors_are_tf_servings(
    demo: Pool, path: str, body: Any, status: int, message: str
) -> None:
    answer = rest(demo, path, body)
    assert answer.status_code == status, answer.text
    assert list(answer.json()) == ["error"]
    assert message in answer.json()["error"], answer.json()


def test_rest_status_errors(demo: Pool) -> None:
    answer = rest(demo, "nope")
    assert answer.status_code == 404
    assert answer.json() == {"error": "Could not find any versions of model nope"}
    answer = requests.get(f"{demo.rest_url}/v1/models", timeout=30)
    assert (answer.status_code, answer.json()) == (400, {"error": "Missing model name in request."})
    answer = requests.get(f"{demo.rest_url}/metrics", timeout=30)
    assert answer.status_code == 404
    # The query is part of the name TF Serving's pattern ([^/:]+) reads.
    answer = requests.get(f"{demo.rest_url}/v1/models/demo?x=1", timeout=30)
    assert answer.json() == {"error": "Could not find any versions of model demo?x=1"}
    answer = requests.get(f"{demo.rest_url}/v1/models/demo/versions/1?x=1", timeout=30)
    assert answer.json() == {"error": "Malformed request: GET /v1/models/demo/versions/1?x=1"}


def test_a_worker_error_and_huge_bodies_lose_nothing(demo: Pool) -> None:
    inputs = demo_inputs(1, DEMO_ROWS, seed=6)
    columns = {name: array.tolist() for name, array in inputs.items()}
    # An id past the table: TensorFlow's own error, from the worker, as a 400.
    bad = {"inputs": {"ids": [[DEMO_ROWS + 5] * len(columns["ids"][0])], "dense": columns["dense"]}}
    answer = rest(demo, "demo:predict", bad)
    assert answer.status_code == 400 and "indices" in answer.json()["error"], answer.text
    # Over the message limit: refused before it is read, as JSON.
    answer = rest(demo, "demo:predict", raw=b" " * (MAX_MESSAGE + 1))
    assert answer.status_code == 413, answer.text
    assert "larger than the limit" in answer.json()["error"]
    # The same limit holds for gRPC (tonic says OUT_OF_RANGE where gRPC C++ says
    # RESOURCE_EXHAUSTED).
    with pytest.raises(grpc.RpcError) as info:
        grpc_predict(demo, {"ids": inputs["ids"], "dense": np.zeros((4000, 64), np.float32)})
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"the limit is: {MAX_MESSAGE} bytes" in info.value.details()
    answer = rest(demo, "demo:predict", {"inputs": columns})
    assert answer.status_code == 200, answer.text
    assert demo.status()["slots"][0]["restarts"] == 0


def test_json_bodies_parsed_at_once_share_one_memory_budget(demo: Pool) -> None:
    """Each body's document (124,000 tiny objects: ~85 MiB, serde_json's ~90 times the
    body) fits the parse budget of 256 MiB; ten at once would take ~850 MiB (the peak grew
    696 MiB when each body was held to the budget alone). The front door parses them in turns
    within the budget (280 MiB) and answers each one (its objects are not the model's inputs:
    400), none refused for memory."""
    router = demo.status()["pool"]["router_pid"]
    # The peak so far is another test's: start it afresh from what the front door holds now.
    Path(f"/proc/{router}/clear_refs").write_text("5")
    before = memory_mib(router, "VmHWM")
    body = b'{"instances":[' + b'{"a":1},' * 124_000 + b'{"a":1}]}'
    assert 256 * 1024 < len(body) <= MAX_MESSAGE

    def post(_: int) -> requests.Response:
        return requests.post(f"{demo.rest_url}/v1/models/demo:predict", data=body, timeout=120)

    with ThreadPoolExecutor(10) as clients:
        answers = list(clients.map(post, range(10)))
    for answer in answers:
        assert answer.status_code == 400, answer.text[:300]
        assert "does not have named input: a" in answer.json()["error"], answer.text
    grown = memory_mib(router, "VmHWM") - before
    assert grown < 400, f"the front door's peak grew {grown:.0f} MiB"
    assert demo.status()["pool"]["router_pid"] == router


# -- metrics -------------------------------------------------------------------------------
def test_tf_servings_metrics_and_the_queue_compute_split(demo: Pool) -> None:
    inputs = demo_inputs(2, DEMO_ROWS, seed=7)
    columns = {name: array.tolist() for name, array in inputs.items()}
    for _ in range(3):
        grpc_predict(demo, inputs)
        assert rest(demo, "demo:predict", {"inputs": columns}).status_code == 200
    assert rest(demo, "demo:predict", {"inputs": {}}).status_code == 400
    page = requests.get(f"{demo.rest_url}/monitoring/prometheus/metrics", timeout=30)
    assert page.status_code == 200
    assert page.headers["Content-Type"].startswith("text/plain")
    # TF Serving finds the page by its path, then refuses a query (ProcessPrometheusRequest).
    queried = requests.get(f"{demo.rest_url}/monitoring/prometheus/metrics?a=1", timeout=30)
    assert (queried.status_code, queried.text) == (
        400,
        "Unexpected path: /monitoring/prometheus/metrics?a=1. "
        "Should be /monitoring/prometheus/metrics",
    )
    tfs = prometheus_samples(page.text)
    assert tfs[':tensorflow:serving:request_count{model_name="demo",status="OK"}'] >= 6
    assert (
        tfs[':tensorflow:serving:request_count{model_name="demo",status="INVALID_ARGUMENT"}'] >= 1
    )
    for api, entrypoint in (("Predict", "GRPC"), ("predict", "REST")):
        labels = f'model_name="demo",API="{api}",entrypoint="{entrypoint}"'
        assert tfs[f":tensorflow:serving:request_latency_count{{{labels}}}"] >= 3
        assert tfs[f':tensorflow:serving:request_latency_bucket{{{labels},le="+Inf"}}'] >= 3
    runtime = 'model_name="demo",API="Predict",runtime="TF1"'
    assert tfs[f":tensorflow:serving:runtime_latency_count{{{runtime}}}"] >= 6
    # The split, on mpspool's own page: every answered worker call has a wait in the front
    # door, a hand-over and a compute part, and together they fit inside the requests'
    # end-to-end time.
    ours = prometheus_samples(requests.get(demo.status()["pool"]["metrics"], timeout=30).text)
    waited = ours['mpspool_request_front_door_queue_seconds_sum{model="demo"}']
    queue = ours['mpspool_request_queue_seconds_sum{model="demo"}']
    compute = ours['mpspool_request_compute_seconds_sum{model="demo"}']
    total = ours['mpspool_request_duration_seconds_sum{method="Predict",model="demo"}']
    calls = ours['mpspool_request_compute_seconds_count{model="demo"}']
    assert calls == ours['mpspool_request_queue_seconds_count{model="demo"}'] >= 6
    assert ours['mpspool_request_front_door_queue_seconds_count{model="demo"}'] >= calls
    assert ours['mpspool_request_reply_seconds_count{model="demo"}'] == calls
    assert 0 < compute and 0 < queue and 0 <= waited and waited + queue + compute <= total
    # Microseconds of the model call, as TF Serving's runtime_latency counts them.
    assert tfs[f":tensorflow:serving:runtime_latency_sum{{{runtime}}}"] == pytest.approx(
        compute * 1e6, rel=0.01
    )
    # TensorFlow's graph runs, which TF Serving's page carries (the Grafana mixin's "Graph
    # Runs" and "Graph Run Time" panels): one per worker call here, no request merged.
    assert tfs[":tensorflow:core:graph_runs{}"] == calls
    assert tfs[":tensorflow:core:graph_run_time_usecs{}"] == pytest.approx(compute * 1e6, rel=0.01)


def test_monitoring_config_files_are_read_as_tf_serving_reads_them(tmp_path: Path) -> None:
    config = tmp_path / "m.config"
    config.write_text("prometheus_config { enable: true }")
    assert prometheus_path_from(config) == "/monitoring/prometheus/metrics"
    config.write_text('prometheus_config { enable: false, path: "/m" }')
    assert prometheus_path_from(config) == ""
    config.write_text("prometheus_config { enabled: true }")
    with pytest.raises(ConfigError, match="is not a MonitoringConfig"):
        prometheus_path_from(config)
