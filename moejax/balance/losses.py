"""Auxiliary balance losses of the control plane, as pure functions.

Legend: T tokens, K slots per token, E experts the loss balances (its
``num_experts``), E_r all router outputs (``probs.shape[-1]``: FFN plus
zero-computation experts), B sequences, S tokens per sequence (T = B S),
D device groups of E / D contiguous experts, M devices a token may reach.

Conventions (all tested with hand-computed numbers):

* The load-balancing loss is returned *without* its coefficient alpha and is
  normalised so that **perfect balance gives exactly 1** in both conventions:
  ``E * sum_i frac_i P_i`` where ``frac_i`` is the fraction of counted items
  landing on expert i and ``P_i`` the mean router probability. It equals 1
  whenever the counts are uniform (any P) or P is uniform (any counts); it is
  at most E. (It is *not* bounded below by 1 for arbitrary routings.)

  - ``switch`` (Switch Transformer eq. 4): items are each token's top-1 slot
    (slot 0, when valid), frac_i = count_i / T.
  - ``topk`` (DeepSeekMoE / DeepSeek-V2 eq. 23-25): items are all valid slots
    and f_i = E / (K T) count_i, the loss being sum_i f_i P_i; this is the same
    number as E * sum_i (count_i / (K T)) P_i. The denominator is the slot
    count K T even when a variable-k router leaves slots invalid, as in the
    paper, so such routers read a proportionally smaller loss.

* Zero-computation experts: a loss only counts slots and probabilities of the
  ids < ``num_experts`` it is given. :func:`balance_losses` balances the
  expert-level loss over *every* router output (E = MoEConfig.num_routed,
  MoE++'s heterogeneous loss with tau = 1), because restricting it to the FFN
  experts would reward moving probability onto the zero-computation experts;
  the device and communication losses cover FFN experts only (only they live
  on devices).

* Scope: with ``axis_names`` (mesh axes, inside ``jax.shard_map``) the counts,
  token counts and probability sums are psum-med over those axes *before* the
  product, so every device returns the loss of the global batch (Qwen's
  LBL+sync, arXiv 2501.11873). Per-token means (z-loss, entropy) stay local:
  their data-parallel average already is the global mean.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import jax
import jax.numpy as jnp

from moejax.balance import stats
from moejax.balance.stats import AxisNames
from moejax.config import AUX_CONVENTIONS, MoEConfig
from moejax.config.registry import BALANCE_LOSSES
from moejax.routing.types import RoutingContext, RoutingResult

LOSS_KEYS = ("aux_loss", "z_loss", "device_loss", "comm_loss", "entropy_loss")


def _check_convention(convention: str) -> None:
  if convention not in AUX_CONVENTIONS:
    raise ValueError(f"convention={convention!r}: unknown load-balance convention. "
                     f"Fix: use one of {', '.join(AUX_CONVENTIONS)}")


def _balance_fractions(result: RoutingResult, convention: str, num_experts: int,
                       axis_names: AxisNames) -> jax.Array:
  """f32[E] frac_i: share of the (global) counted items that went to expert i."""
  if convention == "switch":
    counts = stats.expert_counts(result, num_experts, slots=slice(0, 1))
    items = result.num_tokens
  else:
    counts = stats.expert_counts(result, num_experts)
    items = result.num_tokens * result.k
  counts = stats.psum(counts, axis_names)
  items = stats.psum(jnp.asarray(items, jnp.float32), axis_names)
  return counts / items


def load_balance_loss(result: RoutingResult, *, convention: str, num_experts: int,
                      axis_names: AxisNames = ()) -> jax.Array:
  """f32[] alpha-free load-balancing loss E * sum_i frac_i P_i (1 when balanced).

  Args:
    result: routing of T tokens; reads expert_ids/valid [T, K] and probs [T, E_r].
    convention: ``switch`` (top-1 fractions, Switch Transformer eq. 4-6) or
      ``topk`` (every valid slot, f_i = E/(K T) count_i, DeepSeek-V2 eq. 23-25).
    num_experts: E, the experts balanced; ids >= E and probs[:, E:] are ignored.
    axis_names: mesh axes to reduce the statistics over (global-batch loss).

  The counts carry no gradient; it flows through P_i (mean of probs).
  """
  _check_convention(convention)
  stats.check_num_experts(result, num_experts, "load_balance_loss")
  frac = _balance_fractions(result, convention, num_experts, axis_names)
  p = stats.mean_probs(result, num_experts, axis_names)
  return num_experts * jnp.sum(jax.lax.stop_gradient(frac) * p)


def _per_sequence(result: RoutingResult, batch_shape: tuple[int, int]) -> RoutingResult:
  """The result with every [T, ...] field reshaped to [B, S, ...]."""
  if len(batch_shape) != 2 or any(not isinstance(n, int) or n < 1 for n in batch_shape):
    raise ValueError(f"batch_shape={batch_shape!r}: expected (B, S) positive ints. "
                     "Fix: pass the (batch, sequence length) the T tokens came from")
  b, s = batch_shape
  if b * s != result.num_tokens:
    raise ValueError(f"batch_shape={batch_shape!r}: B*S={b * s} but the routing result "
                     f"has T={result.num_tokens} tokens. Fix: pass the shape the "
                     "tokens were flattened from")
  return jax.tree.map(lambda x: x.reshape((b, s) + x.shape[1:]), result)


def sequence_balance_loss(result: RoutingResult, *, batch_shape: tuple[int, int],
                          convention: str = "topk", num_experts: int,
                          axis_names: AxisNames = ()) -> jax.Array:
  """f32[] DeepSeek-V3's sequence-wise balance loss (alpha-free), mean over sequences.

  DeepSeek-V3 (arXiv 2412.19437, §2.1.2 eq. 17-20) computes the expert-level
  loss inside each sequence of S tokens, with P from the normalised scores
  s'_{i,t} = s_{i,t} / sum_j s_{j,t} (``result.probs`` already holds them),
  and f_i = E / (K S) count_i over that sequence. This is
  :func:`load_balance_loss` applied to each of the B sequences and averaged.
  Tokens are assumed flattened sequence-major (token t = b S + s).
  With axis_names the mean runs over the sequences of the whole mesh.
  """
  _check_convention(convention)
  stats.check_num_experts(result, num_experts, "sequence_balance_loss")
  per_seq = _per_sequence(result, batch_shape)
  losses = jax.vmap(lambda r: load_balance_loss(
      r, convention=convention, num_experts=num_experts))(per_seq)
  return stats.pmean(jnp.mean(losses), axis_names)


def z_loss(logits: jax.Array) -> jax.Array:
  """f32[] router z-loss mean_t (logsumexp_e logits[t, e])^2 (ST-MoE, arXiv 2202.08906 §3.3).

  Args:
    logits: f32[T, E_r] raw router logits (all router outputs).
  """
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.square(lse))


def entropy_loss(probs: jax.Array) -> jax.Array:
  """f32[] mean token entropy -sum_e p log p in nats (top-p routing's sharpening loss).

  Huang et al. (arXiv 2403.07652, their dynamic loss) minimise the entropy of the router
  distribution so dynamic (top-p) routing does not spread over many experts.

  Args:
    probs: f32[T, E_r] router probabilities (rows sum to 1).
  """
  p = probs.astype(jnp.float32)
  # Double where: 0 log 0 = 0 with a finite (zero) gradient at p = 0.
  safe = jnp.where(p > 0, p, 1.0)
  return jnp.mean(-jnp.sum(jnp.where(p > 0, p * jnp.log(safe), 0.0), axis=-1))


def _check_devices(result: RoutingResult, num_experts: int, num_devices: int,
                   where: str) -> None:
  stats.check_num_experts(result, num_experts, where)
  if not isinstance(num_devices, int) or num_devices < 1 or num_experts % num_devices:
    raise ValueError(f"{where}: num_devices={num_devices!r} must be a positive divisor "
                     f"of num_experts={num_experts}. Fix: pick a divisor "
                     "(moe.balance.loss_num_devices)")


def device_balance_loss(result: RoutingResult, *, num_experts: int, num_devices: int,
                        axis_names: AxisNames = ()) -> jax.Array:
  """f32[] DeepSeek-V2's device-level balance loss (alpha-free), 1 when balanced.

  DeepSeek-V2 (arXiv 2405.04434, §2.2.3 eq. 26-28): the E experts are split
  into D contiguous groups E_1..E_D (one per device) and
    L_DevBal = sum_i f'_i P'_i,  f'_i = mean_{j in E_i} f_j,  P'_i = sum_{j in E_i} P_j,
  with the expert-level f_j = E / (K T) count_j over all valid slots (eq. 24)
  and P_j the mean router probability (eq. 25). Only ids < num_experts (FFN
  experts) are counted.
  """
  _check_devices(result, num_experts, num_devices, "device_balance_loss")
  f = num_experts * _balance_fractions(result, "topk", num_experts, axis_names)
  p = stats.mean_probs(result, num_experts, axis_names)
  f_dev = f.reshape(num_devices, -1).mean(axis=-1)
  p_dev = p.reshape(num_devices, -1).sum(axis=-1)
  return jnp.sum(jax.lax.stop_gradient(f_dev) * p_dev)


def comm_balance_loss(result: RoutingResult, *, num_experts: int, num_devices: int,
                      max_devices: int, axis_names: AxisNames = ()) -> jax.Array:
  """f32[] DeepSeek-V2's communication balance loss (alpha-free), 1 when balanced.

  DeepSeek-V2 (arXiv 2405.04434, §2.2.3 eq. 29-31):
    L_CommBal = sum_i f''_i P''_i,
    f''_i = D / (M T) * #{tokens t sent to device i},  P''_i = sum_{j in E_i} P_j,
  where a token is sent to device i when at least one of its valid slots
  picks an expert of group E_i (counted once however many it picks there),
  and M is the most devices a token may reach (device-limited routing's M,
  3 in DeepSeek-V2). When every token reaches M devices uniformly f'' = 1.

  Args:
    max_devices: M in [1, D].
  """
  _check_devices(result, num_experts, num_devices, "comm_balance_loss")
  if not isinstance(max_devices, int) or not 1 <= max_devices <= num_devices:
    raise ValueError(f"comm_balance_loss: max_devices={max_devices!r} must be in "
                     f"[1, num_devices={num_devices}]. Fix: pass device-limited "
                     "routing's M (moe.routing.topk_groups)")
  per_device = num_experts // num_devices
  keep = stats.counted_slots(result, num_experts)
  device = jnp.where(keep, result.expert_ids, 0) // per_device
  hits = jax.nn.one_hot(device, num_devices, dtype=jnp.float32) * keep[..., None]
  sent = jnp.max(hits, axis=1)                                     # [T, D]
  count = stats.psum(jnp.sum(sent, axis=0), axis_names)
  tokens = stats.psum(jnp.asarray(result.num_tokens, jnp.float32), axis_names)
  f2 = num_devices / (max_devices * tokens) * count
  p2 = stats.mean_probs(result, num_experts, axis_names).reshape(num_devices, -1).sum(-1)
  return jnp.sum(jax.lax.stop_gradient(f2) * p2)


def comm_max_devices(cfg: MoEConfig, num_slots: int) -> int:
  """M for :func:`comm_balance_loss` under ``cfg``.

  Device-limited routing's ``topk_groups`` when the router's groups are the
  loss's devices (DeepSeek-V2: n_groups = D = 8, M = 3); otherwise a token can
  reach at most min(K, D) devices.
  """
  d = cfg.balance.loss_num_devices
  if cfg.routing.n_groups > 1 and cfg.routing.n_groups == d:
    return min(cfg.routing.topk_groups, d)
  return min(num_slots, d)


def balance_losses(result: RoutingResult, cfg: MoEConfig, *,
                   batch_shape: tuple[int, int],
                   axis_names: AxisNames = (),
                   context: Optional[RoutingContext] = None,
                   state: Optional[dict] = None) -> dict[str, jax.Array]:
  """Every configured balance loss, each times its coefficient, plus ``total``.

  Keys (always all present, f32[] each, 0 where the coefficient is 0 and the
  loss is then not computed): aux_loss, z_loss, device_loss, comm_loss,
  entropy_loss, the names of ``balance.extra_losses`` (registered losses),
  total.

  * aux_loss: ``cfg.balance.aux_loss_coef`` x the expert-level loss in
    ``aux_loss_convention`` over all E_r router outputs, with scope ``batch``
    (local statistics), ``sequence`` (:func:`sequence_balance_loss` over
    ``batch_shape``) or ``global`` (statistics reduced over ``axis_names``).
  * device_loss / comm_loss: DeepSeek-V2 losses over the FFN experts in
    ``loss_num_devices`` groups; their statistics are global when the scope
    is ``global`` and local otherwise.
  * z_loss, entropy_loss: local per-token means.

  Args:
    result: routing of T = B S tokens, probs [T, E_r] with E_r = cfg.num_routed.
    batch_shape: (B, S) the tokens were flattened from.
    axis_names: mesh axes of the global batch (only used by scope ``global``).
    context: the batch the router decided on (the layer passes its routing
      context). A registered loss whose function has a ``context`` parameter
      receives it (built from ``axis_names`` and ``batch_shape`` with
      train=False when None): the batch's token count, train or eval, and
      sums and means over the whole batch that are exact under expert
      parallelism. Others are called as before.
    state: the layer's idea state ``{idea: {field: value}}``
      (``RouterState.ideas``); a loss whose function has a ``state``
      parameter reads it, without gradient.
  """
  if not isinstance(cfg, MoEConfig):
    raise TypeError(f"balance_losses: cfg must be a MoEConfig, got {type(cfg).__name__}")
  b = cfg.balance
  if result.probs.shape[-1] != cfg.num_routed:
    raise ValueError(
        f"balance_losses: result.probs has {result.probs.shape[-1]} router outputs but "
        f"cfg.num_routed={cfg.num_routed} (num_experts={cfg.num_experts} + "
        f"{cfg.num_zero_compute} zero-computation). Fix: route with the same MoEConfig")
  _per_sequence(result, batch_shape)  # validates batch_shape against T
  zero = jnp.zeros((), jnp.float32)
  out = dict.fromkeys(LOSS_KEYS, zero)
  for name, _ in b.extra_losses:
    out[name] = zero
  # Every loss is a registered BalanceLoss (moejax.balance.rules); one whose
  # coefficient is 0 is not computed.
  for name in out:
    loss = BALANCE_LOSSES.get(name)
    coef = loss.coefficient(b)
    if coef:
      kw = {}
      if _takes(loss.fn, "context"):
        kw["context"] = context or RoutingContext.build(
            result.num_tokens, stats.axes(axis_names), batch_shape=batch_shape)
      if _takes(loss.fn, "state"):
        kw["state"] = jax.tree.map(jax.lax.stop_gradient, dict(state or {}))
      value = loss.fn(result, cfg, batch_shape=batch_shape, axis_names=axis_names, **kw)
      out[name] = coef * jnp.asarray(value, jnp.float32)
  out["total"] = sum(out.values())
  return out


@functools.lru_cache(maxsize=None)
def _takes(fn, name: str) -> bool:
  return name in inspect.signature(fn).parameters
