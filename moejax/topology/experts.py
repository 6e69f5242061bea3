"""Routed and shared expert FFNs: parameter layout, initialisation and apply.

Legend: E routed FFN experts, C capacity (tokens per expert buffer), n tokens
of one expert, T tokens, d model width, f hidden width of the widest routed
expert, K_s shared experts, f_s width of one shared expert.

Routed expert parameters are stacked on a leading expert axis; the layer and
every execution backend depend on exactly this layout::

  swiglu: {'w_gate_up': [E, d, 2f], 'w_down': [E, f, d]}
  gelu:   {'w_up': [E, d, f], 'w_down': [E, f, d]}

``w_gate_up`` holds each expert's W_gate and W_up side by side (columns
[0, f) gate, [f, 2f) up), the layout of Megatron-LM's grouped experts and of
transformers' fused ``gate_up_proj``: the first layer of a gated expert is
one [d, 2f] matmul, and no step concatenates the two per expert. They are
still two matrices (:func:`split_gate_up`): their optimizer role says so
(``output_blocks=2``), and LoRA adapts each on its own. Checkpoints of the
earlier layout, with separate 'w_gate' and 'w_up' stacks, are converted on
restore (:mod:`moejax.train.layout_restore`).

SwiGLU is down(silu(x W_gate) * (x W_up)) (Shazeer 2002.05202); GELU is
down(gelu(x W_up)) with jax's default tanh approximation, as the dense FFN in
:mod:`moejax.nn.ffn`. There are no biases, so an expert of width w has
exactly (3 or 2) * d * w parameters and the accounting in
:mod:`moejax.topology.accounting` is exact.

Heterogeneous experts (``MoEConfig.expert_widths``) share one stacked array
of width f = max width: expert e uses hidden units [0, w_e) and the rest of
its slice is zero padding, switched off by :func:`width_mask`.

Initialisation is variance scaling on the fan-in with a truncated normal
(std 1/sqrt(fan_in) after correcting for the truncation at 2 std): fan-in d
for W_gate and W_up, and the expert's *real* width w_e for W_down, so a narrow
expert's output has the same scale as a wide one's instead of being shrunk
by the padding it does not use.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from moejax.config import ConfigError, MoEConfig
from moejax.topology import roles

Params = dict[str, Any]

_ACTIVATIONS = ("swiglu", "gelu")
GATE_UP = "w_gate_up"  # a gated expert stack's [E, d, 2f] first layer
# The first-layer weight of each activation's expert stack.
FIRST_LAYER = {"swiglu": GATE_UP, "gelu": "w_up"}


def fuse_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
  """[..., d, 2f]: W_gate and W_up side by side on the last axis."""
  return jnp.concatenate([w_gate, w_up], axis=-1)


def split_gate_up(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(gate, up): the two halves of the last axis of a [..., 2f] weight or activation."""
  f = w.shape[-1] // 2
  return w[..., :f], w[..., f:]


def fused_layout(params: Params) -> Params:
  """Routed-expert params in the current layout: separate 'w_gate' / 'w_up' stacks (the
  earlier layout) become one 'w_gate_up'; anything else comes back as it was."""
  if "w_gate" not in params or "w_up" not in params or GATE_UP in params:
    return dict(params)
  out = {GATE_UP: fuse_gate_up(params["w_gate"], params["w_up"])}
  out.update((k, v) for k, v in params.items() if k not in ("w_gate", "w_up"))
  return out


def split_layout(params: Params) -> Params:
  """Routed-expert params with 'w_gate_up' split into 'w_gate' and 'w_up' (the per-matrix
  view that exporters and per-matrix tools read); gelu params come back as they were."""
  if GATE_UP not in params:
    return dict(params)
  gate, up = split_gate_up(params[GATE_UP])
  out = {"w_gate": gate, "w_up": up}
  out.update((k, v) for k, v in params.items() if k != GATE_UP)
  return out


def hidden_width(params: Params) -> int:
  """f, the hidden width of a routed-expert stack (rows of its [E, f, d] W_down)."""
  return params["w_down"].shape[-2]


def _fan_in_init(key: jax.Array, shape: tuple, dtype, in_axis: int = -2,
                 batch_axis: tuple = ()) -> jax.Array:
  init = jax.nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=-1,
      batch_axis=batch_axis)
  return init(key, shape, dtype)


def width_mask(cfg: MoEConfig) -> jax.Array:
  """f32[E, f]: 1 on hidden unit j of expert e iff j < width of e.

  With equal widths this is all ones. Why mask at all, when the padding is
  zero? Padded units stay zero under gradient descent by themselves: unit j
  past an expert's width has a zero column in W_up (and W_gate) and a zero row
  in W_down, so its pre-activation is 0, its output silu(0) * 0 = gelu(0) = 0,
  the gradient into its W_down row is (output) * dy = 0, and the gradient into
  its W_up / W_gate column is x * (dy . W_down row) * act' = 0. Zero gradients
  give zero Adam moments and zero updates, and decoupled weight decay keeps 0
  at 0. The mask is applied anyway because that argument holds only while
  every padded entry is exactly zero and the activation maps 0 to 0: a
  checkpoint from elsewhere, weight averaging or merging, noise injection, an
  optimizer that adds anything but the gradient, or an activation with
  act(0) != 0 would silently grow the expert past its configured width. With
  the mask the expert computes exactly w_e units whatever the padded values
  are, padded entries get exactly zero gradient, and the parameter / FLOP
  accounting is true by construction.
  """
  widths = jnp.asarray(cfg.widths, jnp.int32)
  f = max(cfg.widths)
  return (jnp.arange(f)[None, :] < widths[:, None]).astype(jnp.float32)


def init_experts(key: jax.Array, d_model: int, cfg: MoEConfig,
                 dtype=jnp.float32) -> Params:
  """Stacked routed-expert weights, zero-padded past each expert's width.

  Returns:
    swiglu: {'w_gate_up': [E, d, 2f], 'w_down': [E, f, d]};
    gelu: {'w_up': [E, d, f], 'w_down': [E, f, d]}.
    W_gate and W_up are drawn as two [E, d, f] stacks (fan-in d each) from the
    same keys as when they were stored apart, so a seed gives the same weights.
  """
  if cfg.topology.activation not in _ACTIVATIONS:
    raise ConfigError("moe.topology.activation", cfg.topology.activation, "unknown activation",
                      f"use one of {', '.join(_ACTIVATIONS)}")
  e, f = cfg.num_experts, max(cfg.widths)
  mask = width_mask(cfg)  # [E, f]
  k_gate, k_up, k_down = jax.random.split(key, 3)
  w_up = _fan_in_init(k_up, (e, d_model, f), jnp.float32, batch_axis=(0,))
  # Fan-in of W_down is the real width w_e: rescale the draw made with fan-in f.
  widths = jnp.asarray(cfg.widths, jnp.float32)
  w_down = _fan_in_init(k_down, (e, f, d_model), jnp.float32, batch_axis=(0,))
  w_down = w_down * jnp.sqrt(f / widths)[:, None, None]
  pad_cols = lambda w: jnp.where(mask[:, None, :] > 0, w, 0.0)  # [E, d, f]
  params = {"w_up": pad_cols(w_up), "w_down": jnp.where(mask[:, :, None] > 0, w_down, 0.0)}
  if cfg.topology.activation == "swiglu":
    w_gate = _fan_in_init(k_gate, (e, d_model, f), jnp.float32, batch_axis=(0,))
    params = {GATE_UP: fuse_gate_up(pad_cols(w_gate), params.pop("w_up")), **params}
  return jax.tree.map(lambda a: a.astype(dtype), params)


def _hidden(x: jax.Array, params: Params, activation: str, up_spec: str) -> jax.Array:
  """act(x W_1): W_1 is 'w_gate_up' (routed, one matmul then split) or 'w_gate' and
  'w_up' (the shared experts' dense FFN) for swiglu, 'w_up' for gelu."""
  if activation == "gelu":
    return jax.nn.gelu(jnp.einsum(up_spec, x, params["w_up"].astype(x.dtype)))
  if activation != "swiglu":
    raise ValueError(f"activation={activation!r}: use one of {', '.join(_ACTIVATIONS)}")
  if GATE_UP in params:
    gate, up = split_gate_up(jnp.einsum(up_spec, x, params[GATE_UP].astype(x.dtype)))
  elif "w_gate" in params:
    gate = jnp.einsum(up_spec, x, params["w_gate"].astype(x.dtype))
    up = jnp.einsum(up_spec, x, params["w_up"].astype(x.dtype))
  else:
    raise ValueError(f"swiglu experts need {GATE_UP!r} (or 'w_gate' and 'w_up') in their "
                     f"params, have {sorted(params)}")
  return jax.nn.silu(gate) * up


def expert_ffn(params_e: Params, x: jax.Array, activation: str,
               mask_e: Optional[jax.Array] = None) -> jax.Array:
  """One expert on its tokens: x[n, d] -> [n, d].

  Args:
    params_e: one expert's slice: 'w_gate_up' [d, 2f] (swiglu) or 'w_up'
      [d, f] (gelu), and 'w_down' [f, d].
    x: [n, d] tokens routed to this expert.
    activation: 'swiglu' or 'gelu'.
    mask_e: optional f32[f] hidden-unit mask (a row of :func:`width_mask`).
  """
  h = _hidden(x, params_e, activation, "nd,df->nf")
  if mask_e is not None:
    h = h * mask_e.astype(h.dtype)
  return jnp.einsum("nf,fd->nd", h, params_e["w_down"].astype(h.dtype))


def experts_dense(params: Params, x_ecd: jax.Array, activation: str,
                  mask: Optional[jax.Array] = None) -> jax.Array:
  """Every expert on its own capacity buffer: x[E, C, d] -> [E, C, d].

  Args:
    params: stacked expert params from :func:`init_experts`.
    x_ecd: [E, C, d] tokens gathered per expert (padding rows allowed; they
      map to 0 only if they are 0, which every activation here guarantees).
    activation: 'swiglu' or 'gelu'.
    mask: optional f32[E, f] from :func:`width_mask`.
  """
  h = _hidden(x_ecd, params, activation, "ecd,edf->ecf")
  if mask is not None:
    h = h * mask[:, None, :].astype(h.dtype)
  return jnp.einsum("ecf,efd->ecd", h, params["w_down"].astype(h.dtype))


# ---------------------------------------------------------------------------
def expert_roles(params: Params) -> dict:
  """Optimizer roles of :func:`init_experts`' weights: each a stack of E expert matrices
  ([E, d, f] and [E, f, d]), orthogonalised per expert, never as one matrix; 'w_gate_up'
  is two matrices per expert (W_gate and W_up side by side), orthogonalised one by one."""
  return {name: roles.stack("experts", output_blocks=2 if name == GATE_UP else 1)
          for name in params}


# Shared (always-on) experts.

def shared_width(cfg: MoEConfig) -> int:
  """Hidden width f_s of one shared expert (defaults to the routed width)."""
  return cfg.topology.shared_expert_width or cfg.topology.expert_width


def init_shared(key: jax.Array, d_model: int, cfg: MoEConfig,
                dtype=jnp.float32) -> Params:
  """K_s shared experts as one dense FFN of width K_s * f_s.

  Summing K_s separate FFNs of width f_s is exactly one FFN whose up
  projections are the K_s up projections side by side and whose down
  projection is the K_s down projections stacked (the hidden units never
  interact), so one matmul replaces K_s.

  Returns:
    {'w_up': [d, K_s f_s], 'w_down': [K_s f_s, d]} plus 'w_gate' [d, K_s f_s]
    for swiglu and, with ``shared_expert_gate``, 'w_shared_gate' [d, 1]
    (Qwen-MoE: the shared output is scaled by sigmoid(x w_shared_gate)).
    Fan-in initialisation uses f_s for W_down, the fan-in of one shared
    expert, so the init equals that of K_s separately initialised experts.
  """
  if cfg.topology.num_shared_experts <= 0:
    raise ConfigError("moe.topology.num_shared_experts", cfg.topology.num_shared_experts,
                      "init_shared called for a layer without shared experts",
                      "set moe.topology.num_shared_experts > 0 or skip the shared path")
  ks, fs = cfg.topology.num_shared_experts, shared_width(cfg)
  width = ks * fs
  k_gate, k_up, k_down, k_sg = jax.random.split(key, 4)
  params = {
      "w_up": _fan_in_init(k_up, (d_model, width), jnp.float32),
      # Draw as K_s blocks [K_s, f_s, d] so each block has fan-in f_s.
      "w_down": _fan_in_init(k_down, (ks, fs, d_model), jnp.float32,
                             batch_axis=(0,)).reshape(width, d_model),
  }
  if cfg.topology.activation == "swiglu":
    params["w_gate"] = _fan_in_init(k_gate, (d_model, width), jnp.float32)
  if cfg.topology.shared_expert_gate:
    params["w_shared_gate"] = _fan_in_init(k_sg, (d_model, 1), jnp.float32)
  return jax.tree.map(lambda a: a.astype(dtype), params)


def shared_roles(params: Params) -> dict:
  """Optimizer roles of :func:`init_shared`' weights: the K_s shared experts are one dense
  FFN (its [d, K_s f_s] and [K_s f_s, d] matrices); the Qwen-style gate is element-wise."""
  return roles.roles_like(params, {"w_shared_gate": roles.elementwise("shared_gate")},
                          roles.matrix("dense"))


def apply_shared(params: Params, x: jax.Array) -> jax.Array:
  """Sum of the K_s shared experts on every token: x[T, d] -> [T, d].

  The activation is read from the params (swiglu iff 'w_gate' is present);
  with 'w_shared_gate' the result is scaled by sigmoid(x w_shared_gate).
  """
  activation = "swiglu" if "w_gate" in params else "gelu"
  h = _hidden(x, params, activation, "td,df->tf")
  y = jnp.einsum("tf,fd->td", h, params["w_down"].astype(h.dtype))
  if "w_shared_gate" in params:
    gate = jax.nn.sigmoid(jnp.einsum("td,do->to", x, params["w_shared_gate"].astype(x.dtype)))
    y = y * gate
  return y
