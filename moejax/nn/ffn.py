"""The dense feed-forward block (SwiGLU or GELU).

Legend: B batch, S sequence length, d model width, F hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.topology import roles


class DenseFFN(nnx.Module):
  """SwiGLU: w_down(silu(w_gate x) * w_up x) (Shazeer 2002.05202); GELU: w_down(gelu(w_up x)).

  No biases, like the routed experts, so a dense baseline of width F has
  exactly ``ffn_params(d, F, activation)`` parameters.
  """

  def __init__(self, d_model: int, width: int, activation: str, *, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.activation = activation
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,
                                  param_dtype=jnp.float32, rngs=rngs)
    if activation == "swiglu":
      self.w_gate = lin(d_model, width)
    self.w_up = lin(d_model, width)
    self.w_down = lin(width, d_model)

  def param_roles(self) -> dict:
    """Every projection is a hidden matrix [in, out]."""
    return {name: {"kernel": roles.matrix("dense")} for name in ("w_gate", "w_up", "w_down")}

  def __call__(self, x: jax.Array) -> jax.Array:
    """x[B, S, d] -> [B, S, d]."""
    if self.activation == "swiglu":
      h = jax.nn.silu(self.w_gate(x)) * self.w_up(x)
    else:
      h = jax.nn.gelu(self.w_up(x))
    return self.w_down(h)


def ffn_params(d_model: int, width: int, activation: str) -> int:
  """Parameters of one bias-free FFN of hidden width F: (3 or 2) * d * F."""
  return (3 if activation == "swiglu" else 2) * d_model * width
