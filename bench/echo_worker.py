"""A worker that only echoes: the front door's own ceiling, without TensorFlow.

Speaks the worker side of mpspool/wire.py like worker/serve.py does (READY with a
SignatureDefMap, heartbeats from the serving loop, one REPLY per REQUEST) for a model whose
serving signature maps a float tensor `x` [-1, -1] to itself, and answers each request with
its own tensor frames. Used by bench/frontdoor.py; `python -m bench.echo_worker RUN_DIR SLOT`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import zmq

from mpspool import dtypes, process, wire
from mpspool.protos import serving_pb2

MODEL = "echo"


def signature_defs() -> bytes:
    sigs = serving_pb2.SignatureDefMap()
    sig = sigs.signature_def["serving_default"]
    sig.method_name = "tensorflow/serving/predict"
    for side in (sig.inputs, sig.outputs):
        info = side["x"]
        info.name = "x:0"
        info.dtype = dtypes.DT_FLOAT
        info.tensor_shape.dim.add(size=-1)
        info.tensor_shape.dim.add(size=-1)
    return sigs.SerializeToString()


def main(run_dir: str, slot: str) -> int:
    process.die_with_parent()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    pid = os.getpid()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, wire.worker_identity(slot, pid))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(wire.endpoint(run_dir, wire.WORKERS_ENDPOINT))
    ready = [wire.pack(wire.Kind.READY, slot=slot, pid=pid, model=MODEL, version=1, weights=None),
             signature_defs()]  # fmt: skip
    sock.send_multipart(ready)
    next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
    while not stop["now"]:
        if sock.poll(max(0, int((next_beat - time.monotonic()) * 1000))):
            frames = sock.recv_multipart(copy=False)
            header = wire.unpack(frames[0].buffer)
            kind = wire.kind_of(header)
            if kind is wire.Kind.REQUEST:
                head = wire.pack(wire.Kind.REPLY, id=header["id"], tensors=header["tensors"])
                sock.send_multipart([head, *frames[1:]], copy=False)
            elif kind is wire.Kind.REREGISTER:
                sock.send_multipart(ready)
        if time.monotonic() >= next_beat:
            sock.send(wire.pack(wire.Kind.HEARTBEAT, slot=slot, pid=pid, served=0))
            next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
    sock.send(wire.pack(wire.Kind.BYE, slot=slot, pid=pid))
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
