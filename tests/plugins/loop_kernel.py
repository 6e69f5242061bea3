"""A grouped-matmul kernel from outside the package: one masked dense matmul per group.

What a researcher's own kernel module looks like: build a ``gmm.Backend`` and
register it; a config then names it in ``moe.execution.backend``. Legend: m
rows, k contraction, n output width, G groups.
"""

import jax.numpy as jnp

from moejax.execution import gmm


def _group_of_row(group_sizes, m):
  """int32[m]: the group of each row (G for rows past the groups)."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")


def _loop_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False, interpret=False):
  del interpret
  w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs                # [G, k, n]
  owner = _group_of_row(group_sizes, lhs.shape[0])                     # [m]
  onehot = (owner[:, None] == jnp.arange(w.shape[0])).astype(lhs.dtype)  # [m, G]
  out = jnp.einsum("mk,gkn,mg->mn", lhs, w, onehot)
  return out.astype(out_dtype)


def _loop_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret=False):
  del interpret
  owner = _group_of_row(group_sizes, lhs.shape[0])
  onehot = (owner[:, None] == jnp.arange(group_sizes.shape[0])).astype(lhs.dtype)
  return jnp.einsum("mk,mn,mg->gkn", lhs, grad, onehot).astype(out_dtype)


BACKEND = gmm.register_backend(gmm.Backend(
    name="masked_loop", gmm=_loop_gmm, tgmm=_loop_tgmm, custom_vjp=False,
    needs="nothing (any platform; G x the FLOPs: a teaching example)"))
