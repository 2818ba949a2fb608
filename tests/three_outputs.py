"""A tiny SavedModel whose serving signature has outputs of three dtypes and shapes, aliases
that do not sort as they were written, and one variable: for the worker runtime's call paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SIG = "serving_default"

THREE_INPUTS = {
    "x": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
    "n": np.array([7, 8], np.int32),
    "word": np.array([b"ab", b"c"], dtype=object),
}


def build_three_outputs(path: Path) -> Path:
    """Save the model as the version directory ``path``; returns it."""
    import tensorflow as tf

    class Three(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = tf.Variable([[1.0, 10.0]], dtype=tf.float32)

        @tf.function(
            input_signature=[
                tf.TensorSpec([None, 2], tf.float32, name="x"),
                tf.TensorSpec([None], tf.int32, name="n"),
                tf.TensorSpec([None], tf.string, name="word"),
            ]
        )
        def serve(self, x: tf.Tensor, n: tf.Tensor, word: tf.Tensor) -> dict[str, tf.Tensor]:
            return {
                "zz_scaled": x * self.scale,
                "aa_next": n + 1,
                "mm_shout": tf.strings.upper(word),
            }

    module = Three()
    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})
    return path
