"""Perturbations of a forward's arithmetic: bf16 compute, int8 / int4 experts, remat.

Legend: B sequences, S tokens per sequence, E_r router outputs.

- ``bf16``: the model rebuilt with ``model.compute_dtype='bfloat16'``, the
  same weights.
- ``int8`` / ``int4``: the routed and shared expert weights quantised per
  output channel (:mod:`moejax.serve.quantize`; the router stays float, so
  the first MoE layer routes as before and later layers see other hidden
  states).
- ``remat``: the forward that the backward pass recomputes under
  ``jax.checkpoint`` against the original forward of the same computation
  (a next-token loss differentiated with respect to the parameters, as in
  training). The recomputed selection is read through :func:`_tap`, whose
  residual is the selection: under ``jax.checkpoint`` residuals are not
  stored but recomputed, so the tap's backward sees the recomputed one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.routing.replay import RoutingReplay
from moejax.serve import perturbation as P
from moejax.serve import quantize as quant_lib


def _bf16(model, tokens):
  return P.reference_selections(P.rebuilt(model, {"compute_dtype": "bfloat16"}), tokens)


def _quantized(bits: int):
  def run(model, tokens):
    q = nnx.clone(model)   # quantize_model works in place; the caller's model stays float
    quant_lib.quantize_model(q, quant_lib.QuantConfig(bits=bits))
    return P.reference_selections(q, tokens)
  return run


def _quantizable(model, tokens) -> str:
  del tokens
  if not any(True for _ in quant_lib.moe_ffns(model)):
    return ("the model has no sparse MoE layer with routed expert weights to quantise "
            "(moejax.serve.quantize quantises routed and shared experts only)")
  return ""


@jax.custom_vjp
def _tap(mask: jax.Array, probe: jax.Array) -> jax.Array:
  """``probe``, whose cotangent carries ``mask`` (the residual) back."""
  del mask
  return probe


def _tap_fwd(mask, probe):
  return probe, mask


def _tap_bwd(mask, g):
  return jnp.zeros_like(mask), g * mask


_tap.defvjp(_tap_fwd, _tap_bwd)


def _mask(sel: RoutingReplay, num_routed: int) -> jax.Array:
  """f32[..., E_r]: 1 where the token selected expert e (a valid slot)."""
  hot = jax.nn.one_hot(sel.expert_ids, num_routed, dtype=jnp.float32)
  return jnp.max(hot * sel.valid[..., None].astype(jnp.float32), axis=-2)


def _as_selection(mask) -> RoutingReplay:
  """A pair mask [..., E_r] as a selection with one slot per expert."""
  mask = np.asarray(mask) > 0.5
  ids = np.broadcast_to(np.arange(mask.shape[-1], dtype=np.int32), mask.shape)
  return RoutingReplay(jnp.asarray(np.where(mask, ids, 0)), jnp.asarray(mask))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _remat_grad(graphdef, params, rest, tokens, probes, num_routed):
  def loss(params, probes):
    logits, aux = nnx.merge(graphdef, params, rest)(tokens)
    sel = P.selections_of(aux)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    taps = sum(jnp.sum(_tap(_mask(sel[n], num_routed), probes[n])) for n in sorted(sel))
    return ce + taps, {n: _mask(s, num_routed) for n, s in sel.items()}

  grads, original = jax.grad(jax.checkpoint(loss), argnums=(0, 1), has_aux=True)(params, probes)
  return original, grads[1]


def _remat(model, tokens):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.asarray(np.asarray(tokens), jnp.int32)
  e_r = model.cfg.moe.num_routed
  shapes = jax.eval_shape(lambda p: nnx.merge(graphdef, p, rest)(tokens)[1], params)
  probes = {n: jnp.zeros(tokens.shape + (e_r,), jnp.float32) for n in P.selections_of(shapes)}
  original, recomputed = _remat_grad(graphdef, params, rest, tokens, probes, e_r)
  return ({n: _as_selection(m) for n, m in original.items()},
          {n: _as_selection(m) for n, m in recomputed.items()})


def _remat_applies(model, tokens) -> str:
  del model
  if np.asarray(tokens).shape[1] < 2:
    return "the recomputed forward is differentiated through a next-token loss: needs S >= 2"
  return ""


P.register(P.Perturbation("bf16", _bf16, description="compute_dtype=bfloat16, same weights"))
P.register(P.Perturbation("int8", _quantized(8), _quantizable,
                          description="experts int8 per output channel, router float"))
P.register(P.Perturbation("int4", _quantized(4), _quantizable,
                          description="experts int4 per output channel, router float"))
P.register(P.Perturbation("remat", _remat, _remat_applies, own_reference=True,
                          description="the backward's recomputed forward vs the original"))
