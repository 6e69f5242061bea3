"""The routed-expert computation of an MoE layer: dispatch, FFN, combine.

Legend: T tokens, d model width, K slots per token, E FFN experts, f expert
hidden width, M = T * K token copies.

    y[t] = sum_{k : valid, id < E} weights[t, k] * FFN_{id[t, k]}(x[t])

Zero-computation experts (ids >= E) and invalid slots are excluded here; the
layer adds the zero-computation outputs itself. Expert parameters follow the
topology contract (``moejax.topology.experts``):

* swiglu: ``{'w_gate': [E, d, f], 'w_up': [E, d, f], 'w_down': [E, f, d]}``,
  FFN(x) = (silu(x w_gate) * (x w_up)) w_down;
* gelu: ``{'w_up': [E, d, f], 'w_down': [E, f, d]}``,
  FFN(x) = gelu(x w_up) w_down with ``jax.nn.gelu``'s default tanh
  approximation (``approximate=True``);
* heterogeneous widths are zero-padded to f; ``width_mask`` f32[E, f] zeroes
  the padded hidden units.

The width mask multiplies the rows of ``w_down`` instead of the [M, f] hidden
activations: since h only feeds w_down, the output and every gradient are the
same as masking h, at E*f*d instead of M*f work.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from moejax.execution import fused as fused_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import permute as permute_lib
from moejax.routing.types import RoutingResult

ACTIVATION_KEYS = {"swiglu": ("w_gate", "w_up", "w_down"),
                   "gelu": ("w_up", "w_down")}


def _check_params(params: Mapping[str, Any], d: int, num_experts: int,
                  activation: str, width_mask) -> int:
  if activation not in ACTIVATION_KEYS:
    raise ValueError(f"activation={activation!r} is unknown. Fix: use one of "
                     f"{', '.join(ACTIVATION_KEYS)}")
  need = ACTIVATION_KEYS[activation]
  missing = [key for key in need if key not in params]
  if missing:
    raise ValueError(f"expert params lack {missing} for activation={activation!r} "
                     f"(have {sorted(params)}). Fix: build them with "
                     "moejax.topology.experts for the same activation")
  e, dd, f = params["w_up"].shape
  for key in need:
    want = (num_experts, f, d) if key == "w_down" else (num_experts, d, f)
    if params[key].shape != want:
      raise ValueError(f"expert params[{key!r}] has shape {params[key].shape}, expected "
                       f"{want} (E={num_experts}, d={d}, f={f}). Fix: pass "
                       "num_experts = the FFN experts and x of width d")
  if width_mask is not None and width_mask.shape != (num_experts, f):
    raise ValueError(f"width_mask has shape {width_mask.shape}, expected [E, f]="
                     f"{(num_experts, f)}")
  return f


def expert_ffn_rows(params: Mapping[str, jax.Array], xs: jax.Array,
                    group_sizes: jax.Array, *, activation: str,
                    backend: str = gmm_lib.DEFAULT_BACKEND,
                    width_mask: Optional[jax.Array] = None,
                    interpret: bool = False, **options) -> jax.Array:
  """ys[M, d] = FFN_e(xs[r]) for the rows of each expert group (rest 0).

  xs[M, d] is sorted by expert with ``group_sizes`` int32[E] rows each.
  """
  kw = dict(backend=backend, interpret=interpret, **options)
  w_down = params["w_down"]
  if width_mask is not None:
    w_down = w_down * width_mask[:, :, None].astype(w_down.dtype)
  if activation == "swiglu":
    h = (jax.nn.silu(gmm_lib.gmm(xs, params["w_gate"], group_sizes, **kw))
         * gmm_lib.gmm(xs, params["w_up"], group_sizes, **kw))
  else:
    h = jax.nn.gelu(gmm_lib.gmm(xs, params["w_up"], group_sizes, **kw))
  return gmm_lib.gmm(h.astype(xs.dtype), w_down, group_sizes, **kw)


def routed_experts(expert_params: Mapping[str, jax.Array], x: jax.Array,
                   result: RoutingResult, *, num_experts: int, activation: str,
                   backend: str = gmm_lib.DEFAULT_BACKEND,
                   width_mask: Optional[jax.Array] = None,
                   interpret: bool = False, gather_backend: str = "xla",
                   fused: bool = True, **options) -> jax.Array:
  """y[T, d]: the gate-weighted sum of the routed FFN experts (dropless).

  Args:
    expert_params: the topology's expert pytree (see module docstring).
    x: [T, d] tokens.
    result: the router's decision; ``expert_ids``/``weights``/``valid`` [T, K].
    num_experts: E, the FFN experts (ids >= E are zero-computation experts,
      excluded here).
    activation: ``swiglu`` or ``gelu``.
    backend: grouped-matmul backend (``moejax.execution.gmm.BACKENDS``);
      ``blocked`` is the fast default.
    width_mask: optional f32[E, f] hidden-unit mask (heterogeneous widths).
    interpret: run Pallas backends in interpret mode (tests).
    gather_backend: the permutation gather (``xla`` or ``pallas_tpu``).
    fused: with ``backend='blocked'``, run the fused tile loop of
      :mod:`moejax.execution.fused` (default); False composes permute, three
      ``gmm`` calls and unpermute like the other backends.
    **options: backend tiling knobs, passed to :func:`gmm_lib.gmm`.
  """
  if backend == "reference":
    raise ValueError("backend='reference' is the layer's own per-expert loop "
                     "(moejax.layer with cfg.execution.backend='reference'). Fix: pick one of "
                     f"{', '.join(gmm_lib.BACKENDS)} here")
  gmm_lib.check_available(backend, interpret)
  if x.ndim != 2:
    raise ValueError(f"x must be [T, d], got {x.shape}; flatten batch and sequence first")
  if result.expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"routing result covers {result.expert_ids.shape[0]} tokens but x "
                     f"has {x.shape[0]}")
  _check_params(expert_params, x.shape[1], num_experts, activation, width_mask)
  plan = permute_lib.sort_by_expert(result.expert_ids, result.valid, num_experts)
  weights = jnp.where(result.valid, result.weights, 0)
  if backend == "blocked" and fused and gather_backend == "xla":
    params = dict(expert_params)
    if width_mask is not None:
      params["w_down"] = params["w_down"] * width_mask[:, :, None].astype(params["w_down"].dtype)
    return fused_lib.blocked_ffn(params, x, weights.astype(jnp.float32), plan,
                                 activation=activation, **options).astype(x.dtype)
  gkw = dict(backend=gather_backend, interpret=interpret)
  xs = permute_lib.permute(x, plan, **gkw)
  ys = expert_ffn_rows(expert_params, xs, plan.group_sizes, activation=activation,
                       backend=backend, width_mask=width_mask, interpret=interpret,
                       **options)
  return permute_lib.unpermute(ys, plan, weights, **gkw).astype(x.dtype)
