"""A SavedModel with more than one MetaGraphDef (TF1's builder: one per tag set), served by
the MetaGraphDef whose tag set is --saved_model_tags ("serve" by default), as TensorFlow's
loader and TF Serving's pick it: the set equal, not merely containing "serve"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mpspool.cli import build_parser
from mpspool.config import ConfigError, PoolConfig
from mpspool.errors import Code
from mpspool.worker.runtime import ModelLoadError, load_saved_model

from poolproc import Pool

X = np.array([1.0, 2.5], np.float32)


@pytest.fixture(scope="module")
def two_graphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """{serve, gpu} first (gpu_y = 2x), then {serve} (y = 3x), one variable w = 2 shared by
    both through the checkpoint."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    base = tmp_path_factory.mktemp("tags") / "model"
    builder = tf1.saved_model.Builder(str(base / "1"))
    for tags, alias, scale in ((["serve", "gpu"], "gpu_y", 0.0), (["serve"], "y", 1.0)):
        with tf.Graph().as_default(), tf1.Session() as session:
            x = tf1.placeholder(tf.float32, [None], name="x")
            w = tf1.get_variable("w", initializer=tf.constant(2.0))
            y = tf.multiply(x, w + scale, name=alias)
            signature = tf1.saved_model.predict_signature_def({"x": x}, {alias: y})
            if alias == "gpu_y":
                session.run(tf1.global_variables_initializer())
                builder.add_meta_graph_and_variables(
                    session, tags, signature_def_map={"serving_default": signature}
                )
            else:
                builder.add_meta_graph(tags, signature_def_map={"serving_default": signature})
    builder.save()
    return base


def test_the_serve_graph_serves_by_default_even_when_a_superset_comes_first(
    two_graphs: Path,
) -> None:
    # Before: the signatures were read from the first MetaGraphDef containing "serve" (gpu's)
    # while TensorFlow loaded {serve}: every Predict failed with KeyError 'gpu_y'.
    runtime = load_saved_model(str(two_graphs / "1"), "tags", 1)
    assert list(runtime.specs["serving_default"].outputs) == ["y"]
    got = runtime.run("serving_default", {"x": X}, ["y"])
    np.testing.assert_allclose(got["y"], 3 * X)


def test_saved_model_tags_pick_another_graph_and_an_unknown_set_is_refused(
    two_graphs: Path,
) -> None:
    runtime = load_saved_model(str(two_graphs / "1"), "tags", 1, tags=["gpu", "serve"])
    assert list(runtime.specs["serving_default"].outputs) == ["gpu_y"]
    np.testing.assert_allclose(runtime.run("serving_default", {"x": X}, ["gpu_y"])["gpu_y"], 2 * X)
    with pytest.raises(ModelLoadError, match=r"no MetaGraphDef with the tag set \['tpu'\]") as info:
        load_saved_model(str(two_graphs / "1"), "tags", 1, tags=["tpu"])
    assert "found tag sets [['gpu', 'serve'], ['serve']]" in str(info.value)
    assert info.value.code is Code.NOT_FOUND  # TF Serving's "Could not find meta graph def"


def test_the_flag_in_both_spellings_and_empty_tags_refused() -> None:
    def tags(*flags: str) -> str:
        return build_parser().parse_args(["start", "--demo", *flags]).saved_model_tags

    assert tags() == "serve"
    assert tags("--saved_model_tags=serve,gpu") == tags("--saved-model-tags", "serve,gpu")
    config = PoolConfig(
        model_name="m", model_base_path="/m", model_version=1, run_dir="/r", log_dir="/l",
        workers=1, saved_model_tags="serve,,gpu",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="none empty, got 'serve,,gpu'"):
        config.validate()


@pytest.fixture(scope="module")
def gpu_graph_pool(tmp_path_factory: pytest.TempPathFactory, two_graphs: Path) -> Iterator[Pool]:
    pool = Pool(tmp_path_factory.mktemp("tags-pool"), two_graphs, 1, "--saved_model_tags=serve,gpu")
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_a_pool_serves_the_graph_its_tags_name(gpu_graph_pool: Pool) -> None:
    import tensorflow as tf
    from tensorflow_serving.apis import (
        get_model_metadata_pb2,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    with gpu_graph_pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(X))
        answer = stub.Predict(request, timeout=30)
        np.testing.assert_allclose(tf.make_ndarray(answer.outputs["gpu_y"]), 2 * X)
        asked = get_model_metadata_pb2.GetModelMetadataRequest()
        asked.model_spec.name = "demo"
        asked.metadata_field.append("signature_def")
        metadata = stub.GetModelMetadata(asked, timeout=30)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signatures)
    assert list(signatures.signature_def["serving_default"].outputs) == ["gpu_y"]
