"""The MoE layer: routing, balance, topology and execution composed, in one place.

Legend: B batch, S sequence length, T = B*S tokens (on this device), d model
width, E routed FFN experts, Z zero-computation experts, E_r = E + Z router
outputs, K slots per token, f expert hidden width, P = E * p Soft MoE slots,
D devices on the ``expert`` mesh axis.

The layer is a pure function::

    y, aux = moe_layer(params, x, state, cfg, token_ids=..., rng=..., train=...,
                       axis_names=..., executor=...)

One token's walk through a routed (``kind='sparse'``) layer:

1. routing plane: ``route`` turns x into a :class:`RoutingResult` (expert
   ids, gate weights, valid slots, router probabilities), selecting on the
   router state's bias when the router uses one;
2. balance plane: the capacity rule drops copies beyond each expert's
   capacity (``routing`` in aux is the decision after it); losses, loads and
   metrics are computed on the decision *before* it (Switch eq. 4-5 count
   every token's choice; the bias controller balances what the router
   chose);
3. execution plane: an executor computes the routed FFN experts for the kept
   slots (:mod:`moejax.execution.executor`; expert-parallel:
   :mod:`moejax.execution.parallel`);
4. topology plane: zero-computation and shared experts are added per token.

Nothing is stored on the side and nothing is updated: ``state`` (the router
bias, the ideas' state) is read, never written. ``aux.router_load`` is the
controller's input, ``aux.observed`` the stateful ideas'; the train step
applies :func:`moejax.balance.controller.update_bias` and
:func:`moejax.routing.state.update` once per optimizer step on those of the
whole global batch, outside the differentiated function.

``aux``: a :class:`~moejax.balance.aux.MoEAux` (the fields a kind does not
fill are None): ``losses`` (weighted, with ``total``: what the trainer adds to the
objective), ``metrics`` (per layer kind, see :mod:`moejax.balance.metrics`),
and for routed layers ``load`` f32[E] and ``router_load`` f32[E_r] (token
copies the router sent, before capacity, summed over ``axis_names``),
``num_dropped`` (copies capacity removed, summed over ``axis_names``),
``routing`` (the RoutingResult after capacity) and ``execution`` (the
executor's extras; empty on one device).

:func:`ep_moe_layer` is the same layer under ``jax.shard_map`` with the
expert-parallel executor and the mesh axes as ``axis_names``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.balance import capacity as capacity_lib
from moejax.balance.aux import MoEAux
from moejax.balance import losses, metrics, stats
from moejax.config import MoEConfig, ParallelConfig
from moejax.config.registry import LAYERS
from moejax.execution import executor as executor_lib
from moejax.execution import parallel as parallel_lib
from moejax.execution import placement as placement_lib
from moejax.execution import scopes
from moejax.routing import replay as replay_lib
from moejax.routing import router as router_lib
from moejax.routing import soft as soft_lib
from moejax.routing import state as state_lib
from moejax.routing.types import RouterState, RoutingContext, RoutingResult
from moejax.topology import accounting as accounting_lib
from moejax.topology import experts as experts_lib
from moejax.topology import peer as peer_lib
from moejax.topology import roles as roles_lib
from moejax.topology import zero_compute as zero_lib

Params = dict[str, Any]


def init_moe_params(key: jax.Array, d_model: int, cfg: MoEConfig,
                    dtype=jnp.float32) -> Params:
  """All trainable parameters of one MoE layer (a nested dict): the layer kind's ``init``."""
  cfg.check_resolved("init_moe_params")
  return cfg.layer.init(key, d_model, cfg, dtype)


def _init_sparse(key, d_model, cfg, dtype) -> Params:
  k_router, k_experts, k_shared, k_zero = jax.random.split(key, 4)
  params: Params = {
      "router": router_lib.init_router_params(k_router, d_model, cfg),
      "experts": experts_lib.init_experts(k_experts, d_model, cfg, dtype),
  }
  if cfg.topology.num_shared_experts:
    params["shared"] = experts_lib.init_shared(k_shared, d_model, cfg)
  if cfg.num_zero_compute:
    params["zero_compute"] = zero_lib.init_zero_compute(k_zero, d_model, cfg)
  return params


def init_router_state(cfg: MoEConfig) -> RouterState:
  """Zero bias over every routed column, and the first state of the config's stateful ideas."""
  return RouterState.zeros(cfg.num_routed).replace(ideas=state_lib.init(cfg))


def route_and_drop(params: Params, x: jax.Array, state: RouterState, cfg: MoEConfig, *,
                   token_ids, rng, train: bool, context: Optional[RoutingContext] = None,
                   replay: Optional[replay_lib.RoutingReplay] = None):
  """(decision, kept, dropped bool[T, K], capacity or None): the router, then capacity.

  ``decision`` is the router's result; ``kept`` the same with the dropped
  copies made invalid (``decision`` itself when the layer is dropless).
  ``context``: the batch x belongs to (default: x alone, on one device).
  ``replay``: a recorded selection [T, K] that replaces the router's, gated
  by the router (:func:`moejax.routing.replay.apply_replay`).
  """
  decision = router_lib.route(params["router"], x, state, cfg, token_ids=token_ids, rng=rng,
                              train=train, context=context)
  if replay is not None:
    decision = replay_lib.apply_replay(decision, replay, cfg)
  cf = cfg.balance.capacity_factor
  if cf is None:
    return decision, decision, jnp.zeros_like(decision.valid), None
  cap = capacity_lib.expert_capacity(x.shape[0], cfg.num_experts, decision.k, cf)
  kept, dropped = capacity_lib.apply_capacity(decision, cap, num_experts=cfg.num_experts,
                                              priority=cfg.balance.drop_priority)
  return decision, kept, dropped, cap


def token_local_experts(params: Params, x: jax.Array, shared_x: jax.Array,
                        result: RoutingResult, cfg: MoEConfig) -> jax.Array:
  """y[T, d] of the zero-computation experts (on x) and shared experts (on shared_x)."""
  y = jnp.zeros_like(x)
  if cfg.num_zero_compute:
    # Zero-computation experts are elementwise; their [T, Z] gates come from
    # the same routing result as the FFN experts.
    z_out = zero_lib.apply_zero_compute(params["zero_compute"], x, cfg)
    z_gates = result.combine_weights()[:, cfg.num_experts:]
    y = y + jnp.einsum("tz,tzd->td", z_gates.astype(z_out.dtype), z_out)
  if cfg.topology.num_shared_experts:
    y = y + experts_lib.apply_shared(params["shared"], shared_x).astype(y.dtype)
  return y


def _sparse_layer(params, x, shared_x, state, cfg, *, token_ids, rng, train, axis_names,
                  batch_shape, executor, width_mask, replay=None):
  # The batch the router decides on: this call's tokens, split over axis_names.
  context = RoutingContext.build(x.shape[0], axis_names, batch_shape=batch_shape, train=train)
  with jax.named_scope(scopes.ROUTE):
    decision, kept, dropped, cap = route_and_drop(params, x, state, cfg, token_ids=token_ids,
                                                  rng=rng, train=train, context=context,
                                                  replay=replay)
  if width_mask is None and cfg.topology.expert_widths is not None:
    width_mask = experts_lib.width_mask(cfg)
  # The executor's phases (dispatch, expert FFN, all-to-all, combine) carry their own scopes.
  y, extras = executor(params["experts"], x, kept, width_mask=width_mask, capacity=cap)
  with jax.named_scope(scopes.SHARED):
    y = y + token_local_experts(params, x, shared_x, kept, cfg)
  with jax.named_scope(scopes.BALANCE):
    router_load = metrics.expert_load(decision, cfg.num_routed, axis_names)
    aux = MoEAux.for_kind(
        cfg.layer,
        losses=losses.balance_losses(decision, cfg, batch_shape=batch_shape,
                                     axis_names=axis_names, context=context,
                                     state=state.ideas),
        metrics=metrics.routing_metrics(decision, cfg, dropped=dropped, axis_names=axis_names),
        load=router_load[: cfg.num_experts],
        router_load=router_load,
        num_dropped=stats.psum(jnp.sum(dropped, dtype=jnp.int32), axis_names),
        routing=kept,
        selection=replay_lib.RoutingReplay.of(decision),
        execution=extras,
        observed=state_lib.observe(decision, cfg, state.ideas, context))
  return y, aux


def _soft_layer(params, x, cfg, batch_shape, axis_names):
  """Soft MoE (Puigcerver et al. 2308.00951), one sequence at a time.

  Every slot mixes all tokens of its sequence, so the layer is not causal.
  """
  b, s = batch_shape
  xs = x.reshape(b, s, -1)
  t, p = cfg.topology, cfg.layer_options.slots_per_expert
  mask = experts_lib.width_mask(cfg) if t.expert_widths is not None else None

  def one(x_sd):
    dispatch, combine, _ = soft_lib.soft_weights(params["router"], x_sd, cfg)
    slots = jnp.einsum("sp,sd->pd", dispatch.astype(x_sd.dtype), x_sd)
    slots = slots.reshape(cfg.num_experts, p, -1)  # [E, p, d]
    out = experts_lib.experts_dense(params["experts"], slots, t.activation, mask)
    out = out.reshape(cfg.num_experts * p, -1)  # [P, d]
    return jnp.einsum("sp,pd->sd", combine.astype(out.dtype), out), dispatch, combine

  y, dispatch, combine = jax.vmap(one)(xs)
  zero = jnp.zeros((), jnp.float32)
  aux = MoEAux.for_kind(cfg.layer, losses={"total": zero},
                        metrics=metrics.soft_metrics(dispatch, combine, cfg,
                                                     axis_names=axis_names))
  return y.reshape(x.shape), aux


def _peer_layer(params, x, cfg, axis_names):
  y, peer_aux = peer_lib.peer_apply(params["peer"], x, cfg)
  aux = MoEAux.for_kind(cfg.layer, losses={"total": jnp.zeros((), jnp.float32)},
                        metrics=metrics.peer_metrics(peer_aux["expert_ids"], cfg,
                                                     axis_names=axis_names))
  return y, aux


def moe_layer(params: Params, x: jax.Array, state: Optional[RouterState],
              cfg: MoEConfig, *, token_ids: Optional[jax.Array] = None,
              rng: Optional[jax.Array] = None, train: bool = False,
              axis_names: Sequence[str] = (),
              executor: Optional[executor_lib.Executor] = None,
              shared_x: Optional[jax.Array] = None,
              width_mask: Optional[jax.Array] = None,
              replay: Optional[replay_lib.RoutingReplay] = None) -> tuple[jax.Array, MoEAux]:
  """Applies one MoE layer.

  Args:
    params: from :func:`init_moe_params`.
    x: [B, S, d] or [T, d] activations (a 2-D input is one sequence): what the
      router and the routed / zero-computation experts read.
    state: router state from :func:`init_router_state` (None: zeros); read only.
    cfg: the layer config.
    token_ids: int[B, S] or int[T], needed by hash routing.
    rng: PRNG key for router jitter / noise (training only).
    train: enables noise and jitter.
    axis_names: mesh axes over which global statistics (loads, global-batch
      balance loss, MaxVio, drops) are reduced when called inside ``shard_map``,
      and over which a batch-wide router decides (its ``RoutingContext``).
    executor: computes the routed experts (default: the single-device
      executor ``cfg.execution`` names).
    shared_x: what the shared experts read (default x; ScMoE passes the
      current block's representation while x is the previous block's).
    width_mask: f32[E, f] hidden-unit mask of heterogeneous experts in the
      executor's expert order (default: from ``cfg``).
    replay: a recorded selection (:class:`~moejax.routing.replay.RoutingReplay`,
      [B, S, K] or [T, K], e.g. an earlier forward's ``aux.selection``) used
      instead of the router's, with weights from the router's current scores;
      routed layers only.

  Returns:
    ``(y, aux)``: y has x's shape and dtype; aux as the module docstring says
    (``aux.selection``: the decision's selection before capacity, [T, K]).
  """
  if state is None:
    state = init_router_state(cfg)
  shape = x.shape
  if x.ndim == 2:
    batch_shape = (1, shape[0])
  elif x.ndim == 3:
    batch_shape = shape[:2]
  else:
    raise ValueError(f"moe_layer: x has shape {shape}; expected [B, S, d] or [T, d]")
  if shared_x is not None and shared_x.shape != shape:
    raise ValueError(f"moe_layer: shared_x has shape {shared_x.shape}, x has {shape}")
  x2 = x.reshape(-1, shape[-1])
  ids = None if token_ids is None else jnp.asarray(token_ids).reshape(-1)
  if ids is not None and ids.shape[0] != x2.shape[0]:
    raise ValueError(f"moe_layer: token_ids has {ids.shape[0]} entries for "
                     f"{x2.shape[0]} tokens; pass one id per token")
  axis_names = tuple(axis_names)
  cfg.check_resolved("moe_layer")
  sx = x2 if shared_x is None else shared_x.reshape(-1, shape[-1])
  kw = {}
  if replay is not None:
    kw["replay"] = _layer_replay(replay, shape[:-1], cfg)
  y, aux = cfg.layer.apply(params, x2, sx, state, cfg, token_ids=ids, rng=rng, train=train,
                           axis_names=axis_names, batch_shape=batch_shape, executor=executor,
                           width_mask=width_mask, **kw)
  return y.reshape(shape).astype(x.dtype), aux


def _layer_replay(replay, token_shape, cfg: MoEConfig) -> replay_lib.RoutingReplay:
  """The replay of a routed layer, checked against its tokens and flattened to [T, K]."""
  if not cfg.layer.routed:
    raise ValueError(f"moe_layer: replay given to a moe.kind={cfg.kind!r} layer, which has no "
                     "token routing to replay. Fix: replay routed (moe.kind='sparse') layers only")
  replay_lib.check_replay(replay, tuple(token_shape), cfg, where="moe_layer")
  return replay.reshape(-1)


def ep_moe_layer(params: Params, x: jax.Array, state: Optional[RouterState], cfg: MoEConfig,
                 mesh: Mesh, pcfg: ParallelConfig = ParallelConfig(), *,
                 token_ids: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
                 train: bool = False, shared_x: Optional[jax.Array] = None,
                 placement: Optional[placement_lib.Placement] = None,
                 replay: Optional[replay_lib.RoutingReplay] = None
                 ) -> tuple[jax.Array, MoEAux]:
  """:func:`moe_layer` with expert parallelism; call it inside ``jax.jit``.

  The layer runs under ``jax.shard_map`` over ``mesh`` (axes ('data',
  'fsdp', 'expert'), :func:`moejax.execution.mesh.make_mesh`): each device
  routes its B / N sequences, applies the capacity rule to them (GShard's
  groups), and the expert-parallel executor moves the kept copies to the
  devices holding their experts and back. Loads, metrics, drops and
  global-scope losses are reduced over the whole mesh, so they equal the
  single-device layer's on the whole batch; batch- and sequence-scope losses
  are local by definition and returned as their mean over devices. Router
  noise uses ``fold_in(rng, device index)``: with noise on, the layer equals
  the single-device one in distribution, not bitwise.

  Args:
    params: from :func:`init_moe_params` (logical experts [E, ...]; place them
      with :func:`moejax.execution.mesh.shard_params` to avoid reshards).
    x: [B, S, d] with B divisible by the mesh's device count.
    cfg: a ``kind='sparse'`` layer config whose routing limit (if any) was
      resolved for ``pcfg`` (:func:`moejax.config.resolve_route_limit`).
    pcfg: dispatch path, routing limits, nodes; its expert axis must match
      the mesh's.
    shared_x / token_ids / rng / train: as :func:`moe_layer`.
    replay: as :func:`moe_layer`, [B, S, K] (split over devices like x).
    placement: optional expert placement (replicas of hot experts).

  Returns:
    ``(y [B, S, d], aux)`` with :func:`moe_layer`'s fields (``out_specs`` from
    :meth:`MoEAux.out_specs`); ``aux.routing`` is [B*S, K] in global token
    order and ``aux.execution`` holds
    ``device_load`` f32[D] and ``comm`` (byte counts).
  """
  if state is None:
    state = init_router_state(cfg)
  if x.ndim != 3:
    raise ValueError(f"ep_moe_layer: x has shape {x.shape}; expected [B, S, d] (the batch "
                     "is split over devices by whole sequences)")
  for name, arr, want in (("token_ids", token_ids, x.shape[:2]), ("shared_x", shared_x,
                                                                   x.shape)):
    if arr is not None and tuple(arr.shape) != tuple(want):
      raise ValueError(f"ep_moe_layer: {name} has shape {arr.shape}; expected {want}")
  if replay is not None:
    _layer_replay(replay, x.shape[:2], cfg)  # refused before any compute
  mask = experts_lib.width_mask(cfg) if cfg.topology.expert_widths is not None else None
  prep = parallel_lib.prepare(params, cfg, mesh, pcfg, x.shape[0], x.shape[-1],
                              width_mask=mask, placement=placement)
  ex, tok = prep.executor, prep.token_spec
  args = {"params": prep.params, "x": x, "state": state}
  in_specs = {"params": prep.param_specs, "x": tok, "state": P()}
  for name, arr, spec in (("token_ids", token_ids, tok), ("shared_x", shared_x, tok),
                          ("rng", rng, P()), ("width_mask", prep.width_mask, P("expert")),
                          ("replay", replay, tok)):
    if arr is not None:
      args[name], in_specs[name] = arr, spec

  def body(a):
    key = a.get("rng")
    if key is not None:
      key = jax.random.fold_in(key, parallel_lib.device_index(ex.axes))
    y, aux = moe_layer(a["params"], a["x"], a["state"], cfg, token_ids=a.get("token_ids"),
                       rng=key, train=train, axis_names=ex.axes, executor=ex,
                       shared_x=a.get("shared_x"), width_mask=a.get("width_mask"),
                       replay=a.get("replay"))
    return y, aux.reduce_on_exit(lambda v: stats.pmean(v, ex.axes))

  out_specs = (tok, MoEAux.out_specs(tok, cfg.layer))
  return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                       check_vma=False)(args)


# ---------------------------------------------------------------------------
# Layer kinds: one registered object each (moejax.config.registry.LAYERS).

@dataclasses.dataclass(frozen=True)
class NoOptions:
  """A layer kind without options of its own."""


class LayerKind:
  """A kind of MoE layer: its parameters, its forward, and what it can do.

  Capabilities (read by config rules, accounting, serving, fine-tuning,
  interop and expert parallelism instead of comparing ``moe.kind``):

  - ``routed``: tokens are routed by a registered router (``moe.routing``,
    ``moe.balance`` and ``moe.execution`` apply, with capacity, shared and
    zero-computation experts);
  - ``expert_bank``: the layer has routed FFN experts as [E, ...] weights
    (expert sharing across layers, expert LoRA, the expert memory);
  - ``product_keys``: PEER's product-key retrieval;
  - ``causal``: a token's output depends on it and earlier tokens only
    (decoding), else ``why_not_causal`` says why;
  - ``segmentable``: fine-grained segmentation applies;
  - ``expert_parallel``: ``ep_moe_layer`` runs it;
  - ``honoured``: section -> the fields it reads (None: all of them); any
    other field set away from its default is refused with ``why``;
  - ``components``: its parameter / FLOP accounting
    (:mod:`moejax.topology.accounting`).

  What it carries:

  - ``Options``: a frozen dataclass of its own fields, ``moe.layer_options``
    in the config (Soft MoE's slots, PEER's keys; checked in its
    ``__post_init__``, each error naming ``moe.layer_options.<field>``);
    :meth:`check` ties them to the other sections;
  - ``aux_fields`` / ``metric_fields``: the :class:`~moejax.balance.aux.MoEAux`
    and :class:`~moejax.balance.aux.LayerMetrics` fields its layer fills (the
    others are None; ``MoEAux.for_kind(kind, ...)`` checks it), and ``Aux``:
    the type of its own aux beyond them (a ``flax.struct`` dataclass, in
    ``aux.kind_aux``; None: it has none).
  """

  name = ""
  routed = False
  expert_bank = True
  product_keys = False
  causal = True
  why_not_causal = ""
  segmentable = True
  why_not_segmentable = ""
  expert_parallel = False
  honoured: dict = {}
  why = ""
  routing_fix = "use moe.kind='sparse'"
  components = None
  router_component = "router"  # what the budget audit counts its params["router"] as
  Options: type = NoOptions
  aux_fields: tuple = ("losses", "metrics")
  metric_fields: tuple = ()
  Aux: Optional[type] = None

  def check(self, cfg: MoEConfig) -> None:
    """Rules tying ``cfg.layer_options`` to the other sections (a ConfigError; none by default)."""

  def has_router_weights(self, cfg: MoEConfig) -> bool:
    """Whether the layer has router weights (what fine-tuning can freeze)."""
    return False

  def __repr__(self) -> str:
    return f"<layer kind {self.name!r} ({type(self).__module__}.{type(self).__name__})>"

  def init(self, key: jax.Array, d_model: int, cfg: MoEConfig, dtype) -> Params:
    raise NotImplementedError

  def param_roles(self, params: Params) -> dict:
    """What each subtree of ``init``'s params is to an optimizer
    (:mod:`moejax.topology.roles`; a role stands for its whole subtree). The
    default, for a kind that declares nothing: every parameter element-wise
    (never orthogonalised)."""
    return roles_lib.roles_like(params, {}, roles_lib.elementwise(self.name))

  def apply(self, params, x, shared_x, state, cfg, **kw) -> tuple[jax.Array, Any]:
    raise NotImplementedError


def register_kind(kind: LayerKind) -> LayerKind:
  """Registers a layer kind (an instance); a name already registered is an error."""
  if not (dataclasses.is_dataclass(kind.Options) and kind.Options.__dataclass_params__.frozen):
    raise TypeError(f"layer kind {kind.name!r}: Options must be a frozen dataclass, got "
                    f"{kind.Options!r}. Fix: decorate it with @dataclasses.dataclass(frozen=True)")
  return LAYERS.register(kind)


class SparseKind(LayerKind):
  """Routed experts: router, capacity, executor, shared and zero-computation experts."""

  name = "sparse"
  routed = True
  expert_parallel = True
  honoured = {
      "topology": {"num_experts", "expert_width", "expert_widths", "activation",
                   "num_shared_experts", "shared_expert_width", "shared_expert_gate",
                   "zero_experts", "copy_experts", "constant_experts", "granularity",
                   "isolate_shared", "derived_from"},
      "routing": None, "balance": None, "execution": None,
  }
  why = "a routed (sparse) layer has no Soft MoE slots or PEER keys"
  components = staticmethod(accounting_lib.sparse_components)
  aux_fields = ("losses", "metrics", "load", "router_load", "num_dropped", "routing",
                "selection", "execution", "observed")
  metric_fields = ("load", "max_vio", "load_entropy", "active_mean", "active_var",
                   "active_over_max", "zero_compute_fraction", "coactivation", "drop_rate")

  def has_router_weights(self, cfg):
    return cfg.router.param_count(1, cfg) > 0

  def init(self, key, d_model, cfg, dtype):
    return _init_sparse(key, d_model, cfg, dtype)

  def param_roles(self, params):
    """Routers and the constant experts' gates and vectors element-wise; the expert stack
    per expert; the shared experts as one dense FFN."""
    out = roles_lib.roles_like(params, {"router": roles_lib.elementwise("router")},
                               roles_lib.elementwise("zero_compute"))
    out["experts"] = experts_lib.expert_roles(params["experts"])
    if "shared" in params:
      out["shared"] = experts_lib.shared_roles(params["shared"])
    return out

  def apply(self, params, x, shared_x, state, cfg, *, token_ids, rng, train, axis_names,
            batch_shape, executor, width_mask, replay=None):
    return _sparse_layer(params, x, shared_x, state, cfg, token_ids=token_ids, rng=rng,
                         train=train, axis_names=axis_names, batch_shape=batch_shape,
                         executor=executor or executor_lib.local_executor(cfg),
                         width_mask=width_mask, replay=replay)


class SoftKind(LayerKind):
  """Soft MoE (Puigcerver et al. 2308.00951): slots mix every token of a sequence."""

  name = "soft"
  causal = False
  why_not_causal = ("Soft MoE mixes every token of a sequence into each slot, so token t's "
                    "output depends on later tokens")
  honoured = {
      "topology": {"num_experts", "expert_width", "expert_widths", "activation",
                   "granularity", "isolate_shared", "derived_from"},
      "routing": {"freeze", "router_dtype"}, "balance": set(), "execution": {"interpret"},
  }
  why = ("Soft MoE mixes every token into every slot: there is no per-token routing, "
         "selection bias, balance loss, capacity or grouped-matmul backend")
  routing_fix = "use moejax.routing.soft.soft_weights"
  router_component = "soft_moe"
  components = staticmethod(accounting_lib.soft_components)
  Options = soft_lib.SoftOptions
  metric_fields = ("load", "max_vio", "load_entropy", "dispatch_entropy", "combine_entropy")

  def has_router_weights(self, cfg):
    return True

  def init(self, key, d_model, cfg, dtype):
    k_router, k_experts, _, _ = jax.random.split(key, 4)
    return {"router": soft_lib.init_soft_params(k_router, d_model, cfg),
            "experts": experts_lib.init_experts(k_experts, d_model, cfg, dtype)}

  def param_roles(self, params):
    """The slot embeddings (phi) and their scale element-wise; the expert stack per expert."""
    return {"router": roles_lib.elementwise("soft_moe"),
            "experts": experts_lib.expert_roles(params["experts"])}

  def apply(self, params, x, shared_x, state, cfg, *, axis_names, batch_shape, **_):
    return _soft_layer(params, x, cfg, batch_shape, axis_names)


class PeerKind(LayerKind):
  """PEER (He 2407.04153): product-key retrieval over singleton experts."""

  name = "peer"
  expert_bank = False
  product_keys = True
  segmentable = False
  why_not_segmentable = "PEER experts are single neurons and cannot be segmented"
  honoured = {
      "topology": {"activation", "derived_from"},
      "routing": set(), "balance": set(), "execution": {"interpret"},
  }
  why = ("PEER retrieves singleton experts by product keys: it has no router, balance "
         "loss, capacity or grouped-matmul backend; its sizes are moe.layer_options")
  routing_fix = "PEER retrieves experts by product keys, not through this router"
  components = staticmethod(accounting_lib.peer_components)
  Options = peer_lib.PeerOptions
  metric_fields = ("max_vio", "load_entropy", "experts_touched", "key_max_vio", "key_entropy")

  def init(self, key, d_model, cfg, dtype):
    _, k_experts, _, _ = jax.random.split(key, 4)
    return {"peer": peer_lib.init_peer(k_experts, d_model, cfg)}

  def param_roles(self, params):
    return {"peer": peer_lib.peer_roles(params["peer"])}

  def apply(self, params, x, shared_x, state, cfg, *, axis_names, **_):
    return _peer_layer(params, x, cfg, axis_names)


for _kind in (SparseKind(), SoftKind(), PeerKind()):
  register_kind(_kind)
