"""The optimizer: the schedule by hand, weight decay on matrices only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.train.config import TrainConfig
from moejax.train.optim import decay_mask, learning_rate_schedule, make_optimizer


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
