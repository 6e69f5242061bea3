"""Expert specialisation: mutual information between expert choice and domain.

Legend: B batch, S sequence length, K slots per token, E routed experts
(FFN and zero-computation), D domains.

Every valid routing slot of a scored token is one draw of the pair
(expert e, domain d of the token). I(expert; domain) over the joint counts
n[e, d] is 0 when routing ignores the domain and reaches H(domain) when the
domain is a function of the chosen expert. It is reported in nats, and
divided by H(domain) (``normalized``, in [0, 1]) so layers and datasets with
different domain mixes compare.

The counts cover every routed column, zero-computation experts included: a
router that sends comments to a "copy" expert has specialised too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def joint_counts(expert_ids: jax.Array, valid: jax.Array, labels: jax.Array,
                 mask: jax.Array, num_experts: int, num_domains: int) -> jax.Array:
  """f32[E, D] valid slots per (expert, domain).

  Args:
    expert_ids: int32[B, S, K]; valid: bool[B, S, K] (the layer's routing).
    labels: int32[B, S] domain of each position; mask: bool[B, S] scored positions.
  """
  keep = (valid & mask[..., None]).astype(jnp.float32)                      # [B, S, K]
  e_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)        # [B, S, K, E]
  d_hot = jax.nn.one_hot(labels, num_domains, dtype=jnp.float32)            # [B, S, D]
  return jnp.einsum("bske,bsk,bsd->ed", e_hot, keep, d_hot)


def mutual_information(counts) -> tuple[float, float]:
  """(I(expert; domain) in nats, I / H(domain)) of joint counts f[E, D].

  Both are 0 for empty counts or a single domain (nothing to explain).
  """
  n = np.asarray(counts, np.float64)
  total = n.sum()
  if total <= 0:
    return 0.0, 0.0
  p = n / total
  pe, pd = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
  nz = p > 0
  mi = float(np.sum(p[nz] * np.log(p[nz] / (pe @ pd)[nz])))
  h_d = float(-np.sum(pd[pd > 0] * np.log(pd[pd > 0])))
  mi = max(mi, 0.0)  # rounding can leave -1e-17
  return mi, (mi / h_d if h_d > 0 else 0.0)
