"""mpspool/protos: generated code is current, and the messages are TF Serving's on the wire.

The router never imports TensorFlow, so it speaks TF Serving's API through its own copies of
the messages (package ``mpspool.tfs``). These tests hold the copies to two promises: the
checked-in ``*_pb2`` modules are exactly what protoc makes of the ``.proto`` files, and bytes
written by either side parse on the other into the same fields.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import any_pb2, descriptor_pool, unknown_fields
from google.protobuf.descriptor import FieldDescriptor

# Registers the official messages mpspool copies for the checkpoint reader in the default pool.
from tensorflow.core.protobuf import saved_model_pb2, tensor_bundle_pb2  # noqa: F401
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_pb2,
    predict_pb2,
)

from mpspool import dtypes
from mpspool.protos import serving_pb2, tensorflow_pb2

REPO = Path(__file__).resolve().parents[1]
PROTOS = [
    "mpspool/protos/tensorflow.proto",
    "mpspool/protos/serving.proto",
    "mpspool/protos/server_config.proto",
]
GENERATED = [
    f"mpspool/protos/{stem}{suffix}"
    for stem in ("tensorflow_pb2", "serving_pb2", "server_config_pb2")
    for suffix in (".py", ".pyi")
]
SIGNATURE_DEF_MAP_URL = "type.googleapis.com/tensorflow.serving.SignatureDefMap"


def _no_unknown_fields(message) -> None:
    """Every field the other side wrote is one this side declares (recursively)."""
    assert len(unknown_fields.UnknownFieldSet(message)) == 0, type(message).__name__
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for item in value.values():
                    _no_unknown_fields(item)
        elif field.is_repeated:
            for item in value:
                _no_unknown_fields(item)
        else:
            _no_unknown_fields(value)


# ---------------------------------------------------------------------------------------
# generated code is current
# ---------------------------------------------------------------------------------------


def test_checked_in_code_is_what_protoc_generates(tmp_path):
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{REPO}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        *PROTOS,
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for path in GENERATED:
        fresh = (tmp_path / path).read_text()
        checked_in = (REPO / path).read_text()
        assert checked_in == fresh, (
            f"{path} is stale: regenerate it from the repository root with\n"
            "  python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. " + " ".join(PROTOS)
        )


def test_package_keeps_tensorflow_names_free():
    # mpspool.tfs, not tensorflow / tensorflow.serving: both sets load into one process.
    assert tensorflow_pb2.TensorProto.DESCRIPTOR.full_name == "mpspool.tfs.TensorProto"
    assert serving_pb2.PredictRequest.DESCRIPTOR.full_name == "mpspool.tfs.PredictRequest"
    assert predict_pb2.PredictRequest.DESCRIPTOR.full_name == "tensorflow.serving.PredictRequest"


# ---------------------------------------------------------------------------------------
# official client → ours
# ---------------------------------------------------------------------------------------

INPUTS = {
    "dense": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "ids": np.array([[1, -2], [3, 2**40]], dtype=np.int64),
    "query": np.array([b"red shoes", b"\xe4\xb8\xad"], dtype=object),
    "scale": np.array(0.5, dtype=np.float64),
    "mask": np.array([True, False, True]),
    "half": np.array([1.0, -2.5], dtype=np.float16),
}


def _official_request(**spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "ranker"
    request.model_spec.signature_name = "serving_default"
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    request.output_filter.extend(["scores", "labels"])
    for name, array in INPUTS.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return request


def test_official_predict_request_parses_into_ours():
    theirs = _official_request(version=42)
    ours = serving_pb2.PredictRequest.FromString(theirs.SerializeToString())
    _no_unknown_fields(ours)

    assert ours.model_spec.name == "ranker"
    assert ours.model_spec.WhichOneof("version_choice") == "version"
    assert ours.model_spec.version.value == 42
    assert ours.model_spec.signature_name == "serving_default"
    assert list(ours.output_filter) == ["scores", "labels"]
    assert set(ours.inputs) == set(INPUTS)
    for name, array in INPUTS.items():
        tensor = ours.inputs[name]
        # Field by field: the same bytes re-serialize from either definition.
        assert tensor.SerializeToString() == theirs.inputs[name].SerializeToString()
        assert tensor.dtype == dtypes.dt_of_array(array)
        assert [d.size for d in tensor.tensor_shape.dim] == list(array.shape)
        decoded = tf.make_ndarray(theirs.inputs[name])
        assert decoded.dtype == (np.dtype(object) if array.dtype == object else array.dtype)
        assert decoded.tolist() == array.tolist()
    # The re-serialized request parses back into the official one unchanged.
    assert predict_pb2.PredictRequest.FromString(ours.SerializeToString()) == theirs


def test_official_version_label_parses_into_ours():
    theirs = _official_request(version_label="canary")
    ours = serving_pb2.PredictRequest.FromString(theirs.SerializeToString())
    assert ours.model_spec.WhichOneof("version_choice") == "version_label"
    assert ours.model_spec.version_label == "canary"
    assert not ours.model_spec.HasField("version")


def test_no_version_is_latest_in_both():
    theirs = predict_pb2.PredictRequest()
    theirs.model_spec.name = "ranker"
    ours = serving_pb2.PredictRequest.FromString(theirs.SerializeToString())
    assert ours.model_spec.WhichOneof("version_choice") is None
    assert ours.model_spec.signature_name == ""


def test_version_zero_is_still_a_version():
    # Int64Value wraps the number so that version 0 differs from "no version".
    theirs = predict_pb2.PredictRequest()
    theirs.model_spec.version.value = 0
    ours = serving_pb2.PredictRequest.FromString(theirs.SerializeToString())
    assert ours.model_spec.HasField("version")
    assert ours.model_spec.version.value == 0


# ---------------------------------------------------------------------------------------
# ours → official client
# ---------------------------------------------------------------------------------------


def test_our_predict_response_parses_into_theirs():
    ours = serving_pb2.PredictResponse()
    ours.model_spec.name = "ranker"
    ours.model_spec.version.value = 3
    ours.model_spec.signature_name = "serving_default"
    scores = np.array([[0.25, 0.75]], dtype=np.float32)
    ours.outputs["scores"].dtype = dtypes.DT_FLOAT
    ours.outputs["scores"].tensor_shape.dim.add(size=1)
    ours.outputs["scores"].tensor_shape.dim.add(size=2)
    ours.outputs["scores"].tensor_content = scores.tobytes()
    ours.outputs["labels"].dtype = dtypes.DT_STRING
    ours.outputs["labels"].tensor_shape.dim.add(size=1)
    ours.outputs["labels"].string_val.append(b"click")

    theirs = predict_pb2.PredictResponse.FromString(ours.SerializeToString())
    _no_unknown_fields(theirs)
    assert theirs.model_spec.name == "ranker"
    assert theirs.model_spec.version.value == 3
    assert theirs.model_spec.signature_name == "serving_default"
    np.testing.assert_array_equal(tf.make_ndarray(theirs.outputs["scores"]), scores)
    assert tf.make_ndarray(theirs.outputs["labels"]).tolist() == [b"click"]


def test_our_model_status_response_parses_into_theirs():
    ours = serving_pb2.GetModelStatusResponse()
    available = ours.model_version_status.add(
        version=2, state=serving_pb2.ModelVersionStatus.AVAILABLE
    )
    available.status.error_code = 0
    failed = ours.model_version_status.add(version=1, state=serving_pb2.ModelVersionStatus.END)
    failed.status.error_code = 9  # FAILED_PRECONDITION
    failed.status.error_message = "version 1 was retired"
    loading = ours.model_version_status.add(version=3, state=serving_pb2.ModelVersionStatus.LOADING)

    theirs = get_model_status_pb2.GetModelStatusResponse.FromString(ours.SerializeToString())
    _no_unknown_fields(theirs)
    official = get_model_status_pb2.ModelVersionStatus
    assert [(s.version, s.state) for s in theirs.model_version_status] == [
        (2, official.AVAILABLE),
        (1, official.END),
        (3, official.LOADING),
    ]
    assert theirs.model_version_status[1].status.error_code == 9
    assert theirs.model_version_status[1].status.error_message == "version 1 was retired"
    assert not theirs.model_version_status[2].HasField("status")
    assert not loading.HasField("status")
    # Every state number means the same on both sides.
    for state in serving_pb2.ModelVersionStatus.State.keys():
        assert serving_pb2.ModelVersionStatus.State.Value(state) == official.State.Value(state)


def _our_signature_def_map() -> serving_pb2.SignatureDefMap:
    sdm = serving_pb2.SignatureDefMap()
    sig = sdm.signature_def["serving_default"]
    sig.method_name = "tensorflow/serving/predict"
    dense = sig.inputs["dense"]
    dense.name = "serving_default_dense:0"
    dense.dtype = dtypes.DT_FLOAT
    dense.tensor_shape.dim.add(size=-1)
    dense.tensor_shape.dim.add(size=4)
    query = sig.inputs["query"]
    query.name = "serving_default_query:0"
    query.dtype = dtypes.DT_STRING
    query.tensor_shape.unknown_rank = True
    scores = sig.outputs["scores"]
    scores.name = "StatefulPartitionedCall:0"
    scores.dtype = dtypes.DT_FLOAT
    scores.tensor_shape.dim.add(size=-1)
    sdm.signature_def["__saved_model_init_op"].outputs["__saved_model_init_op"].name = "NoOp"
    return sdm


def test_our_model_metadata_response_parses_into_theirs():
    ours = serving_pb2.GetModelMetadataResponse()
    ours.model_spec.name = "ranker"
    ours.model_spec.version.value = 5
    packed = any_pb2.Any(
        type_url=SIGNATURE_DEF_MAP_URL, value=_our_signature_def_map().SerializeToString()
    )
    ours.metadata["signature_def"].CopyFrom(packed)

    theirs = get_model_metadata_pb2.GetModelMetadataResponse.FromString(ours.SerializeToString())
    assert theirs.model_spec.name == "ranker"
    assert theirs.model_spec.version.value == 5
    assert list(theirs.metadata) == ["signature_def"]
    sdm = get_model_metadata_pb2.SignatureDefMap()
    assert theirs.metadata["signature_def"].Is(sdm.DESCRIPTOR)
    assert theirs.metadata["signature_def"].Unpack(sdm)  # False if the type URL were ours
    _no_unknown_fields(sdm)

    assert set(sdm.signature_def) == {"serving_default", "__saved_model_init_op"}
    sig = sdm.signature_def["serving_default"]
    assert sig.method_name == "tensorflow/serving/predict"
    assert sig.inputs["dense"].name == "serving_default_dense:0"
    assert sig.inputs["dense"].dtype == tf.float32.as_datatype_enum
    assert [d.size for d in sig.inputs["dense"].tensor_shape.dim] == [-1, 4]
    assert sig.inputs["query"].dtype == tf.string.as_datatype_enum
    assert sig.inputs["query"].tensor_shape.unknown_rank
    assert sig.outputs["scores"].name == "StatefulPartitionedCall:0"
    assert [d.size for d in sig.outputs["scores"].tensor_shape.dim] == [-1]
    assert sdm.signature_def["__saved_model_init_op"].outputs["__saved_model_init_op"].name == (
        "NoOp"
    )


def test_our_type_url_would_not_unpack():
    # Guards the test above: Unpack checks the type URL, so packing our message under its
    # own name (mpspool.tfs.SignatureDefMap) would not reach TF Serving clients.
    packed = any_pb2.Any()
    packed.Pack(_our_signature_def_map())
    assert packed.type_url == "type.googleapis.com/mpspool.tfs.SignatureDefMap"
    assert not packed.Unpack(get_model_metadata_pb2.SignatureDefMap())


@pytest.mark.parametrize(
    "name",
    ["DT_FLOAT", "DT_DOUBLE", "DT_INT32", "DT_UINT8", "DT_INT16", "DT_INT8", "DT_STRING",
     "DT_COMPLEX64", "DT_INT64", "DT_BOOL", "DT_BFLOAT16", "DT_UINT16", "DT_COMPLEX128",
     "DT_HALF", "DT_RESOURCE", "DT_VARIANT", "DT_UINT32", "DT_UINT64"],
)  # fmt: skip
def test_datatype_numbers_match_tensorflow(name):
    from tensorflow.core.framework import types_pb2

    assert tensorflow_pb2.DataType.Value(name) == types_pb2.DataType.Value(name)
    if hasattr(dtypes, name):
        assert getattr(dtypes, name) == types_pb2.DataType.Value(name)


def test_model_spec_field_numbers_match():
    ours = {f.name: f.number for f in serving_pb2.ModelSpec.DESCRIPTOR.fields}
    theirs = {f.name: f.number for f in model_pb2.ModelSpec.DESCRIPTOR.fields}
    assert ours == theirs


def _official_name(ours) -> str:
    package = "tensorflow" if ours.file.name.endswith("tensorflow.proto") else "tensorflow.serving"
    return ours.full_name.replace("mpspool.tfs", package, 1)


def _our_messages():
    for module in (tensorflow_pb2, serving_pb2):
        pending = list(module.DESCRIPTOR.message_types_by_name.values())
        while pending:
            message = pending.pop()
            if not message.GetOptions().map_entry:
                yield pytest.param(message, id=message.full_name)
            pending.extend(message.nested_types)


# int32 and enum fields share the varint wire type (StatusProto.error_code is an enum there).
_WIRE_CLASS = {FieldDescriptor.TYPE_ENUM: FieldDescriptor.TYPE_INT32}


@pytest.mark.parametrize("ours", list(_our_messages()))
def test_every_field_matches_the_official_message(ours):
    theirs = descriptor_pool.Default().FindMessageTypeByName(_official_name(ours))
    for field in ours.fields:
        official = theirs.fields_by_number.get(field.number)
        assert official is not None, f"{ours.full_name}.{field.name}: no field {field.number}"
        assert official.name == field.name
        assert _WIRE_CLASS.get(field.type, field.type) == _WIRE_CLASS.get(
            official.type, official.type
        ), field.name
        assert field.is_repeated == official.is_repeated, field.name
        if (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not field.message_type.full_name.startswith("google.protobuf")
        ):
            assert _official_name(field.message_type) == official.message_type.full_name
        if field.is_repeated and field.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
            # packed-ness changes the bytes written (parsers accept both, but keep it equal)
            assert field.is_packed == official.is_packed, field.name


def test_tf_servings_monitoring_config_text_reads_into_ours():
    # The example of TF Serving's monitoring documentation, and the fields as
    # tensorflow_serving/config/monitoring_config.proto numbers them.
    from google.protobuf import text_format

    from mpspool.protos import server_config_pb2

    text = 'prometheus_config {\n  enable: true,\n  path: "/monitoring/prometheus/metrics"\n}\n'
    config = text_format.Parse(text, server_config_pb2.MonitoringConfig())
    assert config.prometheus_config.enable
    assert config.prometheus_config.path == "/monitoring/prometheus/metrics"
    fields = {f.name: f.number for f in server_config_pb2.PrometheusConfig.DESCRIPTOR.fields}
    assert fields == {"enable": 1, "path": 2}
