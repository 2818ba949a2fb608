"""mpspool: a TensorFlow Serving-compatible pool of model worker processes.

The package root holds what the processes share: the CLI, the configuration, the
router⇄worker wire protocol, dtype and signature rules, and the TF Serving protos.
The subpackages (top-level folders of the repository) each own one process role:
``supervisor`` (the controller), ``router``, ``worker``.
"""

__version__ = "0.1.0"
