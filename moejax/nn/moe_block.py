"""The NNX owner of one MoE layer's params and router state.

Legend: B batch, S sequence length, T = B*S tokens, d model width, K expert
slots per token.

:func:`moejax.layer.moe_layer` is pure; this module only owns its inputs:

- the params pytree from :func:`moejax.layer.init_moe_params`, every leaf an
  ``nnx.Param`` (so ``nnx.state(model, nnx.Param)`` and optimizers built with
  ``wrt=nnx.Param`` see them);
- the :class:`~moejax.routing.types.RouterState`, every leaf a
  :class:`RouterStateVar`. That is an ``nnx.Variable`` but *not* an
  ``nnx.Param``: router state is never handed to the optimizer (DESIGN;
  MaxText issue #2494 was a bias trained by the optimizer).

Train-mode calls write the layer's controller-updated state back into the
``RouterStateVar`` leaves. Under ``nnx.jit`` / ``nnx.value_and_grad`` (with
the default ``wrt=nnx.Param``) NNX propagates that write out of the trace, so
one ``train_step`` updates the params through the optimizer and the bias
through the controller, with nothing extra to thread. Evaluation calls
(``train=False``) never touch the state.

Expert parallelism: a MoEFFN built with ``expert_parallel=ExpertParallel(mesh,
pcfg)`` calls :func:`moejax.execution.parallel.ep_moe_layer` on that mesh
instead of the single-device layer (same params, state and aux; see
docs/parallel.md). The mesh is a static attribute, so it lives in the graphdef
and every forward of the model (train and eval) uses it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from moejax.config import MoEConfig

if TYPE_CHECKING:  # the execution plane is imported only where a layer runs expert-parallel
  from moejax.execution.mesh import ParallelConfig


class RouterStateVar(nnx.Variable):
  """A leaf of a MoE layer's router state (selection bias, controller step).

  Filter with ``nnx.state(model, RouterStateVar)``; excluded by ``nnx.Param``.
  """


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Where MoE layers run expert-parallel: a ``moejax.execution.mesh.make_mesh`` mesh and
  the ``ParallelConfig`` it was built from (dispatch path, routing limits, nodes)."""

  mesh: Mesh
  pcfg: ParallelConfig


def _is_var(v) -> bool:
  return isinstance(v, nnx.Variable)


def values(tree: Any) -> Any:
  """The same pytree with every nnx.Variable replaced by its value."""
  return jax.tree.map(lambda v: v[...], tree, is_leaf=_is_var)


def _assign(tree: Any, new: Any) -> None:
  jax.tree.map(lambda v, n: v.set_value(n), tree, new, is_leaf=_is_var)


def _aux_for_model(aux: dict, batch_shape: tuple[int, int]) -> dict:
  """The layer's aux with the routing decision reshaped to [B, S, K].

  Router probabilities and logits ([T, E]) are dropped: losses and metrics
  already consumed them, and keeping them would carry B*S*E floats per layer
  out of every step.
  """
  out = {k: v for k, v in aux.items() if k != "routing"}
  routing = aux.get("routing")
  if routing is not None:
    b, s = batch_shape
    out["expert_ids"] = routing.expert_ids.reshape(b, s, -1)
    out["weights"] = routing.weights.reshape(b, s, -1)
    out["valid"] = routing.valid.reshape(b, s, -1)
  return out


class MoEFFN(nnx.Module):
  """One MoE FFN slot: x[B, S, d] -> (y[B, S, d], aux).

  ``shared_experts``: the ``params['experts']`` subtree (nnx.Param leaves) of
  another MoEFFN to reuse instead of this layer's own; the router, shared
  experts and zero-computation experts stay per layer. NNX keeps the shared
  Variables once in ``nnx.state`` and sums their gradients over the layers.

  ``expert_parallel``: run the layer with :func:`moejax.execution.parallel.ep_moe_layer`
  on that mesh (None: the single-device :func:`moejax.layer.moe_layer`).
  """

  def __init__(self, d_model: int, cfg: MoEConfig, *, dtype=jnp.float32,
               rngs: nnx.Rngs, shared_experts: Optional[dict] = None,
               expert_parallel: Optional[ExpertParallel] = None):
    from moejax import layer as layer_lib  # imported here: dense models need no MoE planes
    self.cfg, self.dtype = cfg, dtype
    self.expert_parallel = expert_parallel
    params = layer_lib.init_moe_params(rngs.params(), d_model, cfg)
    self.params = nnx.data(jax.tree.map(nnx.Param, params))
    if shared_experts is not None:
      self.params["experts"] = shared_experts
    self.router_state = nnx.data(
        jax.tree.map(RouterStateVar, layer_lib.init_router_state(cfg)))

  def __call__(self, x: jax.Array, token_ids: jax.Array, *, train: bool = False,
               rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = ()) -> tuple[jax.Array, dict]:
    """x[B, S, d], token_ids int[B, S] -> (y[B, S, d], aux)."""
    from moejax import layer as layer_lib
    params = values(self.params)
    # Expert weights follow the compute dtype; the router keeps float32 params
    # and casts to moe.router.router_dtype itself (Switch selective precision).
    params = {k: (v if k == "router" else
                  jax.tree.map(lambda a: a.astype(self.dtype), v))
              for k, v in params.items()}
    ep = self.expert_parallel
    if ep is None:
      y, new_state, aux = layer_lib.moe_layer(
          params, x, values(self.router_state), self.cfg, token_ids=token_ids,
          rng=rng, train=train, axis_names=axis_names)
    else:
      if axis_names:
        raise ValueError(f"MoEFFN: axis_names={tuple(axis_names)} with expert parallelism; "
                         "the expert-parallel layer reduces over its own mesh. Fix: call "
                         "the model outside shard_map, under jax.jit")
      from moejax.execution import parallel as parallel_lib
      y, new_state, aux = parallel_lib.ep_moe_layer(
          params, x, values(self.router_state), self.cfg, ep.mesh, ep.pcfg,
          token_ids=token_ids, rng=rng, train=train)
    if train:
      _assign(self.router_state, new_state)
    return y.astype(x.dtype), _aux_for_model(aux, x.shape[:2])
