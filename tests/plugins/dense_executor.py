"""A single-device executor from outside the package: every expert on every token at once.

What a researcher's own execution strategy looks like: a class with a
``name``, ``expert_parallel = False``, ``for_layer`` and the executor call,
registered with ``register_executor``; a config chooses it with
``moe.execution.executor``. Legend: T tokens, d width, E experts, f expert
width.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from moejax.execution.registry import register_executor


@register_executor
@dataclasses.dataclass(frozen=True)
class AllDenseExecutor:
  """y = sum_e combine[t, e] FFN_e(x[t]), the [E, T, f] hidden states materialised."""

  name: ClassVar[str] = "all_dense"
  expert_parallel: ClassVar[bool] = False

  num_experts: int

  @classmethod
  def for_layer(cls, cfg, execution, backend):
    del execution, backend
    if cfg.topology.activation != "swiglu":
      raise ValueError("all_dense runs SwiGLU experts only")
    return cls(cfg.num_experts)

  def __call__(self, experts, x, result, *, width_mask=None, capacity=None):
    del capacity
    combine = result.combine_weights()[:, : self.num_experts]                # [T, E]
    gate = jnp.einsum("td,edf->etf", x, experts["w_gate"])
    up = jnp.einsum("td,edf->etf", x, experts["w_up"])
    h = jax.nn.silu(gate) * up
    if width_mask is not None:
      h = h * width_mask[:, None, :].astype(h.dtype)
    out = jnp.einsum("etf,efd->etd", h, experts["w_down"])
    return jnp.einsum("te,etd->td", combine.astype(out.dtype), out), {}
