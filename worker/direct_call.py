"""Call a loaded signature through TensorFlow's eager C API, without its Python layers.

The flat call (``ConcreteFunction._call_flat``) still walks five Python layers per request —
the SavedModel wrapper (distribution strategies), the concrete function (gradient tapes),
``AtomicFunction.call_flat`` (error interpolation, control dependencies, tape recording,
graph mode), ``Context.call_function`` (cancellation scopes, attribute tuples) and
``execute.execute`` — before ``pywrap_tfe.TFE_Py_Execute`` runs the function's graph. A
serving worker has none of those: no tape, no strategy, no cancellation scope, eager mode
only. Measured on the demo model at batch 1 (one intra-op and one inter-op thread, one
process calling back to back): 250 µs of CPU per flat call, 137 µs per direct call with the
same inputs and attributes (bench/RESULTS.md, "Worker call path").

What the direct call fixes once, at load: the function's registered name, its call attributes
(executor type, config proto), how many outputs it has and which alias each one is, the
dtype of each input, and the captured inputs (the variables' resource handles) when none of
them is a deferred capture. It is built only when all of that is plain; the runtime then
checks its answers against the public keyword call at warm-up before using it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mpspool.signature import SignatureSpec

log = logging.getLogger("mpspool.worker")


class DirectCall:
    """One signature, called as TFE_Py_Execute(function name, inputs + captures)."""

    def __init__(
        self,
        tf_modules: tuple[Any, Any, Any, Any],
        name: str,
        attrs: tuple[Any, ...],
        inputs: Sequence[tuple[str, int]],
        captured: list[Any],
        outputs: Sequence[str],
        host_only: bool = False,
    ) -> None:
        self._execute, self._execute_cancelable, self._eager_tensor, self._context = tf_modules
        # Where input tensors are made. TensorFlow's own conversion names the context's
        # device ("" by default), and for a name without "CPU:0" it runs an _EagerConst op
        # to place each constant there. With no GPU the answer is the host anyway, so the
        # tensors are made there directly (device None: CPU:0, no op): the demo model's
        # batch-1 call (2 inputs) went from 135 to 104 µs of CPU back to back here.
        self._host_only = host_only
        self.name = name
        self._attrs = attrs
        self._inputs = list(inputs)  # (alias, DataType number) in the graph's argument order
        self._captured = captured
        self.outputs = list(outputs)  # alias of each flat output, in order

    def __call__(self, inputs: Mapping[str, Any], cancel: Any = None) -> dict[str, Any]:
        """alias → eager tensor of every output; TensorFlow's OpError subclasses on failure.

        ``inputs`` hold every input alias (checked against the signature by the front door).
        ``cancel``: a CancellationManager whose start_cancel stops the call where TensorFlow
        can stop it (at a loop's next turn: CancelledError), or None."""
        context = self._context
        device = context.device_name
        tensor = self._eager_tensor
        at = None if self._host_only else device
        args = [tensor(inputs[alias], at, dt) for alias, dt in self._inputs]
        args.extend(self._captured)
        try:
            if cancel is None:
                flat = self._execute(
                    context._handle, device, self.name, args, self._attrs, len(self.outputs)
                )
            else:
                flat = self._execute_cancelable(
                    context._handle,
                    device,
                    self.name,
                    args,
                    self._attrs,
                    cancel._impl,
                    len(self.outputs),
                )
        except Exception as exc:
            raise _as_op_error(exc) from None
        return dict(zip(self.outputs, flat, strict=True))


def direct_call(
    function: Any, order: Sequence[str] | None, spec: SignatureSpec
) -> DirectCall | None:
    """The direct call of a loaded signature function, or None (with the reason logged at
    debug level) when anything about it is not plain: then the flat or keyword call serves.

    ``order`` is the signature's input aliases in the graph's argument order (the flat call's
    order); None means the arguments cannot be passed flat at all.
    """
    if not order:
        return None
    import tensorflow as tf

    try:
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import context as eager_context
        from tensorflow.python.framework import ops

        atomic = function._inference_function
        function_type = atomic.function_type
        raw_captures = list(function._captured_inputs)
        name = atomic.name
        name = name.decode() if isinstance(name, bytes) else str(name)
        flat_outputs = list(function_type.flat_outputs)
        expected_args = len(atomic.cached_definition.signature.input_arg)
    except (AttributeError, TypeError, ValueError) as exc:
        log.debug("no direct call for %s: %s", spec.key, exc)
        return None
    # A deferred capture is re-evaluated on every call; a distributed variable resolves per
    # replica. Either way the handles are not fixed, so the flat call keeps doing that work.
    if any(callable(c) or not isinstance(c, ops.EagerTensor) for c in raw_captures):
        log.debug("no direct call for %s: a capture is not a plain eager tensor", spec.key)
        return None
    # Resource or variant outputs carry handle data the flat call attaches; a signature's
    # outputs are never those, but if one is, it is not ours to handle.
    if any(getattr(o, "dtype", None) in (tf.resource, tf.variant) for o in flat_outputs):
        return None
    if expected_args != len(order) + len(raw_captures):
        log.debug("no direct call for %s: %d graph arguments", spec.key, expected_args)
        return None
    outputs = _output_aliases(function_type, len(flat_outputs), spec)
    if outputs is None:
        return None
    context = eager_context.context()
    context.ensure_initialized()
    attrs = tuple(itertools.chain(*context.function_call_options.as_attrs().items()))
    inputs = [(alias, spec.inputs[alias].dtype) for alias in order]
    return DirectCall(
        (pywrap_tfe.TFE_Py_Execute, pywrap_tfe.TFE_Py_ExecuteCancelable, ops.EagerTensor, context),
        name,
        attrs,
        inputs,
        raw_captures,
        outputs,
        host_only=not tf.config.list_logical_devices("GPU"),
    )


def _output_aliases(function_type: Any, count: int, spec: SignatureSpec) -> list[str] | None:
    """Which alias each flat output is, asked of TensorFlow's own packing: packing numbered
    markers gives alias → position (a signature's outputs are a flat dict of tensors)."""

    class Marker:
        def __init__(self, index: int) -> None:
            self.index = index

    try:
        packed = function_type.pack_output([Marker(i) for i in range(count)])
    except Exception as exc:  # any refusal means "not plain"
        log.debug("no direct call for %s: packing outputs failed: %s", spec.key, exc)
        return None
    if not isinstance(packed, dict) or set(packed) != set(spec.outputs):
        return None
    aliases: list[str | None] = [None] * count
    for alias, marker in packed.items():
        if not isinstance(marker, Marker) or aliases[marker.index] is not None:
            return None
        aliases[marker.index] = alias
    if any(a is None for a in aliases):
        return None
    return [a for a in aliases if a is not None]


def _as_op_error(exc: Exception) -> Exception:
    """TensorFlow's exception for a failed status, as execute.execute raises it."""
    from tensorflow.python.eager import core

    if isinstance(exc, core._NotOkStatusException):
        return core._status_to_exception(exc)
    return exc
