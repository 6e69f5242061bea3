"""Balance rules as registered objects: losses and bias-controller rules.

Legend: T tokens, E_r router outputs, B sequences, S tokens per sequence.

A balance loss is one function and its registration::

    @register_loss("my_loss")
    def my_loss(result, cfg, *, batch_shape, axis_names):
      return jnp.mean(result.probs.max(-1))     # f32[], before its coefficient

used with ``moe.balance.extra_losses=(("my_loss", 1e-2),)``: the layer adds
coefficient x loss to its ``losses`` (under the loss's name) and to
``total``. A loss that also takes ``context`` receives the layer's
:class:`~moejax.routing.types.RoutingContext`: the batch's token count,
train or eval, and ``context.mean(x)`` / ``context.sum(x)`` over every token
of the batch, exact under expert parallelism (a statistic divided by this
device's token count would be N times off on N devices)::

    @register_loss("kl_uniform")
    def kl_uniform(result, cfg, *, batch_shape, axis_names, context):
      p = context.mean(result.probs)                # f32[E_r], the whole batch's
      return jnp.sum(p * jnp.log(p * p.shape[-1] + 1e-9))

A bias-controller rule is one function of the global load::

    @register_bias_rule("my_rule")
    def my_rule(load, mean, rate):               # f32[E_r], f32[], float
      return rate * jnp.tanh(mean - load)        # the bias change, f32[E_r]

used with ``moe.balance.bias_update='my_rule'``.

Either may declare per-layer state (an EMA, an adaptive coefficient), an
:class:`~moejax.routing.types.IdeaState` passed as ``state=`` to the
decorator: initialised from the config, observed in every forward, updated
once per optimizer step outside the gradient, checkpointed, logged as
``state/<name>/<field>``, and read by a function that takes ``state``::

    def _ema_init(cfg):
      return {"ema": jnp.zeros((cfg.num_routed,), jnp.float32)}

    def _ema_observe(result, cfg, *, state, context):
      return {"load": context.sum(result.mask()), "tokens": context.num_tokens}

    def _ema_update(own, seen, cfg):
      return {"ema": 0.9 * own["ema"] + 0.1 * seen["load"] / seen["tokens"]}

    @register_bias_rule("ema_sign", state=IdeaState(_ema_init, _ema_update, _ema_observe))
    def ema_sign(load, mean, rate, state):
      ema = state["ema_sign"]["ema"]
      return rate * jnp.sign(jnp.mean(ema) - ema)

(``tests/balance/test_stateful_rule.py`` runs it as written;
``tests/plugins/stateful_rule.py`` is it with an update counter added, and
``tests/train/test_idea_state_resume.py`` kills its run and resumes it.)
The shipped losses (whose
coefficients are their own BalanceConfig fields) and rules (``sign``,
``proportional``) are registered here the same way, so there is one path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax.numpy as jnp

from moejax.balance import losses as L
from moejax.balance import stats
from moejax.config.registry import BALANCE_LOSSES, BIAS_RULES
from moejax.routing.types import IdeaState


@dataclasses.dataclass(frozen=True)
class BalanceLoss:
  """fn(result, cfg, *, batch_shape, axis_names) -> f32[] (without its coefficient).

  coef_field: the BalanceConfig field holding a shipped loss's coefficient;
  '' for a plugin loss, whose coefficient comes from ``balance.extra_losses``.
  state: its per-layer :class:`~moejax.routing.types.IdeaState` (None: stateless).
  """

  name: str
  fn: Callable
  coef_field: str = ""
  state: Optional[IdeaState] = None

  def coefficient(self, balance) -> float:
    if self.coef_field:
      return getattr(balance, self.coef_field)
    return dict(balance.extra_losses).get(self.name, 0.0)


@dataclasses.dataclass(frozen=True)
class BiasRule:
  """fn(load f32[E_r], mean f32[], rate) -> bias change f32[E_r] (``state=`` too if it takes it).

  state: its per-layer :class:`~moejax.routing.types.IdeaState` (None: stateless).
  """

  name: str
  fn: Callable
  state: Optional[IdeaState] = None


def register_loss(name: str, coef_field: str = "", *, state: Optional[IdeaState] = None):
  """Decorator: registers ``fn`` as the balance loss ``name`` (a taken name is an error).

  ``state``: the per-layer state the loss declares (read by ``fn`` through
  a ``state`` parameter as ``state[name][field]``).
  """
  def deco(fn):
    # Recorded as coming from fn's module (a plugin's), not from this one.
    BALANCE_LOSSES.register(BalanceLoss(name, fn, coef_field, state), module=fn.__module__)
    return fn
  return deco


def register_bias_rule(name: str, *, state: Optional[IdeaState] = None):
  """Decorator: registers ``fn`` as the bias-controller rule ``name`` (``state``: as above)."""
  def deco(fn):
    BIAS_RULES.register(BiasRule(name, fn, state), module=fn.__module__)
    return fn
  return deco


def _global_axes(cfg, axis_names):
  return stats.axes(axis_names) if cfg.balance.aux_loss_scope == "global" else ()


@register_loss("aux_loss", "aux_loss_coef")
def _aux(result, cfg, *, batch_shape, axis_names):
  b = cfg.balance
  if b.aux_loss_scope == "sequence":
    return L.sequence_balance_loss(result, batch_shape=batch_shape,
                                   convention=b.aux_loss_convention, num_experts=cfg.num_routed)
  return L.load_balance_loss(result, convention=b.aux_loss_convention,
                             num_experts=cfg.num_routed,
                             axis_names=_global_axes(cfg, axis_names))


@register_loss("z_loss", "z_loss_coef")
def _z(result, cfg, *, batch_shape, axis_names):
  return L.z_loss(result.logits)


@register_loss("device_loss", "device_loss_coef")
def _device(result, cfg, *, batch_shape, axis_names):
  return L.device_balance_loss(result, num_experts=cfg.num_experts,
                               num_devices=cfg.balance.loss_num_devices,
                               axis_names=_global_axes(cfg, axis_names))


@register_loss("comm_loss", "comm_loss_coef")
def _comm(result, cfg, *, batch_shape, axis_names):
  return L.comm_balance_loss(result, num_experts=cfg.num_experts,
                             num_devices=cfg.balance.loss_num_devices,
                             max_devices=L.comm_max_devices(cfg, result.k),
                             axis_names=_global_axes(cfg, axis_names))


@register_loss("entropy_loss", "entropy_loss_coef")
def _entropy(result, cfg, *, batch_shape, axis_names):
  return L.entropy_loss(result.probs)


@register_bias_rule("sign")
def _sign(load, mean, rate):
  # Wang et al. Algorithm 1, DeepSeek-V3 §2.1.2: b_i += u sign(mean c - c_i).
  return rate * jnp.sign(mean - load)


@register_bias_rule("proportional")
def _proportional(load, mean, rate):
  # Wang et al. Table 4's variant; no change when nothing was routed.
  safe = jnp.where(mean > 0, mean, 1.0)
  return jnp.where(mean > 0, rate * (mean - load) / safe, 0.0)
