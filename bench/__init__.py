"""Benchmarks for mpspool: load generation, the in-process limit, and scenario drivers.

Run from the repository root (``python -m bench.<module>``); see bench/README.md.
"""
