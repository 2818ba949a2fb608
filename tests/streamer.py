"""Client threads that keep requests flowing through a pool and record every outcome."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.demo_model import demo_inputs


@dataclass
class Outcome:
    sent: float  # time.monotonic() when sent
    code: grpc.StatusCode
    details: str = ""


@dataclass
class Streamer:
    port: int
    rows: int
    threads: int = 2
    timeout_s: float = 20.0
    outcomes: list[Outcome] = field(default_factory=list)
    # What to send (default: 4 rows of the demo model).
    request: predict_pb2.PredictRequest | None = None
    # gRPC's reconnect back-off (1 s, then longer) makes a client fail fast for a second or
    # more after one refused connection; this measures the server, not that policy.
    fast_reconnect: bool = False
    # Seconds each thread waits between requests (0: back to back). Workers restarted under
    # load start at idle priority (--loading-priority), so a closed loop on 2 cores starves
    # their loading; a paced stream keeps serving while they load.
    pause_s: float = 0.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        if self.request is not None:
            self._request = self.request
            return
        self._request = predict_pb2.PredictRequest()
        self._request.model_spec.name = "demo"
        for name, array in demo_inputs(4, self.rows).items():
            self._request.inputs[name].CopyFrom(tf.make_tensor_proto(array))

    def start(self) -> Streamer:
        for _ in range(self.threads):
            thread = threading.Thread(target=self._loop, daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def _loop(self) -> None:
        options = (
            [
                ("grpc.initial_reconnect_backoff_ms", 20),
                ("grpc.min_reconnect_backoff_ms", 20),
                ("grpc.max_reconnect_backoff_ms", 100),
            ]
            if self.fast_reconnect
            else []
        )
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    stub.Predict(self._request, timeout=self.timeout_s)
                    outcome = Outcome(sent, grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    outcome = Outcome(sent, exc.code(), exc.details() or "")
                    time.sleep(0.05)  # a failing server is not to be hammered
                with self._lock:
                    self.outcomes.append(outcome)
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def wait_for_successes(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.ok()) >= n:
                return
            time.sleep(0.05)
        raise AssertionError(
            f"fewer than {n} successful requests in {timeout} s: {self.failed()[:5]}"
        )

    def stop(self) -> Streamer:
        self._stop.set()
        for thread in self._workers:
            thread.join(self.timeout_s + 5)
        return self

    def ok(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.code == grpc.StatusCode.OK]

    def failed(self, sent_before: float | None = None) -> list[Outcome]:
        with self._lock:
            return [
                o
                for o in self.outcomes
                if o.code != grpc.StatusCode.OK and (sent_before is None or o.sent < sent_before)
            ]
