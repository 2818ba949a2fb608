"""bench/protos/kserve.proto and the load generator's KServe v2 path.

The load generator speaks Triton's KServe v2 gRPC API through its own copy of the messages
(bench/protos). These tests hold it to what the TF Serving copies are held to: the checked-in
``kserve_pb2.py`` is what protoc makes of the ``.proto``, a request built by
``kserve_requests`` carries the demo inputs intact, and the KServe path of check_target and
closed_loop works against a real gRPC server answering ModelInfer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import loadgen  # noqa: E402
from bench.protos import kserve_pb2  # noqa: E402
from bench.tensors import tensor_to_array  # noqa: E402
from mpspool.demo_model import demo_inputs  # noqa: E402
from mpspool.protos import serving_pb2  # noqa: E402

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
    assert loadgen.KSERVE_INFER_METHOD == "/inference.GRPCInferenceService/ModelInfer"
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
def test_loadgen_kserve_request_round_trips(batch):
    payloads = loadgen.kserve_requests(batch, rows=500, count=3, model_name="ranker", seed=7)
    assert len(set(payloads)) == 3  # distinct requests
    predicts = loadgen.demo_requests(batch, rows=500, count=3, model_name="ranker", seed=7)
    for i, payload in enumerate(payloads):
        request = kserve_pb2.ModelInferRequest.FromString(payload)
        assert request.SerializeToString() == payload
        assert request.model_name == "ranker"
        assert request.model_version == "" and not request.outputs  # latest, every output
        assert [(t.name, t.datatype) for t in request.inputs] == [
            ("ids", "INT64"),
            ("dense", "FP32"),
        ]
        assert all(not t.HasField("contents") for t in request.inputs)  # raw bytes only
        decoded = _decode(request)
        expected = demo_inputs(batch, 500, seed=7 + i)
        assert set(decoded) == set(expected)
        for name, values in expected.items():
            assert decoded[name].shape == values.shape
            np.testing.assert_array_equal(decoded[name], values)
        # The same inputs as the TF Serving request at the same index: both servers do one job.
        predict = serving_pb2.PredictRequest.FromString(predicts[i])
        for name in expected:
            np.testing.assert_array_equal(
                tensor_to_array(predict.inputs[name], name), decoded[name]
            )


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


async def _serve_kserve() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
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
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_loadgen_kserve_check_target_and_closed_loop():
    async def scenario() -> dict:
        server, target = await _serve_kserve()
        try:
            payloads = loadgen.kserve_requests(4, rows=100, count=2)
            await loadgen.check_target(target, payloads[0], 4, protocol="kserve")
            # The answer is read, not just received: a wrong row count fails the check.
            with pytest.raises(RuntimeError, match=r"shape \(4, 1\), expected 5 rows"):
                await loadgen.check_target(target, payloads[0], 5, protocol="kserve")
            with pytest.raises(RuntimeError, match="without output 'probability'"):
                await loadgen.check_target(
                    target, payloads[0], 4, output="probability", protocol="kserve"
                )
            # The protocol picks the method: this server has no TF Serving Predict.
            with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
                await loadgen.check_target(target, payloads[0], 4, timeout_s=5)
            return await loadgen.closed_loop(
                target, payloads, 4, concurrency=2, duration_s=0.3, warmup_s=0.1, protocol="kserve"
            )
        finally:
            await server.stop(None)

    result = asyncio.run(scenario())
    assert result["ok"] > 0 and result["error_count"] == 0, result
    assert result["protocol"] == "kserve"
    assert result["rows_per_s"] == pytest.approx(result["throughput_rps"] * 4)


def test_loadgen_rejects_an_unknown_protocol():
    with pytest.raises(ValueError, match="protocol must be one of"):
        asyncio.run(loadgen.check_target("127.0.0.1:1", b"", 1, protocol="openai"))
    with pytest.raises(ValueError, match="protocol must be one of"):
        asyncio.run(
            loadgen.closed_loop("127.0.0.1:1", [b""], 1, 1, duration_s=0.1, protocol="openai")
        )


def test_loadgen_cli_takes_protocol():
    args = loadgen.build_parser().parse_args(["--protocol", "kserve"])
    assert args.protocol == "kserve"
    assert loadgen.build_parser().parse_args([]).protocol == "tfserving"
