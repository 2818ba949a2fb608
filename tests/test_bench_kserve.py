"""bench/protos/kserve.proto and the harness's KServe v2 path (the PyTriton peer's protocol).

The harness speaks Triton's KServe v2 gRPC API through its own copy of the messages
(bench/protos): the checked-in ``kserve_pb2.py`` is what protoc makes of the ``.proto``, a
request built by ``kserve_request`` carries the demo inputs intact (the same as the TF Serving
request's), and the Python client reads ModelInfer answers from a real gRPC server.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import harness  # noqa: E402
from bench.protos import kserve_pb2  # noqa: E402
from mpspool.demo_model import demo_inputs  # noqa: E402

PROTO = "bench/protos/kserve.proto"
GENERATED = "bench/protos/kserve_pb2.py"
NUMPY_OF = {"INT64": np.int64, "FP32": np.float32}


def test_checked_in_kserve_code_is_what_protoc_generates(tmp_path):
    command = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO}", f"--python_out={tmp_path}", PROTO,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (REPO / GENERATED).read_text() == (tmp_path / GENERATED).read_text(), (
        f"{GENERATED} is stale: regenerate it from the repository root with\n"
        f"  python -m grpc_tools.protoc -I. --python_out=. {PROTO}"
    )


def test_messages_carry_tritons_names():
    # The method path names the service; the messages keep Triton's package and names.
    assert kserve_pb2.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
    assert harness.KSERVE_INFER_PATH == "/inference.GRPCInferenceService/ModelInfer"
    fields = {f.name: f.number for f in kserve_pb2.ModelInferRequest.DESCRIPTOR.fields}
    assert fields["inputs"] == 5 and fields["raw_input_contents"] == 7
    fields = {f.name: f.number for f in kserve_pb2.ModelInferResponse.DESCRIPTOR.fields}
    assert fields["outputs"] == 5 and fields["raw_output_contents"] == 6


def _decode(request: kserve_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    assert len(request.raw_input_contents) == len(request.inputs)
    return {
        tensor.name: np.frombuffer(
            raw, dtype=np.dtype(NUMPY_OF[tensor.datatype]).newbyteorder("<")
        ).reshape(tuple(tensor.shape))
        for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True)
    }


@pytest.mark.parametrize("batch", [1, 3])
def test_kserve_request_carries_the_demo_inputs(batch):
    import tensorflow as tf

    inputs = demo_inputs(batch, 500, seed=7)
    built = harness.kserve_request("k", "ranker", inputs)
    assert built.path == harness.KSERVE_INFER_PATH and built.batch == batch
    assert built.body[:5] == b"\x00" + (len(built.body) - 5).to_bytes(4, "big")
    request = kserve_pb2.ModelInferRequest.FromString(built.body[5:])
    assert request.model_name == "ranker"
    assert request.model_version == "" and not request.outputs  # latest, every output
    assert [(t.name, t.datatype) for t in request.inputs] == [("ids", "INT64"), ("dense", "FP32")]
    assert all(not t.HasField("contents") for t in request.inputs)  # raw bytes only
    decoded = _decode(request)
    # The same inputs as the TF Serving request: both servers do one job.
    from tensorflow_serving.apis import predict_pb2

    predict = predict_pb2.PredictRequest.FromString(
        harness.predict_request("p", "ranker", inputs).body[5:]
    )
    for name, values in inputs.items():
        np.testing.assert_array_equal(decoded[name], values)
        np.testing.assert_array_equal(tf.make_ndarray(predict.inputs[name]), values)


# -- against a real gRPC server answering ModelInfer ----------------------------------


def _model_infer(request: kserve_pb2.ModelInferRequest, context) -> kserve_pb2.ModelInferResponse:
    inputs = _decode(request)
    rows = inputs["ids"].shape[0]
    if inputs["dense"].shape != (rows, 13) or inputs["ids"].shape != (rows, 16):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad shapes {inputs}")
    score = (inputs["dense"].sum(axis=1, keepdims=True) > 0).astype("<f4")
    response = kserve_pb2.ModelInferResponse(model_name=request.model_name, model_version="1")
    response.outputs.add(name="score", datatype="FP32", shape=score.shape)
    response.raw_output_contents.append(score.tobytes())
    return response


def test_the_python_client_reads_kserve_answers():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(
        _model_infer,
        request_deserializer=kserve_pb2.ModelInferRequest.FromString,
        response_serializer=kserve_pb2.ModelInferResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService", {"ModelInfer": handler}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        peer = harness.Server("fake", port, {}, protocol="kserve")
        request = harness.kserve_request("k4", "demo", demo_inputs(4, 100, seed=1))
        size = harness.Checker().check(peer, request)
        assert size == len(harness.call(peer.target, request)) + 5
        # The answer is read, not just received: a wrong row count or output fails.
        with pytest.raises(RuntimeError, match=r"shape \(4, 1\) to a batch of 5"):
            harness.Checker().check(peer, harness.Request(**{**request.__dict__, "batch": 5}))
        with pytest.raises(RuntimeError, match="without output 'probability'"):
            harness.Checker().check(
                peer, harness.Request(**{**request.__dict__, "output": "probability"})
            )
        # This server has no TF Serving Predict.
        with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
            harness.call(peer.target, harness.predict_request("p", "demo", demo_inputs(1, 100)))
    finally:
        server.stop(None)
