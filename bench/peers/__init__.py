"""Peer servers for the comparison in ``bench/compare.py``: what a user would run instead of
mpspool, on the same demo model and the same machine.

Every peer is a module following one contract, which ``bench/compare.py`` relies on:

    PYTHON -m bench.peers.<name> --model-dir VERSION_DIR --port PORT --instances N [--threads T]

- ``PYTHON`` may be another interpreter (the peer's own virtualenv); the working directory is
  the repository root.
- It binds 127.0.0.1:PORT only and loads the SavedModel in VERSION_DIR with ``tags=["serve"]``.
- It runs N instances (replicas, workers), each with T intra-op threads (default
  ``max(1, cores // N)``) and 1 inter-op thread, configured the way the peer's own docs
  recommend for CPU serving.
- It is ready when it answers requests: the orchestrator polls with a real request, there is
  no other readiness signal.
- On SIGTERM or SIGINT it stops everything it started, child processes included, and exits 0
  within about 20 s; if its parent dies it must not leave processes behind (the main process
  calls ``mpspool.process.die_with_parent()`` where it can).
- It logs to stderr only.
"""
