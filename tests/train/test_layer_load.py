"""Per-layer MaxVio, dead experts and load histograms of the logged window."""

from __future__ import annotations

import glob
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.balance.aux import LayerMetrics
from moejax.train import layer_load, metrics_log
from moejax.train import step as step_lib


def test_a_steps_load_vectors_become_one_float_per_expert():
  row = layer_load.host_row({"loss": np.float32(1.5),
                             "load/layer_1": np.array([2.0, 0.0, 1.0], np.float32)})
  assert row == {"loss": 1.5, "load/layer_1/0": 2.0, "load/layer_1/1": 0.0,
                 "load/layer_1/2": 1.0}
  with pytest.raises(ValueError, match=r"'coactivation' has shape \(2, 2\)"):
    layer_load.host_row({"coactivation": np.zeros((2, 2))})


def test_dead_experts_are_those_without_a_token_in_the_whole_window():
  # Two steps: layer_0 loads [3, 0, 1, 0] then [1, 0, 0, 2]; only expert 1 never got one.
  # layer_10 sorts after layer_2 (natural order), and is all dead.
  steps = [{"loss": 2.0, **layer_load.host_row({"load/layer_0": np.array([3., 0., 1., 0.]),
                                                "load/layer_10": np.zeros(2),
                                                "load/layer_2": np.array([1., 1.])})},
           {"loss": 4.0, **layer_load.host_row({"load/layer_0": np.array([1., 0., 0., 2.]),
                                                "load/layer_10": np.zeros(2),
                                                "load/layer_2": np.array([0., 2.])})}]
  mean = {k: float(np.mean([s[k] for s in steps])) for k in steps[0]}
  row, loads = layer_load.summarise(mean)
  assert row == {"loss": 3.0, "dead_experts/layer_0": 1.0, "dead_experts/layer_2": 0.0,
                 "dead_experts/layer_10": 2.0, "dead_experts": 3.0}
  assert list(loads) == ["layer_0", "layer_2", "layer_10"]
  np.testing.assert_array_equal(loads["layer_0"], [2.0, 0.0, 0.5, 1.0])
  # Relative to the layer's mean load 0.875.
  np.testing.assert_allclose(layer_load.relative(loads["layer_0"]), [16 / 7, 0.0, 4 / 7, 8 / 7])
  np.testing.assert_array_equal(layer_load.relative(np.zeros(3)), np.zeros(3))
  assert layer_load.summarise({"loss": 1.0}) == ({"loss": 1.0}, {})  # a dense model


def test_the_step_reports_each_layers_max_vio_and_load():
  load = jnp.array([4.0, 0.0, 2.0, 2.0])
  aux = {"moe": {"layer_1": {"metrics": LayerMetrics(load=load, max_vio=jnp.float32(1.0))},
                 "layer_3": {"metrics": LayerMetrics(max_vio=jnp.float32(0.5))}}}  # PEER
  out = step_lib.layer_loads(aux)
  assert sorted(out) == ["load/layer_1", "max_vio_batch/layer_1", "max_vio_batch/layer_3"]
  np.testing.assert_array_equal(out["load/layer_1"], load)


def _histogram_tags(tb_dir: str) -> set[str]:
  """Tags of the histogram summaries in the tensorboardX event files (TFRecord framing)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  tags = set()
  for path in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
      at += 12 + n + 4
      tags.update(v.tag for v in event.summary.value if v.HasField("histo"))
  return tags


def test_train_rows_have_per_layer_max_vio_and_dead_experts_and_tensorboard_histograms(
    tiny_run):
  _, workdir, _, _ = tiny_run
  rows = metrics_log.read_metrics(workdir, "train")
  for row in rows:
    per_layer = [row["max_vio_batch/layer_0"], row["max_vio_batch/layer_1"]]
    # The layer-averaged series is the mean of the two (every MoE layer has a load).
    assert row["max_vio_batch"] == pytest.approx(np.mean(per_layer), rel=1e-6)
    for layer in ("layer_0", "layer_1"):
      assert row[f"dead_experts/{layer}"] in (0.0, 1.0, 2.0, 3.0, 4.0)
    assert row["dead_experts"] == row["dead_experts/layer_0"] + row["dead_experts/layer_1"]
    assert not any(k.startswith("load/") for k in row)  # loads go to TensorBoard only
  assert _histogram_tags(os.path.join(workdir, metrics_log.TENSORBOARD_DIR)) == {
      "train/load/layer_0", "train/load/layer_1"}
