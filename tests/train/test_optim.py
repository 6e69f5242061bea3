"""The optimizer: the schedule by hand, weight decay on matrices only, frozen routers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.train import step as step_lib
from moejax.train.config import TrainConfig
from moejax.train.optim import (decay_mask, learning_rate_schedule, make_optimizer,
                                router_frozen, router_labels)
from tests.train import helpers


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
  cfg = TrainConfig(steps=110, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
  lr = learning_rate_schedule(cfg)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  # Halfway through the cosine: (1 + cos(pi/2)) / 2 = 0.5 of the way down.
  assert float(lr(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)
  assert float(lr(110)) == pytest.approx(0.1)


def test_weight_decay_applies_to_matrices_only():
  params = {"w": jnp.ones((2, 3)), "experts": jnp.ones((4, 2, 3)), "scale": jnp.ones(3)}
  assert decay_mask(params) == {"w": True, "experts": True, "scale": False}
  cfg = TrainConfig(steps=10, warmup_steps=0, learning_rate=0.1, weight_decay=0.5,
                    grad_clip=0.0, min_lr_ratio=1.0)
  tx = make_optimizer(cfg)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  # With zero gradients AdamW's update is -lr * wd * p on decayed leaves only.
  np.testing.assert_allclose(updates["w"], -0.05)
  np.testing.assert_allclose(updates["experts"], -0.05)
  np.testing.assert_allclose(updates["scale"], 0.0)


def test_router_labels_mark_only_the_moe_routers():
  params = {"blocks": {0: {"ffn": {"params": {"router": {"w": jnp.ones((2, 3))},
                                              "experts": {"w_up": jnp.ones((3, 2, 2))}}},
                           "router": {"kernel": jnp.ones((2, 1))}}}}  # a MoD router
  labels = router_labels(params)
  assert labels["blocks"][0]["ffn"]["params"]["router"]["w"] == "frozen"
  assert labels["blocks"][0]["ffn"]["params"]["experts"]["w_up"] == "train"
  assert labels["blocks"][0]["router"]["kernel"] == "train"


def test_frozen_router_is_bit_identical_after_20_steps_with_weight_decay():
  cfg = helpers.experiment("tiny", model__moe__routing__freeze=True, train__weight_decay=0.5,
                           train__warmup_steps=1)
  tx = make_optimizer(cfg.train, cfg.model)
  graphdef, state = step_lib.init_state(cfg, tx)
  train_step = step_lib.make_train_step(graphdef, cfg, tx)
  rng = np.random.default_rng(0)
  b, s = cfg.data.batch_size, cfg.data.seq_len
  before = jax.tree.map(np.asarray, state.params)
  for _ in range(20):
    tokens = rng.integers(1, 256, size=(b, s + 1))
    state, metrics = train_step(state, {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
                                        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
                                        "mask": jnp.ones((b, s), jnp.float32)})
  assert np.isfinite(float(metrics["loss"]))
  for i in range(cfg.model.n_layers):
    ffn_before = before["blocks"][i]["ffn"]["params"]
    ffn_after = state.params["blocks"][i]["ffn"]["params"]
    np.testing.assert_array_equal(np.asarray(ffn_after["router"]["w"]), ffn_before["router"]["w"])
    # Everything else trains (and decays).
    assert not np.array_equal(np.asarray(ffn_after["experts"]["w_gate_up"]),
                              ffn_before["experts"]["w_gate_up"])
  # Without the freeze the same optimizer moves the router.
  assert not router_frozen(helpers.experiment("tiny").model)
