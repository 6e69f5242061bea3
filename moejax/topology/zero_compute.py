"""Zero-computation experts (MoE++, Jin et al. 2410.07348).

Legend: T tokens, d model width, Z zero-computation experts (zero + copy +
constant), J constant experts.

Three kinds of experts that are routed like FFN experts but cost (almost)
nothing, so a token that picks them spends fewer FLOPs:

- zero expert: E(x) = 0 (the token skips the layer on this slot);
- copy expert: E(x) = x;
- constant expert j: E(x) = a1 x + a2 v_j with [a1, a2] = softmax(x W_c[j]),
  W_c [J, d, 2], v [J, d] learned.

Their router columns follow the FFN experts: ids num_experts ..
num_routed - 1 are the zero experts, then the copy experts, then the
constant experts (the order of :func:`apply_zero_compute`'s Z axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig

Params = dict[str, Any]

# Standard deviation of a unit normal truncated to [-2, 2].
_TRUNC_STD = 0.87962566103423978


def init_zero_compute(key: jax.Array, d_model: int, cfg: MoEConfig,
                      dtype=jnp.float32) -> Params:
  """Parameters of the constant experts (zero and copy experts have none).

  Returns:
    {'w_c': [J, d, 2], 'v': [J, d]}, or {} when J = 0. W_c uses fan-in
    variance scaling (std 1/sqrt(d)), so the two mixing logits start O(1).
    v starts with unit-variance entries: the constant expert's output
    a1 x + a2 v replaces a normalised token, whose entries are O(1), so a2 v
    starts on the same scale as a1 x instead of being negligible.
  """
  j = cfg.topology.constant_experts
  if j == 0:
    return {}
  k_w, k_v = jax.random.split(key)
  w_init = jax.nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
  # Truncated at 2 std, then rescaled to unit std (the truncation shrinks it).
  v = jax.random.truncated_normal(k_v, -2.0, 2.0, (j, d_model), jnp.float32) / _TRUNC_STD
  return {"w_c": w_init(k_w, (j, d_model, 2), dtype), "v": v.astype(dtype)}


def apply_zero_compute(params: Params, x: jax.Array, cfg: MoEConfig) -> jax.Array:
  """Outputs of every zero-computation expert for every token.

  Args:
    params: from :func:`init_zero_compute`.
    x: [T, d] tokens.
    cfg: the layer config (counts of zero / copy / constant experts).

  Returns:
    f32-or-x.dtype [T, Z, d], Z = zero + copy + constant experts, in that
    order (router ids num_experts .. num_routed - 1). Materialising all Z
    outputs is cheap: each is elementwise in x (the constant experts add one
    [d, 2] matvec each).
  """
  t, d = x.shape
  parts = []
  if cfg.topology.zero_experts:
    parts.append(jnp.zeros((t, cfg.topology.zero_experts, d), x.dtype))
  if cfg.topology.copy_experts:
    parts.append(jnp.broadcast_to(x[:, None, :], (t, cfg.topology.copy_experts, d)))
  if cfg.topology.constant_experts:
    w_c, v = params["w_c"].astype(x.dtype), params["v"].astype(x.dtype)
    a = jax.nn.softmax(jnp.einsum("td,jdc->tjc", x, w_c), axis=-1)  # [T, J, 2]
    parts.append(a[..., 0:1] * x[:, None, :] + a[..., 1:2] * v[None, :, :])
  if not parts:
    return jnp.zeros((t, 0, d), x.dtype)
  return jnp.concatenate(parts, axis=1)
