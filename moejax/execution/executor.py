"""Executors: how one layer's routed experts are computed, behind one call.

Legend: T tokens (on this device), d model width, K slots per token, E FFN
experts (ids >= E are zero-computation experts, never sent here), f expert
hidden width, C capacity per expert (None: dropless).

The MoE layer (:mod:`moejax.layer`, the only composer) routes, applies
capacity, and hands an executor the routed experts' work::

    y, extras = executor(experts, x, result, width_mask=mask, capacity=C)

    y[t] = sum_{k : valid, id < E} weights[t, k] * FFN_{id[t, k]}(x[t])

``experts`` is the topology's expert pytree (``w_gate_up`` [E, d, 2f] or
``w_up`` [E, d, f], and ``w_down`` [E, f, d]); ``result`` the routing after capacity (dropped
slots already invalid); ``width_mask`` f32[E, f] zeroes padded hidden units
of heterogeneous experts (None: equal widths); ``capacity`` is C when the
layer drops (an executor may size buffers by it). ``extras`` is a dict of
execution statistics the layer returns under ``aux['execution']`` (empty
for the local executors; device loads and communication bytes for the
expert-parallel one, :mod:`moejax.execution.parallel`).

An executor never routes, never drops and never computes losses: like
vmoe's dispatcher objects, the layer does not need to know its inside, and
a new execution strategy is a new executor, not a new layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Protocol

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn
from moejax.execution import registry
from moejax.execution import scopes
from moejax.execution import shape_choice
from moejax.routing.types import RoutingResult
from moejax.topology import experts as experts_lib

Params = dict[str, Any]


class Executor(Protocol):
  """``(experts, x[T, d], result, *, width_mask, capacity) -> (y[T, d], extras)``."""

  def __call__(self, experts: Params, x: jax.Array, result: RoutingResult, *,
               width_mask: Optional[jax.Array], capacity: Optional[int]
               ) -> tuple[jax.Array, dict]:
    ...


@registry.register_executor
@dataclasses.dataclass(frozen=True)
class ReferenceExecutor:
  """Every expert on every token, combined with the dense [T, E] gate matrix.

  Obviously correct and slow: the oracle every fast executor is tested
  against. A scan over experts keeps memory at O(T f) instead of
  materialising the [E, T, f] hidden activations of all experts at once.
  """

  name: ClassVar[str] = "reference"
  expert_parallel: ClassVar[bool] = False

  num_experts: int
  activation: str

  @classmethod
  def for_layer(cls, cfg: MoEConfig, execution, backend: str) -> "ReferenceExecutor":
    del execution, backend
    return cls(cfg.num_experts, cfg.topology.activation)

  def __call__(self, experts, x, result, *, width_mask=None, capacity=None):
    del capacity
    f = experts["w_down"].shape[1]
    masks = (jnp.ones((self.num_experts, f), x.dtype) if width_mask is None
             else width_mask.astype(x.dtype))
    combine = result.combine_weights()[:, : self.num_experts].T  # [E, T]

    def body(y, inputs):
      params_e, weight_e, mask_e = inputs  # weight_e: [T]
      out = experts_lib.expert_ffn(params_e, x, self.activation, mask_e)
      return y + weight_e[:, None].astype(out.dtype) * out, None

    with jax.named_scope(scopes.EXPERT_FFN):
      y, _ = jax.lax.scan(body, jnp.zeros_like(x), (experts, combine, masks))
    return y, {}


@registry.register_executor
@dataclasses.dataclass(frozen=True)
class LocalExecutor:
  """Dropless on one device: permute -> grouped matmul -> unpermute.

  ``backend`` names a :mod:`moejax.execution.gmm` backend (``blocked`` runs
  the fused tile loop); ``interpret`` runs Pallas backends interpreted.
  """

  name: ClassVar[str] = "grouped"
  expert_parallel: ClassVar[bool] = False

  num_experts: int
  activation: str
  backend: str = "blocked"
  interpret: bool = False
  rule: Optional[shape_choice.ShapeRule] = None  # picks the backend per call shape

  @classmethod
  def for_layer(cls, cfg: MoEConfig, execution, backend: str) -> "LocalExecutor":
    return cls(cfg.num_experts, cfg.topology.activation, backend, execution.interpret,
               shape_choice.ShapeRule.from_execution(execution, backend))

  def __call__(self, experts, x, result, *, width_mask=None, capacity=None):
    del capacity  # dropped slots are already invalid; the grouped matmul skips them
    y = grouped_ffn.routed_experts(
        experts, x, result, num_experts=self.num_experts, activation=self.activation,
        backend=self.backend, width_mask=width_mask, interpret=self.interpret,
        rule=self.rule)
    return y, {}


def resolve_execution(cfg: MoEConfig, platform: Optional[str] = None) -> MoEConfig:
  """``cfg`` with ``execution.backend='auto'`` resolved for ``platform`` (default: JAX's).

  The new config names the chosen backend and records ``derived_from="auto
  on <platform>"`` and the shape rule of the chosen backend
  (``Backend.auto_large_groups`` as ``large_group_backend`` /
  ``large_group_rows``, unless the config set its own); a config naming its
  backend, or of a layer kind that reads no backend (Soft MoE, PEER: its
  ``honoured`` table), is returned unchanged.
  """
  ex, honoured = cfg.execution, cfg.layer.honoured.get("execution")
  if honoured is not None and "backend" not in honoured:
    return cfg
  platform = jax.default_backend() if platform is None else platform
  chosen = gmm_lib.resolve_backend(ex.backend, platform)
  if chosen == ex.backend:
    return cfg
  new = dataclasses.replace(ex, backend=chosen, derived_from=f"{ex.backend} on {platform}")
  large = (() if chosen not in gmm_lib.backend_names()
           else gmm_lib.get_backend(chosen).large_groups_on(platform))
  if large and not ex.large_group_backend:
    new = dataclasses.replace(new, large_group_backend=large[0], large_group_rows=large[1])
  return dataclasses.replace(cfg, execution=new)


def local_executor(cfg: MoEConfig) -> Executor:
  """The single-device executor ``cfg.execution`` names (``auto``: resolved for JAX's
  platform, with its shape rule)."""
  ex = resolve_execution(cfg).execution
  backend = gmm_lib.resolve_backend(ex.backend)
  # backend='reference' is the older spelling of executor='reference'.
  name = ReferenceExecutor.name if backend == "reference" else ex.executor
  return registry.EXECUTORS.get(name, "moe.execution.executor").for_layer(cfg, ex, backend)
