"""Serving signatures as plain data, and the checks a request must pass against one.

Built from a SignatureDef map (TensorFlow's own protos in the worker, mpspool's
wire-compatible copies in the router: the same field names, so either works), and used by
both sides: the router rejects bad requests before they cost a hop, the worker checks
again so that nothing malformed ever reaches TensorFlow. Messages follow TF Serving's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpspool import dtypes
from mpspool.errors import Code, ServingError

DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"


@dataclass(frozen=True)
class TensorSpec:
    dtype: int
    shape: tuple[int, ...] | None  # None: unknown rank; -1: unknown dimension

    def shape_text(self) -> str:
        return "<unknown>" if self.shape is None else _dims(self.shape)


@dataclass(frozen=True)
class SignatureSpec:
    key: str
    method_name: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    # Why no request can call it ("" when one can): a tensor that is not one named tensor.
    unservable: str = ""


# The entry tf.saved_model.save writes for the model's initializer: a signature_def, but
# no function to call (TF Serving runs it at load).
INIT_OP_KEY = "__saved_model_init_op"


def specs_from_signature_defs(signature_defs: Mapping[str, Any]) -> dict[str, SignatureSpec]:
    """Specs for every signature a request can call: all but the init op's entry. One that
    takes no inputs (a vocabulary, a constant) is called with none, as TF Serving does."""
    specs = {}
    for key, sig in signature_defs.items():
        if key == INIT_OP_KEY:
            continue
        specs[key] = SignatureSpec(
            key=key,
            method_name=sig.method_name,
            inputs={alias: _tensor_spec(info) for alias, info in sig.inputs.items()},
            outputs={alias: _tensor_spec(info) for alias, info in sig.outputs.items()},
            unservable=_unservable(key, sig),
        )
    return specs


# TensorFlow's conversion of string tensors to and from numpy ends the process (SIGSEGV) past
# this rank: a signature with such a string output never loaded (its warm-up on zeros killed
# the worker at every try; found by a hunt). The front door refuses such requests
# (router/src/codec.rs MAX_STRING_RANK).
MAX_STRING_RANK = 32


def _unservable(key: str, sig: Any) -> str:
    """Why a request cannot call signature ``key``: TF Serving feeds and fetches each tensor
    by its TensorInfo's name, and a SparseTensor's (coo_sparse: a TF1 sparse placeholder)
    or a composite tensor's has none, so its Predict fails there too. Nor a tensor of a type
    mpspool does not carry (float8, int4, a resource): its warm-up failed the whole model's
    load (found by a hunt). Nor a string tensor of more than MAX_STRING_RANK dimensions. The
    model loads and its other signatures serve, as in TF Serving."""
    for side, tensors in (("input", sig.inputs), ("output", sig.outputs)):
        for alias, info in sorted(tensors.items()):
            if not dtypes.carried(info.dtype) and info.WhichOneof("encoding") == "name":
                return (
                    f"signature {key!r} cannot be called: its {side} {alias!r} is "
                    f"{dtypes.dtype_name(info.dtype)}, a type mpspool does not carry"
                )
            rank = len(info.tensor_shape.dim)
            if info.dtype == dtypes.DT_STRING and rank > MAX_STRING_RANK:
                return (
                    f"signature {key!r} cannot be called: its {side} {alias!r} is a string "
                    f"tensor of rank {rank}, and TensorFlow's Python side, which the workers "
                    f"call the model through, holds string tensors of rank {MAX_STRING_RANK} "
                    "at most"
                )
            encoding = info.WhichOneof("encoding")
            if encoding in ("coo_sparse", "composite_tensor"):
                return (
                    f"signature {key!r} cannot be called: its {side} {alias!r} is a "
                    f"{'SparseTensor' if encoding == 'coo_sparse' else 'composite tensor'} "
                    f"({encoding} encoding), not one named tensor a request can "
                    f"{'feed' if side == 'input' else 'fetch'}"
                )
    return ""


def _tensor_spec(info: Any) -> TensorSpec:
    shape_proto = info.tensor_shape
    if shape_proto.unknown_rank:
        shape = None
    else:
        shape = tuple(int(d.size) for d in shape_proto.dim)
    return TensorSpec(dtype=int(info.dtype), shape=shape)


def select_signature(specs: Mapping[str, SignatureSpec], name: str) -> SignatureSpec:
    key = name or DEFAULT_SIGNATURE
    try:
        return specs[key]
    except KeyError:
        raise ServingError(
            Code.FAILED_PRECONDITION, f'Serving signature key "{key}" not found.'
        ) from None


def check_inputs(spec: SignatureSpec, given: Mapping[str, tuple[int, Sequence[int]]]) -> None:
    """Raise INVALID_ARGUMENT unless `given` (alias → (dtype, shape)) fits the signature."""
    expected = set(spec.inputs)
    sent = set(given)
    if sent != expected:
        extra = sent - expected
        missing = expected - sent
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"input size does not match signature: {len(sent)}!={len(expected)} "
            f"len({_set(sent)}) != len({_set(expected)}). "
            f"Sent extra: {_set(extra)}. Missing but required: {_set(missing)}.",
        )
    for alias, (dt, shape) in given.items():
        want = spec.inputs[alias]
        if dt != want.dtype:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f'input "{alias}": expects dtype {dtypes.dtype_name(want.dtype)} '
                f"but {dtypes.dtype_name(dt)} is provided",
            )
        if not shape_fits(want.shape, shape):
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f'input "{alias}": shape {_dims(shape)} is not compatible with the '
                f"signature's shape {want.shape_text()}",
            )


def check_output_filter(spec: SignatureSpec, output_filter: Iterable[str]) -> list[str]:
    """The output aliases to return: all of them when the filter is empty."""
    names = list(output_filter)
    if not names:
        return list(spec.outputs)
    # One pass in the filter's order, as TF Serving's (predict_util.cc): the first alias that
    # is unknown or seen before is the one named.
    seen: set[str] = set()
    for name in names:
        if name not in spec.outputs:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"output tensor alias not found in signature: {name} "
                f"Outputs expected to be in the set {_set(spec.outputs)}.",
            )
        if name in seen:
            raise ServingError(Code.INVALID_ARGUMENT, f"duplicate output tensor alias: {name}")
        seen.add(name)
    return names


def shape_fits(want: tuple[int, ...] | None, got: Sequence[int]) -> bool:
    if want is None:
        return True
    if len(want) != len(got):
        return False
    return all(w < 0 or w == g for w, g in zip(want, got, strict=True))


def _set(names: Iterable[str]) -> str:
    return "{" + ",".join(sorted(names)) + "}"


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"
