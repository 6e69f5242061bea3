"""The FFN of token copies grouped by expert: dispatch, expert FFN, combine.

Legend: T tokens, d model width, K slots per token, E FFN experts, f expert
hidden width, M = T * K token copies.

    y[t] = sum_{k : valid, id < E} weights[t, k] * FFN_{id[t, k]}(x[t])

Zero-computation experts (ids >= E) and invalid slots are excluded here; the
layer adds the zero-computation outputs itself. Expert parameters follow the
topology contract (``moejax.topology.experts``):

* swiglu: ``{'w_gate_up': [E, d, 2f], 'w_down': [E, f, d]}``, with
  [w_gate | w_up] side by side in ``w_gate_up``,
  FFN(x) = (silu(x w_gate) * (x w_up)) w_down: one [*, 2f] matmul whose
  output is split into its halves;
* gelu: ``{'w_up': [E, d, f], 'w_down': [E, f, d]}``,
  FFN(x) = gelu(x w_up) w_down with ``jax.nn.gelu``'s default tanh
  approximation (``approximate=True``);
* heterogeneous widths are zero-padded to f; ``width_mask`` f32[E, f] zeroes
  the padded hidden units.

The width mask multiplies the rows of ``w_down`` instead of the [M, f] hidden
activations: since h only feeds w_down, the output and every gradient are the
same as masking h, at E*f*d instead of M*f work.

:func:`routed_ffn` is the single entry point (the layer and the
expert-parallel path call it): it folds the width mask, builds the dropless
layout and asks the backend object which path it has, in this order:

1. ``Backend.fused_ffn`` (``blocked``): gather, three matmuls and combine in
   one tile loop (:mod:`moejax.execution.fused`);
2. ``Backend.folds_permute`` (``blocked``, ``pallas_tpu``, ``pallas_gpu``):
   the composed path with the dispatch folded into the matmuls
   (:mod:`moejax.execution.folded_gmm`): gate / up gather x's rows in their tile loads, down scatter-adds its rows
   times the combine weight into [T, d] in its stores; no [M, d] permuted
   copy, no unpermute pass;
3. otherwise permute -> three grouped matmuls -> unpermute.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from moejax.execution import folded_gmm
from moejax.execution import gmm as gmm_lib
from moejax.execution import permute as permute_lib
from moejax.execution import scopes
from moejax.execution import shape_choice
from moejax.routing.types import RoutingResult
from moejax.topology import experts as experts_lib

ACTIVATION_KEYS = {act: (key, "w_down") for act, key in experts_lib.FIRST_LAYER.items()}


def _check_params(params: Mapping[str, Any], d: int, num_experts: int,
                  activation: str, width_mask) -> int:
  if activation not in ACTIVATION_KEYS:
    raise ValueError(f"activation={activation!r} is unknown. Fix: use one of "
                     f"{', '.join(ACTIVATION_KEYS)}")
  need = ACTIVATION_KEYS[activation]
  missing = [key for key in need if key not in params]
  if missing:
    fix = ("moejax.topology.experts.fused_layout(params) joins separate 'w_gate' / 'w_up' "
           "stacks" if "w_gate" in params else "build them with moejax.topology.experts "
           "for the same activation")
    raise ValueError(f"expert params lack {missing} for activation={activation!r} "
                     f"(have {sorted(params)}). Fix: {fix}")
  f = experts_lib.hidden_width(params)
  for key in need:
    width = 2 * f if key == experts_lib.GATE_UP else f
    want = (num_experts, f, d) if key == "w_down" else (num_experts, d, width)
    if params[key].shape != want:
      raise ValueError(f"expert params[{key!r}] has shape {params[key].shape}, expected "
                       f"{want} (E={num_experts}, d={d}, f={f}). Fix: pass "
                       "num_experts = the FFN experts and x of width d")
  if width_mask is not None and width_mask.shape != (num_experts, f):
    raise ValueError(f"width_mask has shape {width_mask.shape}, expected [E, f]="
                     f"{(num_experts, f)}")
  return f


def fold_width_mask(params: Mapping[str, jax.Array],
                    width_mask: Optional[jax.Array]) -> dict:
  """The expert params with ``width_mask`` [E, f] folded into the rows of w_down.

  h only feeds w_down, so zeroing w_down's rows of padded hidden units gives
  the same outputs and gradients as masking h, at E*f*d instead of M*f work.
  """
  params = dict(params)
  if width_mask is not None:
    params["w_down"] = params["w_down"] * width_mask[:, :, None].astype(params["w_down"].dtype)
  return params


@jax.named_scope(scopes.EXPERT_FFN)
def _ffn_rows(params: Mapping[str, jax.Array], xs: jax.Array, group_sizes: jax.Array, *,
              activation: str, backend: str, interpret: bool, **options) -> jax.Array:
  """ys[M, d] = FFN_e(xs[r]) for the rows of each expert group (rest 0).

  xs[M, d] is sorted by expert with ``group_sizes`` int32[E] rows each; the
  width mask is already folded into ``params``.
  """
  kw = dict(backend=backend, interpret=interpret, **options)
  if activation == "swiglu":  # one [M, 2f] grouped matmul, split into gate and up
    a, b = experts_lib.split_gate_up(
        gmm_lib.gmm(xs, params[experts_lib.GATE_UP], group_sizes, **kw))
    h = jax.nn.silu(a) * b
  else:
    h = jax.nn.gelu(gmm_lib.gmm(xs, params["w_up"], group_sizes, **kw))
  return gmm_lib.gmm(h.astype(xs.dtype), params["w_down"], group_sizes, **kw)


@jax.named_scope(scopes.EXPERT_FFN)
def _ffn_folded(params: Mapping[str, jax.Array], x: jax.Array, plan: permute_lib.Dispatch,
                weights: jax.Array, *, activation: str, backend: str, interpret: bool,
                **options) -> jax.Array:
  """y[T, d]: the composed FFN with the permutation in the matmuls' row loads and stores.

  x [T, d] is gathered by ``plan.src_token`` inside the gate / up tile loads;
  the activation runs on the [M, f] rows; the down matmul scatter-adds
  ``w_rows[r] * h[r] @ w_down[e]`` into [T, d] (float32, one rounding), so
  neither an [M, d] input copy nor an [M, d] output is written.
  """
  kw = dict(backend=backend, interpret=interpret, **options)
  tok, gs = plan.src_token, plan.group_sizes
  if activation == "swiglu":  # one gathered [M, 2f] matmul, split into gate and up
    a, b = experts_lib.split_gate_up(
        folded_gmm.gather_gmm(x, tok, params[experts_lib.GATE_UP], gs, **kw))
    h = jax.nn.silu(a) * b
  else:
    h = jax.nn.gelu(folded_gmm.gather_gmm(x, tok, params["w_up"], gs, **kw))
  w_rows = jnp.take(weights.reshape(-1), plan.src_slot, mode="fill", fill_value=0)
  return folded_gmm.scatter_gmm(h.astype(x.dtype), params["w_down"], gs, tok, w_rows,
                                x.shape[0], **kw)


def routed_ffn(expert_params: Mapping[str, jax.Array], x: jax.Array,
               expert_ids: jax.Array, valid: jax.Array, weights: jax.Array, *,
               num_experts: int, activation: str,
               backend: str = gmm_lib.DEFAULT_BACKEND,
               width_mask: Optional[jax.Array] = None,
               interpret: bool = False, gather_backend: str = "xla",
               fused: bool = True, fold_permute: bool = True,
               rule: Optional[shape_choice.ShapeRule] = None,
               **options) -> jax.Array:
  """y[T, d] = sum_{k: valid, id < E} weights[t, k] FFN_{id[t, k]}(x[t]), dropless.

  The one place that folds the width mask and picks the fused or the
  composed path; the layer (through :func:`routed_experts`) and the
  expert-parallel path (rows received from other devices, K = 1) both call
  it.

  Args:
    expert_params: the topology's expert pytree (see module docstring).
    x: [T, d] tokens (or received rows).
    expert_ids: int32[T, K]; ids >= num_experts (zero-computation experts)
      and slots with ``valid`` False get no row and contribute 0.
    valid: bool[T, K].
    weights: [T, K] gate weights (the combine weights of the slots).
    num_experts: E, the FFN experts.
    activation: ``swiglu`` or ``gelu``.
    backend: grouped-matmul backend (``moejax.execution.registry.GMM_BACKENDS``);
      ``blocked`` is the fast default.
    width_mask: optional f32[E, f] hidden-unit mask (heterogeneous widths).
    interpret: run Pallas backends in interpret mode (tests).
    gather_backend: the permutation gather (``registry.GATHER_BACKENDS``).
    fused: with the ``xla`` gather, run the backend's ``fused_ffn`` when it
      has one (``blocked``: :mod:`moejax.execution.fused`; default); False
      takes the composed path.
    fold_permute: on the composed path with the ``xla`` gather, fold the
      gather and the combine into the grouped matmuls when the backend
      ``folds_permute`` (default); False keeps permute -> three ``gmm``
      calls -> unpermute (for comparison). A Pallas ``gather_backend`` always
      gets its explicit permute: the folded loads are XLA gathers.
    rule: the shape rule (:class:`moejax.execution.shape_choice.ShapeRule`)
      that picks the backend for this call's shape instead of ``backend``
      (its own ``backend`` for small groups); each distinct decision is
      reported once.
    **options: backend tiling knobs (``tile_m``, ``tile_small`` for blocked,
      ``tiling`` for the Pallas kernels).
  """
  if rule is not None:
    backend = shape_choice.choose(rule, x.shape[0], expert_ids.shape[-1], num_experts,
                                  x.shape[-1], experts_lib.hidden_width(expert_params))
  if backend == "reference":
    raise ValueError("backend='reference' is the layer's own per-expert loop "
                     "(moejax.layer with cfg.execution.backend='reference'). Fix: pick one of "
                     f"{', '.join(gmm_lib.backend_names())} here")
  be = gmm_lib.check_available(backend, interpret)
  if x.ndim != 2:
    raise ValueError(f"x must be [T, d], got {x.shape}; flatten batch and sequence first")
  if expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"routing covers {expert_ids.shape[0]} tokens but x has {x.shape[0]}")
  if weights.shape != expert_ids.shape:
    raise ValueError(f"weights {weights.shape} must match expert_ids {expert_ids.shape} "
                     "([T, K])")
  _check_params(expert_params, x.shape[1], num_experts, activation, width_mask)
  plan = permute_lib.sort_by_expert(expert_ids, valid, num_experts)
  weights = jnp.where(valid, weights, 0)
  params = fold_width_mask(expert_params, width_mask)
  foldable = permute_lib.get_gather(gather_backend, interpret).foldable
  if fused and foldable and be.fused_ffn is not None:
    with jax.named_scope(scopes.EXPERT_FFN):  # gather, matmuls and combine in one tile loop
      return be.fused_ffn(params, x, weights.astype(jnp.float32), plan,
                          activation=activation, **options).astype(x.dtype)
  if fold_permute and foldable and be.folds_permute:
    return _ffn_folded(params, x, plan, weights, activation=activation, backend=backend,
                       interpret=interpret, **options).astype(x.dtype)
  gkw = dict(backend=gather_backend, interpret=interpret)
  xs = permute_lib.permute(x, plan, **gkw)
  ys = _ffn_rows(params, xs, plan.group_sizes,
                 activation=activation, backend=backend, interpret=interpret, **options)
  return permute_lib.unpermute(ys, plan, weights, **gkw).astype(x.dtype)


def routed_experts(expert_params: Mapping[str, jax.Array], x: jax.Array,
                   result: RoutingResult, **kwargs) -> jax.Array:
  """:func:`routed_ffn` for a router's decision (``expert_ids``, ``valid``,
  ``weights`` [T, K] of ``result``); same keyword arguments."""
  return routed_ffn(expert_params, x, result.expert_ids, result.valid, result.weights,
                    **kwargs)
