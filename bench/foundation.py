"""The names bench/memory.py imports from here, now in bench/harness.py (the foundation scenario
itself is gone: bench/frontdoor.py measures the same pools with a native client). Delete this
file once bench/memory.py imports bench.harness."""

from bench.harness import (  # noqa: F401
    _OUTSIDE,
    MODEL_NAME,
    OUT_DIR,
    REPO,
    Pool,
    _describe_source,
    _ints,
    add_output_arguments,
    command_line,
    ensure_model,
    frozen_code,
    machine,
    scenario_main,
    shm_leftovers,
    versions,
    write_section,
)
