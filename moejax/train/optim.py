"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping.

It is built for the ``nnx.Param`` pytree only. Router state (the
aux-loss-free bias) is a separate pytree that the model's controller updates
after each step; it never reaches this optimizer (DESIGN: a bias trained by
the optimizer is a known bug, MaxText #2494).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from moejax.train.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to peak * min_lr_ratio at steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrices (ndim >= 2), not scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """clip_by_global_norm (if grad_clip > 0), then AdamW on the schedule."""
  adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
