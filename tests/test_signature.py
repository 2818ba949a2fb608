"""mpspool/signature.py: specs from a SignatureDefMap, and the checks a request must pass."""

from __future__ import annotations

import pytest

from mpspool import dtypes
from mpspool.errors import Code, ServingError
from mpspool.protos import serving_pb2, tensorflow_pb2
from mpspool.signature import (
    DEFAULT_SIGNATURE,
    PREDICT_METHOD,
    SignatureSpec,
    TensorSpec,
    check_inputs,
    check_output_filter,
    select_signature,
    shape_fits,
    specs_from_signature_defs,
)

UNKNOWN_RANK = None


def _info(name: str, dt: int, shape) -> tensorflow_pb2.TensorInfo:
    info = tensorflow_pb2.TensorInfo(name=name, dtype=dt)
    if shape is UNKNOWN_RANK:
        info.tensor_shape.unknown_rank = True
    else:
        for d in shape:
            info.tensor_shape.dim.add(size=d)
    return info


def _signature(inputs, outputs, method=PREDICT_METHOD) -> tensorflow_pb2.SignatureDef:
    sig = tensorflow_pb2.SignatureDef(method_name=method)
    for alias, (dt, shape) in inputs.items():
        sig.inputs[alias].CopyFrom(_info(f"{alias}:0", dt, shape))
    for alias, (dt, shape) in outputs.items():
        sig.outputs[alias].CopyFrom(_info(f"{alias}:0", dt, shape))
    return sig


def _signature_def_map() -> serving_pb2.SignatureDefMap:
    sdm = serving_pb2.SignatureDefMap()
    sdm.signature_def[DEFAULT_SIGNATURE].CopyFrom(
        _signature(
            inputs={
                "dense": (dtypes.DT_FLOAT, [-1, 3]),
                "ids": (dtypes.DT_INT64, [-1]),
                "query": (dtypes.DT_STRING, UNKNOWN_RANK),
            },
            outputs={
                "scores": (dtypes.DT_FLOAT, [-1, 2]),
                "labels": (dtypes.DT_STRING, [-1]),
            },
        )
    )
    sdm.signature_def["fixed"].CopyFrom(
        _signature(
            inputs={"image": (dtypes.DT_UINT8, [2, 28, 28])},
            outputs={"logits": (dtypes.DT_HALF, [2, 10])},
            method="tensorflow/serving/classify",
        )
    )
    # What SavedModels carry besides their serving signatures: outputs only, no inputs.
    sdm.signature_def["__saved_model_init_op"].CopyFrom(
        _signature(inputs={}, outputs={"__saved_model_init_op": (dtypes.DT_INVALID, [])})
    )
    return sdm


@pytest.fixture(scope="module")
def specs() -> dict[str, SignatureSpec]:
    # Through the wire first, as the router receives it from a worker's READY message.
    data = _signature_def_map().SerializeToString()
    return specs_from_signature_defs(serving_pb2.SignatureDefMap.FromString(data).signature_def)


@pytest.fixture
def default(specs) -> SignatureSpec:
    return specs[DEFAULT_SIGNATURE]


# ---------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------


def test_specs_from_signature_defs(specs):
    assert set(specs) == {DEFAULT_SIGNATURE, "fixed"}  # the init op's entry is left out
    default = specs[DEFAULT_SIGNATURE]
    assert default.key == DEFAULT_SIGNATURE
    assert default.method_name == PREDICT_METHOD
    assert dict(default.inputs) == {
        "dense": TensorSpec(dtypes.DT_FLOAT, (-1, 3)),
        "ids": TensorSpec(dtypes.DT_INT64, (-1,)),
        "query": TensorSpec(dtypes.DT_STRING, None),
    }
    assert dict(default.outputs) == {
        "scores": TensorSpec(dtypes.DT_FLOAT, (-1, 2)),
        "labels": TensorSpec(dtypes.DT_STRING, (-1,)),
    }
    fixed = specs["fixed"]
    assert fixed.method_name == "tensorflow/serving/classify"
    assert dict(fixed.inputs) == {"image": TensorSpec(dtypes.DT_UINT8, (2, 28, 28))}
    assert dict(fixed.outputs) == {"logits": TensorSpec(dtypes.DT_HALF, (2, 10))}


def test_scalar_spec_is_not_unknown_rank():
    sig = _signature(inputs={"x": (dtypes.DT_FLOAT, [])}, outputs={"y": (dtypes.DT_FLOAT, [])})
    spec = specs_from_signature_defs({"s": sig})["s"]
    assert spec.inputs["x"].shape == ()
    assert spec.inputs["x"].shape_text() == "[]"


def test_shape_text():
    assert TensorSpec(dtypes.DT_FLOAT, (-1, 3)).shape_text() == "[-1,3]"
    assert TensorSpec(dtypes.DT_FLOAT, None).shape_text() == "<unknown>"


# ---------------------------------------------------------------------------------------
# select_signature
# ---------------------------------------------------------------------------------------


def test_select_signature(specs):
    assert select_signature(specs, "").key == DEFAULT_SIGNATURE  # empty means the default
    assert select_signature(specs, DEFAULT_SIGNATURE).key == DEFAULT_SIGNATURE
    assert select_signature(specs, "fixed").key == "fixed"


@pytest.mark.parametrize("name", ["x", "__saved_model_init_op", "Serving_Default"])
def test_unknown_signature_is_failed_precondition(specs, name):
    with pytest.raises(ServingError) as info:
        select_signature(specs, name)
    assert info.value.code == Code.FAILED_PRECONDITION
    assert info.value.message == f'Serving signature key "{name}" not found.'


def test_missing_default_signature_names_it(specs):
    with pytest.raises(ServingError) as info:
        select_signature({"fixed": specs["fixed"]}, "")
    assert info.value.code == Code.FAILED_PRECONDITION
    assert info.value.message == 'Serving signature key "serving_default" not found.'


# ---------------------------------------------------------------------------------------
# check_inputs
# ---------------------------------------------------------------------------------------

GOOD = {
    "dense": (dtypes.DT_FLOAT, [4, 3]),
    "ids": (dtypes.DT_INT64, [7]),
    "query": (dtypes.DT_STRING, []),
}


def _invalid(spec, given) -> str:
    with pytest.raises(ServingError) as info:
        check_inputs(spec, given)
    assert info.value.code == Code.INVALID_ARGUMENT
    return info.value.message


def test_matching_inputs_pass(default):
    assert check_inputs(default, GOOD) is None


def test_missing_input(default):
    given = {k: v for k, v in GOOD.items() if k != "ids"}
    assert _invalid(default, given) == (
        "input size does not match signature: 2!=3 len({dense,query}) != "
        "len({dense,ids,query}). Sent extra: {}. Missing but required: {ids}."
    )


def test_extra_input(default):
    given = {**GOOD, "bogus": (dtypes.DT_FLOAT, [1])}
    assert _invalid(default, given) == (
        "input size does not match signature: 4!=3 len({bogus,dense,ids,query}) != "
        "len({dense,ids,query}). Sent extra: {bogus}. Missing but required: {}."
    )


def test_extra_and_missing_with_the_same_count(default):
    # Same number of inputs, wrong names: the count alone must not let it through.
    given = {**{k: v for k, v in GOOD.items() if k != "dense"}, "Dense": GOOD["dense"]}
    assert _invalid(default, given) == (
        "input size does not match signature: 3!=3 len({Dense,ids,query}) != "
        "len({dense,ids,query}). Sent extra: {Dense}. Missing but required: {dense}."
    )


def test_no_inputs_at_all(default):
    message = _invalid(default, {})
    assert message.startswith("input size does not match signature: 0!=3 len({}) ")
    assert message.endswith("Missing but required: {dense,ids,query}.")


@pytest.mark.parametrize(
    ("alias", "dt", "want", "sent"),
    [
        ("dense", dtypes.DT_DOUBLE, "float", "double"),
        ("ids", dtypes.DT_INT32, "int64", "int32"),
        ("query", dtypes.DT_FLOAT, "string", "float"),
    ],
)
def test_wrong_dtype(default, alias, dt, want, sent):
    given = {**GOOD, alias: (dt, GOOD[alias][1])}
    message = _invalid(default, given)
    assert message == f'input "{alias}": expects dtype {want} but {sent} is provided'


@pytest.mark.parametrize(
    ("alias", "shape"),
    [
        ("dense", [4]),  # rank 1 for rank 2
        ("dense", [4, 3, 1]),  # rank 3 for rank 2
        ("dense", []),  # scalar for rank 2
        ("dense", [4, 2]),  # fixed dim 3 is 2
        ("ids", [2, 3]),  # rank 2 for rank 1
    ],
)
def test_wrong_shape(default, alias, shape):
    given = {**GOOD, alias: (GOOD[alias][0], shape)}
    message = _invalid(default, given)
    want = default.inputs[alias].shape_text()
    dims = "[" + ",".join(map(str, shape)) + "]"
    assert message == (
        f'input "{alias}": shape {dims} is not compatible with the signature\'s shape {want}'
    )


@pytest.mark.parametrize("batch", [0, 1, 5, 10_000])
def test_unknown_dims_accept_any_size(default, batch):
    check_inputs(default, {**GOOD, "dense": (dtypes.DT_FLOAT, [batch, 3])})
    check_inputs(default, {**GOOD, "ids": (dtypes.DT_INT64, [batch])})


@pytest.mark.parametrize("shape", [[], [1], [2, 3], [1, 1, 1, 1]])
def test_unknown_rank_accepts_any_shape(default, shape):
    check_inputs(default, {**GOOD, "query": (dtypes.DT_STRING, shape)})


def test_fixed_dims_must_match(specs):
    fixed = specs["fixed"]
    check_inputs(fixed, {"image": (dtypes.DT_UINT8, [2, 28, 28])})
    for shape in ([1, 28, 28], [2, 28, 27], [2, 28, 28, 1]):
        _invalid(fixed, {"image": (dtypes.DT_UINT8, shape)})


@pytest.mark.parametrize(
    ("want", "got", "fits"),
    [
        (None, [], True),
        (None, [3, 4], True),
        ((), [], True),
        ((), [1], False),
        ((-1,), [0], True),
        ((-1,), [], False),
        ((-1, 2), [9, 2], True),
        ((-1, 2), [9, 3], False),
        ((2, -1), [2, 0], True),
        ((2, -1), [3, 0], False),
        ((1, 2, 3), (1, 2, 3), True),
        ((1, 2, 3), (1, 2), False),
    ],
)
def test_shape_fits(want, got, fits):
    assert shape_fits(want, got) is fits


# ---------------------------------------------------------------------------------------
# check_output_filter
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], (), iter(())], ids=["list", "tuple", "iterator"])
def test_empty_filter_means_every_output(default, empty):
    assert sorted(check_output_filter(default, empty)) == ["labels", "scores"]


def test_filter_keeps_the_requested_order(default):
    assert check_output_filter(default, ["scores"]) == ["scores"]
    assert check_output_filter(default, ["scores", "labels"]) == ["scores", "labels"]
    assert check_output_filter(default, iter(["labels", "scores"])) == ["labels", "scores"]


def test_unknown_output_alias(default):
    with pytest.raises(ServingError) as info:
        check_output_filter(default, ["scores", "nope"])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message == (
        "output tensor alias not found in signature: nope "
        "Outputs expected to be in the set {labels,scores}."
    )


def test_duplicate_output_alias(default):
    with pytest.raises(ServingError) as info:
        check_output_filter(default, ["scores", "scores"])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message == "duplicate output tensor alias: scores"  # TF Serving's text
    # The first problem in the filter's order is the one named, as TF Serving's one pass.
    with pytest.raises(ServingError) as info:
        check_output_filter(default, ["labels", "labels", "nope"])
    assert info.value.message == "duplicate output tensor alias: labels"


# ---------------------------------------------------------------------------------------
# TensorFlow's own protos give the same specs (the worker builds them from those)
# ---------------------------------------------------------------------------------------


def test_tensorflow_serving_signature_def_map_gives_the_same_specs(specs):
    get_model_metadata_pb2 = pytest.importorskip("tensorflow_serving.apis.get_model_metadata_pb2")
    theirs = get_model_metadata_pb2.SignatureDefMap.FromString(
        _signature_def_map().SerializeToString()
    )
    assert specs_from_signature_defs(theirs.signature_def) == specs
