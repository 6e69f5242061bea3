"""The NNX owner of one MoE layer's params and router state.

Legend: B batch, S sequence length, T = B*S tokens, d model width, K expert
slots per token, E_r router outputs.

:func:`moejax.layer.moe_layer` is pure; this module only owns its inputs:

- the params pytree from :func:`moejax.layer.init_moe_params`, every leaf an
  ``nnx.Param`` (so ``nnx.state(model, nnx.Param)`` and optimizers built with
  ``wrt=nnx.Param`` see them);
- the :class:`~moejax.routing.types.RouterState` (with the stateful ideas'
  state, ``ideas``), every leaf a :class:`RouterStateVar`. That is an
  ``nnx.Variable`` but *not* an ``nnx.Param``: router state is never handed
  to the optimizer (MaxText issue #2494 was a bias trained by the optimizer).

The forward never writes the router state. The train step calls
:meth:`MoEFFN.apply_controller` (through
:meth:`moejax.model.Transformer.apply_controllers`) once per optimizer step,
outside the differentiated function, with the router loads of the whole
global batch; so a second forward, rematerialisation or gradient
accumulation cannot move the bias twice.

Expert parallelism: a MoEFFN built with ``expert_parallel=ExpertParallel(mesh,
pcfg)`` runs :func:`moejax.layer.ep_moe_layer` on that mesh (same params,
state and aux). The mesh is a static attribute, so it lives in the graphdef
and every forward of the model (train and eval) uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from moejax import layer as layer_lib
from moejax.balance import controller
from moejax.balance.aux import MoEAux
from moejax.nn import lora as lora_lib
from moejax.topology import roles
from moejax.routing import state as state_lib
from moejax.config import MoEConfig, ParallelConfig


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


def _aux_for_model(aux: MoEAux, batch_shape: tuple[int, int]) -> dict:
  """The layer's aux as the model's dict: its present fields, routing reshaped to [B, S, K].

  The keys are the :class:`~moejax.balance.aux.MoEAux` fields the layer kind
  fills (``metrics`` stays a :class:`~moejax.balance.aux.LayerMetrics`),
  with ``routing`` replaced by ``expert_ids``, ``weights`` and ``valid``
  [B, S, K], and ``selection`` (the router's decision before capacity, a
  :class:`~moejax.routing.replay.RoutingReplay`) reshaped to [B, S, K]. Router probabilities and logits ([T, E_r]) are dropped: losses
  and metrics already consumed them, and keeping them would carry B*S*E_r
  floats per layer out of every step.
  """
  out = aux.present()
  routing = out.pop("routing", None)
  if routing is not None:
    b, s = batch_shape
    out["expert_ids"] = routing.expert_ids.reshape(b, s, -1)
    out["weights"] = routing.weights.reshape(b, s, -1)
    out["valid"] = routing.valid.reshape(b, s, -1)
  if "selection" in out:
    out["selection"] = out["selection"].reshape(*batch_shape)
  return out


class MoEFFN(nnx.Module):
  """One MoE FFN slot: x[B, S, d] -> (y[B, S, d], aux).

  ``shared_experts``: the ``params['experts']`` subtree (nnx.Param leaves) of
  another MoEFFN to reuse instead of this layer's own; the router, shared
  experts and zero-computation experts stay per layer. NNX keeps the shared
  Variables once in ``nnx.state`` and sums their gradients over the layers.

  ``expert_parallel``: run the layer with :func:`moejax.layer.ep_moe_layer`
  on that mesh (None: :func:`moejax.layer.moe_layer` on one device).

  ``adapters``: None, or LoRA adapters on the experts / shared experts
  (:func:`moejax.nn.lora.init_moe_adapters`, attached by
  :mod:`moejax.nn.adapters`), merged into the weights before the layer
  runs (:func:`moejax.nn.lora.merge_adapters`), so every executor runs them.
  """

  def __init__(self, d_model: int, cfg: MoEConfig, *, dtype=jnp.float32,
               rngs: nnx.Rngs, shared_experts: Optional[dict] = None,
               expert_parallel: Optional[ExpertParallel] = None):
    self.cfg, self.dtype = cfg, dtype
    self.expert_parallel = expert_parallel
    params = layer_lib.init_moe_params(rngs.params(), d_model, cfg)
    self.params = nnx.data(jax.tree.map(nnx.Param, params))
    if shared_experts is not None:
      self.params["experts"] = shared_experts
    self.router_state = nnx.data(
        jax.tree.map(RouterStateVar, layer_lib.init_router_state(cfg)))
    self.adapters, self.adapter_scale = None, 0.0

  def param_roles(self) -> dict:
    """The layer kind declares its params (:meth:`moejax.layer.LayerKind.param_roles`);
    LoRA adapters are element-wise."""
    return {"params": self.cfg.layer.param_roles(dict(self.params)),
            "adapters": roles.elementwise("adapter")}

  def attach_adapters(self, adapters: dict, scale: float) -> None:
    """Adds LoRA adapters ``{sub: {matrix: {'a', 'b'}}}`` (LoRAParam leaves); see the class doc."""
    self.adapters = nnx.data(jax.tree.map(lora_lib.LoRAParam, adapters))
    self.adapter_scale = float(scale)

  def __call__(self, x: jax.Array, token_ids: jax.Array, *, train: bool = False,
               rng: Optional[jax.Array] = None, axis_names: Sequence[str] = (),
               routed_x: Optional[jax.Array] = None,
               replay: Optional[Any] = None) -> tuple[jax.Array, dict]:
    """x[B, S, d], token_ids int[B, S] -> (y[B, S, d], aux).

    routed_x: what the router and the routed experts read (default x; the
    ScMoE schedule passes the previous block's representation, and the shared
    experts keep reading x).
    replay: a recorded selection [B, S, K] to route by
    (:class:`~moejax.routing.replay.RoutingReplay`; None: the router's own).
    """
    params = values(self.params)
    if self.adapters is not None:
      params = lora_lib.merge_adapters(params, values(self.adapters), self.adapter_scale)
    # Expert weights follow the compute dtype; the router keeps float32 params
    # and casts to moe.routing.router_dtype itself (Switch selective precision).
    params = {k: (v if k == "router" else jax.tree.map(lambda a: a.astype(self.dtype), v))
              for k, v in params.items()}
    state = values(self.router_state)
    inp, shared_x = (x, None) if routed_x is None else (routed_x, x)
    ep = self.expert_parallel
    if ep is None:
      y, aux = layer_lib.moe_layer(params, inp, state, self.cfg, token_ids=token_ids, rng=rng,
                                   train=train, axis_names=axis_names, shared_x=shared_x,
                                   replay=replay)
    else:
      if axis_names:
        raise ValueError(f"MoEFFN: axis_names={tuple(axis_names)} with expert parallelism; "
                         "the expert-parallel layer reduces over its own mesh. Fix: call "
                         "the model outside shard_map, under jax.jit")
      y, aux = layer_lib.ep_moe_layer(params, inp, state, self.cfg, ep.mesh, ep.pcfg,
                                      token_ids=token_ids, rng=rng, train=train,
                                      shared_x=shared_x, replay=replay)
    return y.astype(x.dtype), _aux_for_model(aux, x.shape[:2])

  def apply_controller(self, router_load: jax.Array) -> None:
    """One bias-controller step on f32[E_r] loads of the global batch (in place).

    No-op without a controller (``balance.bias_update='none'``) or with a
    frozen router (``routing.freeze``: the bias is part of the router).
    """
    if self.cfg.balance.bias_update == "none" or self.cfg.routing.freeze:
      return
    new = controller.update_bias(values(self.router_state), router_load, self.cfg.balance)
    jax.tree.map(lambda var, value: var.set_value(value), self.router_state, new,
                 is_leaf=_is_var)

  def update_ideas(self, observed: dict) -> None:
    """One update of the stateful ideas' state (``RouterState.ideas``), in place.

    ``observed``: ``{idea: {name: f32}}`` the layer's ``aux['observed']`` summed
    over the whole step's batch (every micro-batch). No-op without a
    stateful idea. The train step calls it once per optimizer step, outside
    the gradient, like :meth:`apply_controller`.
    """
    if not self.router_state.ideas:
      return
    new = state_lib.update(self.cfg, values(self.router_state.ideas), observed)
    jax.tree.map(lambda var, value: var.set_value(value), self.router_state.ideas, new,
                 is_leaf=_is_var)

  def logged_state(self) -> dict:
    """``{'state/<idea>/<field>': f32[]}`` of this layer's logged idea state."""
    return state_lib.logged(self.cfg, values(self.router_state.ideas))
