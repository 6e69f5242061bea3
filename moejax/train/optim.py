"""The optimizer: ``train.optimizer`` (AdamW by default, or Muon; :mod:`moejax.train.optimizers`)
on the warmup + cosine schedule, with global-norm clipping and frozen parameters masked out.

It is built for the ``nnx.Param`` pytree only. Router state (the
aux-loss-free bias) is a separate pytree that the model's controller updates
after each step; it never reaches this optimizer (a bias trained by the
optimizer is a known bug, MaxText #2494).

Frozen parameters are masked out of the optimizer (``optax.multi_transform``
with ``set_to_zero``): AdamW's decoupled weight decay would otherwise still
shrink them by ``lr * weight_decay`` every step. They then stay
bit-identical, and the train step zeroes their gradients
(:func:`frozen_gradients`), so they neither count in the gradient norm nor
cost a weight gradient. What is frozen, by the components of
:func:`moejax.config.finetune.component`:

- the MoE routers of a model with ``model.moe.routing.freeze`` (the router
  also stops its own gradient, and its bias controller stops);
- for a fine-tuning run, the components of ``finetune.freeze`` and the base
  weights of the ``finetune.lora`` targets (their adapters train).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax.tree_util import keystr
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.config import ModelConfig
from moejax.config.finetune import FinetuneConfig, component
from moejax.model import Transformer, param_role_tree
from moejax.nn import adapters as adapters_lib
from moejax.train import optimizers
from moejax.train.config import TrainConfig

# Where the freeze switch lives in a ModelConfig. The router params live in
# the params tree under a MoE layer's params dict ("params") as a "router"
# subtree (moejax.nn.moe_block.MoEFFN); mixture-of-depths routers (an
# attribute "router" of the MoD block, not under "params") are not MoE
# routers: component 'mod'.
_FREEZE_FIELD = ("moe", "routing", "freeze")


decay_mask = optimizers.decay_mask


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to peak * min_lr_ratio at steps."""
  return optimizers.schedule(cfg)


def role_lookup(model: ModelConfig, finetune: Optional[FinetuneConfig] = None):
  """``keys -> ParamRole`` of the params of ``model`` (with ``finetune``'s LoRA adapters):
  what each component declares (:func:`moejax.model.param_role_tree`), read off an
  abstract model (no array is allocated)."""
  def build():
    m = Transformer(model, rngs=nnx.Rngs(0))
    if finetune is not None and finetune.lora:
      adapters_lib.attach(m, finetune.lora, finetune.lora_rank, finetune.lora_scale,
                          jax.random.key(0))
    return m
  tree = param_role_tree(nnx.eval_shape(build))
  table = {optimizers.path_keys(path): role
           for path, role in jax.tree_util.tree_leaves_with_path(tree)}

  def role_at(keys: tuple):
    if keys not in table:
      raise KeyError(f"no parameter at {'/'.join(map(str, keys))} in the model the optimizer "
                     "was built for. Fix: build the optimizer with the run's model and "
                     "finetune configs")
    return table[keys]
  return role_at


def router_frozen(model: Optional[ModelConfig]) -> bool:
  value = model
  for name in _FREEZE_FIELD:
    value = getattr(value, name, None) if value is not None else None
  return bool(value)


def frozen_components(model: Optional[ModelConfig],
                      finetune: Optional[FinetuneConfig] = None) -> frozenset:
  """The components (:func:`moejax.config.finetune.component`) that do not train."""
  out = set()
  if router_frozen(model):
    out.add("router")
  if finetune is not None and finetune.enabled:
    out |= finetune.frozen_components(model)
  return frozenset(out)


def trainable_labels(params: Any, frozen) -> Any:
  """'frozen' for the leaves of the ``frozen`` components, 'train' elsewhere."""
  frozen = frozenset(frozen)

  def label(path, _):
    return "frozen" if component([keystr((k,), simple=True) for k in path]) in frozen else "train"
  return jax.tree_util.tree_map_with_path(label, params)


def router_labels(params: Any) -> Any:
  """'frozen' for the leaves of every MoE layer's router subtree, 'train' elsewhere."""
  return trainable_labels(params, {"router"})


def frozen_gradients(model: Optional[ModelConfig],
                     finetune: Optional[FinetuneConfig] = None):
  """``grads -> grads`` with zeros (not depending on the gradient) on frozen leaves.

  XLA then never computes a frozen weight's gradient, and the logged
  gradient norm is that of what trains. The identity when nothing is frozen.
  """
  frozen = frozen_components(model, finetune)
  if not frozen:
    return lambda grads: grads

  def mask(grads):
    labels = trainable_labels(grads, frozen)
    return jax.tree.map(lambda g, lab: jnp.zeros_like(g) if lab == "frozen" else g,
                        grads, labels)
  return mask


def make_optimizer(cfg: TrainConfig, model: Optional[ModelConfig] = None,
                   finetune: Optional[FinetuneConfig] = None) -> optax.GradientTransformation:
  """clip_by_global_norm (if grad_clip > 0), then ``train.optimizer`` on the schedule.

  ``model`` / ``finetune``: the run's model and fine-tuning configs; frozen
  parameters (see the module docstring) are masked out of the whole chain
  (no update, no weight decay, no moments). The optimizer state has the
  masked structure then, so restoring a run needs the same configs here.
  An optimizer that reads the parameters' roles (Muon) needs ``model``.
  """
  spec = cfg.optimizer_spec
  role_at = None
  if spec.needs_roles and model is not None:
    role_at = role_lookup(model, finetune)
  rule = spec.transform(cfg, role_at)
  tx = rule
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), rule)
  frozen = frozen_components(model, finetune)
  if frozen:
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                               lambda params: trainable_labels(params, frozen))
  return tx
