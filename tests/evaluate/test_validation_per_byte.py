"""Validation loss per byte: total nats over the bytes the scored targets stand for."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.config import ModelConfig
from tests.configs import moe_config
from moejax.evaluate.validation import evaluate, make_eval_step
from moejax.model import Transformer
from moejax.train.step import split_model

V = 8


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, dense_ff_width=32,
                    moe=moe_config(num_experts=4, expert_width=16, routing=dict(top_k=2)))
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params, router_state, other = split_model(model)
  step = make_eval_step(graphdef, cfg, num_domains=2)
  return model, step, (params, router_state, other)


def _batch(target_bytes=None):
  batch = {
      "inputs": np.array([[0, 3, 5, 1], [0, 2, 7, 7]], np.int32),
      "targets": np.array([[3, 5, 1, 6], [2, 7, 0, 0]], np.int32),
      "labels": np.array([[0, 0, 1, 1], [1, 1, 0, 0]], np.int32),
      "mask": np.array([[True] * 4, [True, True, False, False]]),
  }
  if target_bytes is not None:
    batch["target_bytes"] = np.asarray(target_bytes, np.int32)
  return batch


def _ce(model, batch) -> np.ndarray:
  """f64[B, S] cross-entropy of each target, by hand from the model's logits."""
  logits, _ = model(batch["inputs"], train=False)
  logp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
  return -np.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]


def test_loss_per_byte_on_a_handmade_batch(tiny):
  model, step, state = tiny
  # Padding (mask False) carries bytes here on purpose: they must not count.
  batch = _batch([[1, 3, 2, 4], [2, 1, 9, 9]])
  ce = _ce(model, batch)
  nats = (ce * batch["mask"]).sum()
  out = evaluate(step, *state, [batch, batch])  # two batches: sums add up
  assert out["tokens"] == 2 * 6 and out["bytes"] == 2 * (1 + 3 + 2 + 4 + 2 + 1)
  np.testing.assert_allclose(out["loss"], nats / 6, rtol=1e-5)
  np.testing.assert_allclose(out["loss_per_byte"], nats / 13, rtol=1e-5)
  np.testing.assert_allclose(out["bits_per_byte"], nats / 13 / np.log(2), rtol=1e-5)


def test_byte_level_loss_per_byte_equals_loss(tiny):
  _, step, state = tiny
  ones = _batch().get("mask").astype(np.int32)
  for batch in (_batch(ones), _batch()):  # one byte per target, given or implied
    out = evaluate(step, *state, [batch])
    assert out["bytes"] == out["tokens"] == 6
    assert out["loss_per_byte"] == out["loss"]
