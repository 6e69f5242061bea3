"""A single-device executor from outside the package: every expert on every token at once.

What a researcher's own execution strategy looks like: a class with a
``name``, ``expert_parallel = False``, ``for_layer`` and the executor call,
registered with ``register_executor``; a config chooses it with
``moe.execution.executor``. Legend: T tokens, d width, E experts, f expert
width (g = 2f: gate and up side by side).
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from moejax.execution.registry import register_executor
from moejax.topology.experts import split_gate_up


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
    # Gated experts store W_gate and W_up side by side: w_gate_up [E, d, 2f].
    gate, up = split_gate_up(jnp.einsum("td,edg->etg", x, experts["w_gate_up"]))
    h = jax.nn.silu(gate) * up
    if width_mask is not None:
      h = h * width_mask[:, None, :].astype(h.dtype)
    out = jnp.einsum("etf,efd->etd", h, experts["w_down"])
    return jnp.einsum("te,etd->td", combine.astype(out.dtype), out), {}
