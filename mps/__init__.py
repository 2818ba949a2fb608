"""Everything about NVIDIA GPUs and the MPS control daemon."""
