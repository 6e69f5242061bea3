"""Aux-loss-free bias controller (Wang et al. arXiv 2408.15664; DeepSeek-V3).

Legend: E_r router outputs (the bias has one entry per output, FFN and
zero-computation experts alike).

The router selects top-K on score + bias; after each training step the bias
moves every expert toward the mean load of the *global* batch:

* ``sign`` (Wang et al. Algorithm 1, DeepSeek-V3 §2.1.2):
  b_i += u * sign(mean_j c_j - c_i)
* ``proportional`` (Wang et al. Table 4 variant):
  b_i += u * (mean_j c_j - c_i) / mean_j c_j   (no change when nothing is routed)

u is ``BalanceConfig.bias_rate`` (DeepSeek-V3's gamma = 1e-3). The bias is
state, not a parameter: inputs are wrapped in ``stop_gradient`` and the
function is meant to run outside the differentiated loss, on the psum-med
load (:func:`moejax.balance.metrics.expert_load` with the data/expert axes).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from moejax.config import BalanceConfig
from moejax.config.registry import BIAS_RULES
from moejax.routing.types import RouterState


def update_bias(state: RouterState, load: jax.Array, cfg: BalanceConfig) -> RouterState:
  """One controller step: the new RouterState after observing ``load``.

  Args:
    state: bias f32[E_r] and step int32[].
    load: f32[E_r] token copies per router output over the global batch.
    cfg: ``bias_update`` none or a registered rule (sign, proportional, ...), ``bias_rate`` u,
      ``bias_freeze_step`` (-1 never; else no change once state.step >= it).

  Returns:
    ``state`` itself for ``none``; otherwise the updated bias and step + 1.
    The step counts controller calls, frozen ones included, so a freeze
    schedule is a function of the training step.
  """
  if not isinstance(cfg, BalanceConfig):
    raise TypeError(f"update_bias: cfg must be a BalanceConfig, got {type(cfg).__name__}")
  if cfg.bias_update == "none":
    return state
  if load.shape != state.bias.shape:
    raise ValueError(
        f"update_bias: load has shape {load.shape} but state.bias has {state.bias.shape}. "
        "Fix: pass the load over every router output, e.g. expert_load(result, "
        "num_experts=cfg.num_routed, axis_names=...)")
  load = jax.lax.stop_gradient(load).astype(jnp.float32)
  bias = jax.lax.stop_gradient(state.bias)
  mean = jnp.mean(load)
  # The rule is a registered BiasRule (moejax.balance.rules): sign, proportional, a plugin's.
  fn = BIAS_RULES.get(cfg.bias_update).fn
  # A stateful rule (one with a ``state`` parameter) reads its layer's idea state.
  kw = ({"state": jax.tree.map(jax.lax.stop_gradient, dict(state.ideas))}
        if "state" in inspect.signature(fn).parameters else {})
  delta = fn(load, mean, cfg.bias_rate, **kw)
  if cfg.bias_freeze_step >= 0:
    delta = jnp.where(state.step >= cfg.bias_freeze_step, 0.0, delta)
  return state.replace(bias=(bias + delta).astype(state.bias.dtype), step=state.step + 1)
