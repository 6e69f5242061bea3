"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping.

It is built for the ``nnx.Param`` pytree only. Router state (the
aux-loss-free bias) is a separate pytree that the model's controller updates
after each step; it never reaches this optimizer (a bias trained by the
optimizer is a known bug, MaxText #2494).

A frozen router (``model.moe.routing.freeze``) gets no gradient (the router
stops it), and is also masked out of the optimizer here
(``optax.multi_transform`` with ``set_to_zero``): AdamW's decoupled weight
decay would otherwise still shrink it by ``lr * weight_decay`` every step.
Its weights (and a Soft MoE router's) then stay bit-identical.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax

from moejax.config import ModelConfig
from moejax.train.config import TrainConfig

# Where the freeze switch lives in a ModelConfig, and where the router params
# live in the params tree: the MoE layer's params dict ("params") holds a
# "router" subtree (moejax.nn.moe_block.MoEFFN). Mixture-of-depths routers
# (an attribute "router" of the MoD block, not under "params") are not MoE
# routers and stay trainable.
_FREEZE_FIELD = ("moe", "routing", "freeze")
_ROUTER_KEYS = ("params", "router")


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to peak * min_lr_ratio at steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrices (ndim >= 2), not scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def router_frozen(model: Optional[ModelConfig]) -> bool:
  value = model
  for name in _FREEZE_FIELD:
    value = getattr(value, name, None) if value is not None else None
  return bool(value)


def _key_name(k) -> str:
  return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def router_labels(params: Any) -> Any:
  """'frozen' for the leaves of every MoE layer's router subtree, 'train' elsewhere."""
  def label(path, _):
    keys = [_key_name(k) for k in path]
    inside = any(tuple(keys[i:i + 2]) == _ROUTER_KEYS for i in range(len(keys) - 1))
    return "frozen" if inside else "train"
  return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: TrainConfig,
                   model: Optional[ModelConfig] = None) -> optax.GradientTransformation:
  """clip_by_global_norm (if grad_clip > 0), then AdamW on the schedule.

  ``model``: the run's model config; with a frozen router its params are
  masked out of the whole chain (no update, no weight decay). The optimizer
  state has the masked structure then, so restoring a run needs the same
  ``model`` here.
  """
  adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  tx = adamw
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  if router_frozen(model):
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, router_labels)
  return tx
