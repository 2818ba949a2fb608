"""A load generator for TensorFlow Serving's Predict API (any server speaking it, mpspool's router
included), in closed-loop and open-loop form; also for KServe v2's ModelInfer (Triton's gRPC API).

Closed loop (``--concurrency C``): C coroutines each send a request, wait for its answer and send
the next, back to back. It measures the throughput a server reaches when C clients keep it
busy; latency is what a client waits at that load. Requests are attributed to the measured
window by their *completion* time, so throughput is "answers per second during the window"
and matches CPU time sampled over the same window.

Open loop (``--rate R``): requests are sent at a fixed rate (Poisson or uniform arrivals)
whether or not earlier ones have been answered, as independent clients do. Latency is taken
from each request's *scheduled* send time, so a client that falls behind (or a server that
queues) shows up in the latency instead of silently lowering the offered load (coordinated
omission). Requests are attributed to the window by their scheduled time.

The client is meant to cost as little CPU as possible, since on a small machine it shares the
cores with the server: requests are serialized once before the run (a few distinct ones,
cycled) and sent as bytes, and answers are not parsed (one answer is parsed and checked
before the run starts). Every run is bounded: by its duration, a per-request deadline, a cap on
requests sent, and an overall time limit.

Protocols (``--protocol``): "tfserving" sends TF Serving PredictRequests (tensor_content bytes);
"kserve" sends KServe v2 ModelInferRequests with the tensors in ``raw_input_contents``, the
fast path Triton's own clients take. Both carry the same demo inputs, so the servers compared
do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.protos import kserve_pb2
from bench.tensors import array_to_tensor, tensor_to_array
from mpspool.demo_model import demo_inputs
from mpspool.protos import serving_pb2

PREDICT_METHOD = "/tensorflow.serving.PredictionService/Predict"
KSERVE_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# --protocol: the gRPC method each protocol's requests go to.
PROTOCOL_METHODS = {"tfserving": PREDICT_METHOD, "kserve": KSERVE_INFER_METHOD}
# KServe v2 tensor datatypes of the numpy dtypes the demo inputs use.
KSERVE_DATATYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}
# Sending raw bytes over big batches: lift gRPC's 4 MiB default on both directions.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# After an error a closed-loop client pauses this long, so that a server answering every
# request with an immediate error is not hammered by a tight loop of failures.
ERROR_BACKOFF_S = 0.001
DEFAULT_MAX_REQUESTS = 10_000_000
# Open loop: requests in flight beyond this are not sent but counted as CLIENT_BACKLOG, so an
# overloaded server cannot make the client's own task count (and memory) grow without end.
DEFAULT_MAX_INFLIGHT = 10_000

# Called with "start" and "end" at the measured window's edges (e.g. to sample a server
# process's CPU time over exactly the window the throughput is computed for).
WindowHook = Callable[[str], None]


# -- requests -----------------------------------------------------------------------
def demo_requests(
    batch: int,
    rows: int,
    count: int = 8,
    model_name: str = "demo",
    signature_name: str = "",
    seed: int = 0,
) -> list[bytes]:
    """``count`` distinct serialized PredictRequests for the demo model at ``batch``.

    Distinct (different ids) so that a server cannot answer from a warm cache line or a
    memoised result; serialized once so the run itself spends no client CPU on protobuf.
    ``rows`` must not exceed the served model's embedding rows (ids are drawn below it).
    """
    payloads = []
    for i in range(count):
        request = serving_pb2.PredictRequest()
        request.model_spec.name = model_name
        if signature_name:
            request.model_spec.signature_name = signature_name
        for alias, values in demo_inputs(batch, rows, seed=seed + i).items():
            array_to_tensor(values, request.inputs[alias])
        payloads.append(request.SerializeToString())
    return payloads


def kserve_requests(
    batch: int, rows: int, count: int = 8, model_name: str = "demo", seed: int = 0
) -> list[bytes]:
    """``count`` distinct serialized KServe v2 ModelInferRequests for the demo model at ``batch``.

    The same inputs as ``demo_requests`` (same seeds, so the same ids), each tensor sent as
    little-endian bytes in ``raw_input_contents``. No outputs are named: the server returns
    all of them (the demo model has one, ``score``).
    """
    payloads = []
    for i in range(count):
        request = kserve_pb2.ModelInferRequest(model_name=model_name)
        for name, values in demo_inputs(batch, rows, seed=seed + i).items():
            datatype = KSERVE_DATATYPES.get(values.dtype)
            if datatype is None:
                raise ValueError(f"input {name!r}: no KServe datatype for numpy {values.dtype}")
            request.inputs.add(name=name, datatype=datatype, shape=values.shape)
            little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
            request.raw_input_contents.append(little.tobytes())
        payloads.append(request.SerializeToString())
    return payloads


def _protocol_method(protocol: str) -> str:
    try:
        return PROTOCOL_METHODS[protocol]
    except KeyError:
        raise ValueError(
            f"protocol must be one of {sorted(PROTOCOL_METHODS)}, got {protocol!r}"
        ) from None


def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Each channel its own connection: with --channels > 1 the load really spreads
            # over several HTTP/2 connections instead of sharing one subchannel.
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


async def check_target(
    target: str,
    payload: bytes,
    batch: int,
    output: str = "score",
    timeout_s: float = 30.0,
    protocol: str = "tfserving",
) -> None:
    """Send one request and check the answer's ``output`` has ``batch`` rows.

    A load run that counts fast errors as throughput would be worse than no run, so a
    misconfigured target (wrong model name, wrong row count) fails here, loudly.
    ``protocol`` says what ``payload`` is and how to read the answer ("tfserving" or "kserve").
    """
    _protocol_method(protocol)  # an unknown protocol fails before anything is sent
    if protocol == "kserve":
        await _check_kserve_target(target, payload, batch, output, timeout_s)
        return
    response = await _call_once(
        target, PREDICT_METHOD, serving_pb2.PredictResponse.FromString, payload, timeout_s
    )
    if output not in response.outputs:
        raise RuntimeError(
            f"{target} answered without output {output!r}: got {sorted(response.outputs)}"
        )
    values = tensor_to_array(response.outputs[output], output)
    if not values.shape or values.shape[0] != batch:
        raise RuntimeError(
            f"{target} answered {output!r} with shape {values.shape}, expected {batch} rows"
        )


async def _call_once(
    target: str, method: str, parse: Callable[[bytes], Any], payload: bytes, timeout_s: float
) -> Any:
    """One call of ``method`` with a pre-serialized ``payload``; its parsed answer, or a
    RuntimeError naming the method and the status."""
    async with _channel(target) as channel:
        call = channel.unary_unary(method, response_deserializer=parse)
        try:
            return await call(payload, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            what = method.rsplit("/", 1)[-1]
            raise RuntimeError(
                f"{target} did not answer a {what} request: {exc.code().name}: {exc.details()}"
            ) from exc


async def _check_kserve_target(
    target: str, payload: bytes, batch: int, output: str, timeout_s: float
) -> None:
    response = await _call_once(
        target, KSERVE_INFER_METHOD, kserve_pb2.ModelInferResponse.FromString, payload, timeout_s
    )
    names = [tensor.name for tensor in response.outputs]
    if output not in names:
        raise RuntimeError(f"{target} answered without output {output!r}: got {sorted(names)}")
    index = names.index(output)
    tensor = response.outputs[index]
    shape = tuple(tensor.shape)
    if not shape or shape[0] != batch:
        raise RuntimeError(
            f"{target} answered {output!r} with shape {shape}, expected {batch} rows"
        )
    # Raw contents, when sent, come one per output in the outputs' order: their size must
    # agree with the shape, or the server answered something other than it says.
    itemsize = {v: k.itemsize for k, v in KSERVE_DATATYPES.items()}.get(tensor.datatype)
    if response.raw_output_contents and itemsize is not None:
        got = len(response.raw_output_contents[index])
        expected = int(np.prod(shape)) * itemsize
        if got != expected:
            raise RuntimeError(
                f"{target} answered {output!r} ({tensor.datatype}, shape {shape}) with {got} "
                f"bytes, expected {expected}"
            )


# -- one run ------------------------------------------------------------------------
class _Run:
    """The shared machinery of one run: channels, the window clock, records, progress."""

    def __init__(
        self,
        target: str,
        payloads: Sequence[bytes],
        batch: int,
        duration_s: float,
        warmup_s: float,
        timeout_s: float,
        channels: int,
        max_requests: int,
        on_window: WindowHook | None,
        progress: str | None,
        protocol: str = "tfserving",
    ) -> None:
        self.method = _protocol_method(protocol)
        if not payloads:
            raise ValueError("at least one request payload is needed")
        if duration_s <= 0 or warmup_s < 0 or timeout_s <= 0:
            raise ValueError(
                "duration and timeout must be positive and warm-up non-negative, got "
                f"duration={duration_s} warmup={warmup_s} timeout={timeout_s}"
            )
        self.target = target
        self.payloads = list(payloads)
        self.batch = batch
        self.duration_s = duration_s
        self.warmup_s = warmup_s
        self.timeout_s = timeout_s
        self.channel_count = max(1, channels)
        self.max_requests = max_requests
        self.on_window = on_window
        self.progress = progress  # a label, or None for no progress line
        self.channels: list[grpc.aio.Channel] = []
        self.calls: list[Any] = []
        # Per answered request: the time that places it in or out of the window (completion
        # in closed loop, scheduled send in open loop) and its latency, both in seconds.
        self.stamps = array("d")
        self.latencies = array("d")
        self.errors: list[tuple[float, str]] = []
        self.error_examples: dict[str, str] = {}
        self.sent = 0
        self.stop_sending = False
        self.started = 0.0
        self.window_start: float | None = None
        self.window_end: float | None = None
        self.client_cpu_s = 0.0

    async def open(self) -> None:
        for _ in range(self.channel_count):
            channel = _channel(self.target)
            self.channels.append(channel)
            # Connect before the clock starts: connection set-up is not the server's latency.
            await asyncio.wait_for(channel.channel_ready(), self.timeout_s)
            # No serializer/deserializer: requests are bytes already, answers stay bytes.
            self.calls.append(channel.unary_unary(self.method))

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def record_ok(self, stamp: float, latency: float) -> None:
        self.stamps.append(stamp)
        self.latencies.append(latency)

    def record_error(self, stamp: float, code: str, details: str) -> None:
        self.errors.append((stamp, code))
        self.error_examples.setdefault(code, details[:300])

    async def clock(self) -> None:
        """Mark the window: warm-up, then ``duration_s`` measured; then stop sending."""
        await asyncio.sleep(max(0.0, self.started + self.warmup_s - time.perf_counter()))
        if self.on_window is not None:
            self.on_window("start")
        cpu_start = time.process_time()
        self.window_start = time.perf_counter()
        await asyncio.sleep(self.duration_s)
        self.window_end = time.perf_counter()
        self.client_cpu_s = time.process_time() - cpu_start
        if self.on_window is not None:
            self.on_window("end")
        self.stop_sending = True

    async def report_progress(self) -> None:
        total = self.warmup_s + self.duration_s
        tty = sys.stderr.isatty()
        last_count, last_time = 0, time.perf_counter()
        while True:
            await asyncio.sleep(0.5 if tty else 1.0)
            now = time.perf_counter()
            count = len(self.latencies)
            rate = (count - last_count) / max(now - last_time, 1e-9)
            last_count, last_time = count, now
            phase = "warm-up" if self.window_start is None else "measure"
            line = (
                f"{self.progress} {phase} {min(now - self.started, total):4.1f}/{total:.1f}s "
                f"ok={count} err={len(self.errors)} {rate:,.0f} req/s"
            )
            sys.stderr.write(f"\r{line}\x1b[K" if tty else f"{line}\n")
            sys.stderr.flush()

    async def drive(self, senders: list[Any]) -> None:
        """Run the senders with the clock (and progress), within an overall time limit."""
        self.started = time.perf_counter()
        reporter = (
            asyncio.ensure_future(self.report_progress()) if self.progress is not None else None
        )
        tasks = [asyncio.ensure_future(s) for s in [self.clock(), *senders]]
        # Senders stop issuing at the window's end; what they have in flight then ends within
        # the per-request deadline. The slack covers scheduling on a loaded machine.
        limit = self.warmup_s + self.duration_s + self.timeout_s + 10.0
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), limit)
        finally:
            for task in tasks:
                task.cancel()
            if reporter is not None:
                reporter.cancel()
                if sys.stderr.isatty():
                    sys.stderr.write("\n")

    def summary(self, mode: str, **config: Any) -> dict[str, Any]:
        if self.window_start is None or self.window_end is None:
            raise RuntimeError("the run ended before its measured window did")
        start, end = self.window_start, self.window_end
        stamps = np.frombuffer(self.stamps, dtype=np.float64)
        latencies = np.frombuffer(self.latencies, dtype=np.float64)
        inside = (stamps >= start) & (stamps < end)
        lat_ms = latencies[inside] * 1e3
        window = end - start
        ok = int(lat_ms.size)
        errors = Counter(code for stamp, code in self.errors if start <= stamp < end)
        if ok:
            p50, p90, p99 = (float(v) for v in np.percentile(lat_ms, [50, 90, 99]))
            mean, lo, hi = float(lat_ms.mean()), float(lat_ms.min()), float(lat_ms.max())
        else:
            p50 = p90 = p99 = mean = lo = hi = float("nan")
        return {
            "mode": mode,
            "target": self.target,
            "batch": self.batch,
            **config,
            "warmup_s": self.warmup_s,
            "duration_s": round(window, 4),
            "ok": ok,
            "errors": dict(errors),
            "error_count": int(sum(errors.values())),
            "errors_outside_window": len(self.errors) - int(sum(errors.values())),
            "error_examples": self.error_examples,
            "sent_total": self.sent,
            "throughput_rps": ok / window,
            "rows_per_s": ok * self.batch / window,
            "p50_ms": p50,
            "p90_ms": p90,
            "p99_ms": p99,
            "mean_ms": mean,
            "min_ms": lo,
            "max_ms": hi,
            # This process's CPU (all its threads, gRPC's included) per answered request:
            # what the load generator takes away from a server sharing its cores.
            "client_cpu_us_per_request": self.client_cpu_s / ok * 1e6 if ok else None,
        }


async def closed_loop(
    target: str,
    payloads: Sequence[bytes],
    batch: int,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 10.0,
    channels: int = 1,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    on_window: WindowHook | None = None,
    progress: str | None = None,
    protocol: str = "tfserving",
) -> dict[str, Any]:
    """C = ``concurrency`` clients sending back to back; see the module docstring.

    Returns the summary dict (throughput_rps, rows_per_s, p50/p90/p99_ms, errors by status
    code, ...) of the requests answered within the measured window. ``protocol`` ("tfserving"
    or "kserve") must match what ``payloads`` are; it picks the gRPC method.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    run = _Run(
        target, payloads, batch, duration_s, warmup_s, timeout_s, channels, max_requests,
        on_window, progress, protocol,
    )  # fmt: skip

    async def client(index: int) -> None:
        call = run.calls[index % len(run.calls)]
        payloads_ = run.payloads
        # Clients start at different payloads, so concurrent requests differ.
        i = index
        while not run.stop_sending and run.sent < run.max_requests:
            payload = payloads_[i % len(payloads_)]
            i += 1
            run.sent += 1
            t0 = time.perf_counter()
            try:
                await call(payload, timeout=run.timeout_s)
            except grpc.aio.AioRpcError as exc:
                run.record_error(time.perf_counter(), exc.code().name, exc.details() or "")
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            t1 = time.perf_counter()
            run.record_ok(t1, t1 - t0)

    await run.open()
    try:
        await run.drive([client(i) for i in range(concurrency)])
    finally:
        await run.close()
    return run.summary(
        "closed", concurrency=concurrency, channels=run.channel_count, **_protocol_key(protocol)
    )


async def open_loop(
    target: str,
    payloads: Sequence[bytes],
    batch: int,
    rate: float,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 10.0,
    arrivals: str = "poisson",
    channels: int = 1,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    seed: int = 0,
    on_window: WindowHook | None = None,
    progress: str | None = None,
    protocol: str = "tfserving",
) -> dict[str, Any]:
    """Requests at ``rate`` per second (``arrivals``: "poisson" or "uniform"); see the module
    docstring. The summary adds ``offered_rps`` and the client's worst send lag, which says
    whether the client itself kept up with the schedule. ``protocol`` as in closed_loop."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if arrivals not in ("poisson", "uniform"):
        raise ValueError(f"arrivals must be 'poisson' or 'uniform', got {arrivals!r}")
    run = _Run(
        target, payloads, batch, duration_s, warmup_s, timeout_s, channels, max_requests,
        on_window, progress, protocol,
    )  # fmt: skip
    rng = random.Random(seed)
    max_lag = 0.0
    scheduled_in_window = 0

    async def one(call: Any, payload: bytes, scheduled: float) -> None:
        try:
            await call(payload, timeout=run.timeout_s)
        except grpc.aio.AioRpcError as exc:
            run.record_error(scheduled, exc.code().name, exc.details() or "")
            return
        run.record_ok(scheduled, time.perf_counter() - scheduled)

    async def scheduler() -> None:
        nonlocal max_lag, scheduled_in_window
        inflight: set[asyncio.Future[None]] = set()
        end = run.started + run.warmup_s + run.duration_s
        window_start = run.started + run.warmup_s
        scheduled = run.started
        i = 0
        while scheduled < end and run.sent < run.max_requests:
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            max_lag = max(max_lag, time.perf_counter() - scheduled)
            if scheduled >= window_start:
                scheduled_in_window += 1
            if len(inflight) >= max_inflight:
                run.record_error(scheduled, "CLIENT_BACKLOG", f"{max_inflight} already in flight")
            else:
                call = run.calls[i % len(run.calls)]
                task = asyncio.ensure_future(
                    one(call, run.payloads[i % len(run.payloads)], scheduled)
                )
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                run.sent += 1
                i += 1
            scheduled += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
        if inflight:
            await asyncio.gather(*inflight)

    await run.open()
    try:
        await run.drive([scheduler()])
    finally:
        await run.close()
    result = run.summary(
        "open", rate=rate, arrivals=arrivals, channels=run.channel_count,
        **_protocol_key(protocol),
    )  # fmt: skip
    result["offered_rps"] = scheduled_in_window / result["duration_s"]
    result["max_send_lag_ms"] = max_lag * 1e3
    return result


def _protocol_key(protocol: str) -> dict[str, str]:
    # TF Serving runs keep the summary they always had; others say what they spoke.
    return {} if protocol == "tfserving" else {"protocol": protocol}


# -- command line ---------------------------------------------------------------------
def format_result(result: dict[str, Any]) -> str:
    """One line: what ran and what it gave."""
    load = (
        f"c={result['concurrency']}"
        if result["mode"] == "closed"
        else f"rate={result['rate']:g}/s {result['arrivals']}"
    )
    errors = ", ".join(f"{k}={v}" for k, v in sorted(result["errors"].items())) or "none"
    return (
        f"batch={result['batch']} {load}: {result['throughput_rps']:,.1f} req/s "
        f"{result['rows_per_s']:,.0f} rows/s  p50={result['p50_ms']:.2f} ms "
        f"p90={result['p90_ms']:.2f} ms p99={result['p99_ms']:.2f} ms  "
        f"ok={result['ok']} errors: {errors}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target", default="127.0.0.1:8500", help="host:port (%(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="examples per request")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=1, help="closed loop: clients")
    load.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument(
        "--arrivals", choices=("poisson", "uniform"), default="poisson", help="open loop"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-request deadline, s")
    parser.add_argument(
        "--protocol",
        choices=sorted(PROTOCOL_METHODS),
        default="tfserving",
        help="TF Serving Predict or KServe v2 ModelInfer (Triton) (%(default)s)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=1000,
        help="embedding rows of the served demo model; ids are drawn below it (%(default)s)",
    )
    parser.add_argument("--model-name", default="demo")
    parser.add_argument("--signature-name", default="", help="tfserving only")
    parser.add_argument("--distinct", type=int, default=8, help="distinct requests, cycled")
    parser.add_argument("--channels", type=int, default=1, help="gRPC channels (connections)")
    parser.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS)
    parser.add_argument("--max-inflight", type=int, default=DEFAULT_MAX_INFLIGHT)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    return parser


async def _amain(args: argparse.Namespace) -> dict[str, Any]:
    if args.protocol == "kserve":
        if args.signature_name:
            raise ValueError("--signature-name is TF Serving's; KServe v2 has no signatures")
        payloads = kserve_requests(args.batch, args.rows, args.distinct, args.model_name)
    else:
        payloads = demo_requests(
            args.batch, args.rows, args.distinct, args.model_name, args.signature_name
        )
    await check_target(
        args.target, payloads[0], args.batch, timeout_s=args.timeout, protocol=args.protocol
    )
    label = None if args.quiet else "loadgen"
    common = {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "timeout_s": args.timeout,
        "channels": args.channels,
        "max_requests": args.max_requests,
        "progress": label,
        "protocol": args.protocol,
    }
    if args.rate is not None:
        return await open_loop(
            args.target, payloads, args.batch, args.rate, arrivals=args.arrivals,
            max_inflight=args.max_inflight, **common,
        )  # fmt: skip
    return await closed_loop(args.target, payloads, args.batch, args.concurrency, **common)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(_amain(args))
    except (RuntimeError, ValueError, TimeoutError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    print(format_result(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
