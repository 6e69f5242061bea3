"""What a router kind is: one object with its options, parameters, rule and capabilities.

Legend: T tokens, d model width, E FFN experts, Z zero-computation experts,
E_r = E + Z router outputs, K slots per token.

A router kind is a :class:`RouterSpec` subclass instance registered under
its ``name`` with :func:`register` (the shipped ones in this package use the
same call a researcher's module does). Everything outside the routing plane
asks the spec, never the kind's name:

- options: ``Options``, a frozen dataclass of the router's own fields, checked
  in its ``__post_init__`` with :mod:`moejax.config.core`'s helpers and
  found in the config at ``moe.routing.options`` (shown by
  ``--print_config``, written to ``config.json``; a field of another kind's
  options is refused);
- parameters: :meth:`RouterSpec.param_shapes` (what the accounting, the
  budget check and the parameter audit count) and :meth:`init_params`;
- the rule: :meth:`RouterSpec.route`, returning the one
  :class:`~moejax.routing.types.RoutingResult`;
- capabilities, class attributes read by config rules, accounting, serving,
  fine-tuning, interop and expert parallelism (below).

The rule's contract: ``route(params, x, bias, cfg, *, token_ids, rng, train)``
returns the decision for x[T, d] (already in the router dtype and jittered).
A router whose ``route`` also has a ``context`` parameter is handed a
:class:`~moejax.routing.types.RoutingContext`: the mesh axes the batch is
split over, the batch's token count, train or eval, and sums, means, maxima
and gathers over every token of the batch. Routers without it are called
as before.

A router is *token-local* (each token's decision reads that token only; the
default) or *batch-wide* (``batch_wide = True``: it reads other tokens).
Under expert parallelism each device routes its share of the batch, so a
batch-wide router takes every statistic over tokens through the context;
it then decides on the whole batch, as on one device. One that takes no
``context``, or declares ``expert_parallel = False``, is refused before any
compute (:attr:`RouterSpec.why_not_expert_parallel`).

A token-local router (a linear router with a temperature)::

    import dataclasses
    from moejax import routing
    from moejax.config import check_positive
    from moejax.routing.logits import router_logits
    from moejax.routing.topk import select_topk

    @dataclasses.dataclass(frozen=True)
    class TemperedOptions:                 # moe.routing.options.temperature
      temperature: float = 1.0
      def __post_init__(self):
        check_positive("moe.routing.options.temperature", self.temperature)

    class Tempered(routing.RouterSpec):
      name = "tempered"
      Options = TemperedOptions
      supports_bias = True                 # select_topk selects on score + bias
      def route(self, params, x, bias, cfg, *, token_ids, rng, train):
        logits = router_logits(params["w"], x, cfg.routing, rng, train)
        return select_topk(logits / cfg.routing.opts.temperature, bias, cfg)

    routing.register(Tempered())

A batch-wide router (each expert's logit centred on its mean over the batch)::

    class Centred(routing.RouterSpec):
      name = "centred"
      batch_wide = True
      def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
        logits = router_logits(params["w"], x, cfg.routing, rng, train)
        return select_topk(logits - context.mean(logits), None, cfg)

    routing.register(Centred())

(``tests/routing/test_context.py`` runs both as written.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from moejax.config.registry import ROUTERS
from moejax.routing.gating import gate_weights
from moejax.routing.scores import scores
from moejax.routing.types import IdeaState

# Switch Transformer (Fedus et al. §2.4): truncated normal, variance 0.1 / d
# (their scale s = 0.1, ten times below the usual fan-in init). A small init
# keeps the early routing near uniform and, with the f32 router, stable.
ROUTER_INIT = jax.nn.initializers.variance_scaling(0.1, "fan_in", "truncated_normal")


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """A router without options of its own."""


class RouterSpec:
  """A router kind. Subclass, set ``name`` (and ``Options``), implement :meth:`route`.

  Capabilities (class attributes; the defaults describe a linear token-choice
  router like top-k):

  - ``token_choice``: each token picks its experts (``top_k`` slots), so
    capacity factors, shared experts and ``top_k <= E_r`` apply. Expert
    choice is not.
  - ``reads_activations``: routes from x (input jitter and logit noise
    apply); hash routing reads token ids instead.
  - ``needs_token_ids``: ``route`` needs the token ids.
  - ``supports_bias``: selects on score + ``RouterState.bias`` (the
    aux-loss-free controller's bias).
  - ``supports_groups``: group-limited selection (``routing.n_groups``), and
    so node/device-limited routing under expert parallelism.
  - ``scores_all_columns``: gives every router column a score, as
    zero-computation experts need.
  - ``trainable``: has weights a balance loss can train (hash has none).
  - ``causal``: a token's experts depend on it and earlier tokens only, so
    the model can decode token by token.
  - ``batch_wide``: a token's decision reads other tokens of the batch
    (Sinkhorn balancing, expert choice); its ``route`` takes ``context`` and
    reduces over tokens through it.
  - ``expert_parallel``: runs under ``ep_moe_layer`` with the single-device
    layer's decision (a token-local router always; a batch-wide one through
    its context). False refuses expert parallelism before any compute.
  - ``isolates_shared``: DeepSeekMoE shared-expert isolation (routing
    ``m K - K_s`` of a fixed K) is defined for it.

  ``state``: the router's per-layer :class:`~moejax.routing.types.IdeaState`
  (None: stateless); a ``route`` with a ``state`` parameter reads it as
  ``state[name][field]``.
  """

  name: ClassVar[str] = ""
  Options: ClassVar[type] = NoOptions
  token_choice: ClassVar[bool] = True
  reads_activations: ClassVar[bool] = True
  needs_token_ids: ClassVar[bool] = False
  supports_bias: ClassVar[bool] = False
  supports_groups: ClassVar[bool] = False
  scores_all_columns: ClassVar[bool] = True
  trainable: ClassVar[bool] = True
  causal: ClassVar[bool] = True
  why_not_causal: ClassVar[str] = ""
  batch_wide: ClassVar[bool] = False
  expert_parallel: ClassVar[bool] = True
  isolates_shared: ClassVar[bool] = False
  state: ClassVar[Optional[IdeaState]] = None

  @property
  def reads_context(self) -> bool:
    """Whether ``route`` takes the RoutingContext (it has a ``context`` parameter)."""
    return _takes_context(type(self).route)

  @property
  def why_not_expert_parallel(self) -> str:
    """Why this router cannot run on a batch split over devices ('' when it can)."""
    if not self.expert_parallel:
      what = "batch-wide router" if self.batch_wide else "router"
      return (f"{what} {self.name!r} declares expert_parallel=False: it cannot decide on "
              "a batch split over devices")
    if self.batch_wide and not self.reads_context:
      return (f"router {self.name!r} is batch_wide=True but its route() takes no context, "
              "so on a batch split over devices it would decide on each device's share, "
              "not the batch")
    return ""

  # --- Config. -------------------------------------------------------------

  def check(self, cfg) -> None:
    """Cross-field rules of this router on a built MoEConfig (ConfigError or return)."""

  def granular(self, options: Any, m: int) -> Any:
    """The options after fine-grained segmentation by m (m E experts, top m K)."""
    del m
    return options

  # --- Parameters. ---------------------------------------------------------

  def param_shapes(self, d_model: int, cfg) -> dict[str, tuple[int, ...]]:
    """name -> shape of every router parameter; default one matrix w [d, E_r]."""
    return {"w": (d_model, cfg.num_routed)}

  def init_params(self, key: jax.Array, d_model: int, cfg) -> dict:
    """Parameters of :meth:`param_shapes`, Switch's small truncated normal each."""
    shapes = self.param_shapes(d_model, cfg)
    if not shapes:  # a parameter-free router needs no key
      return {}
    # At least two keys: the first parameter's key is split(key)[0], as it was
    # before routers were objects (trained and golden params stay the same).
    keys = jax.random.split(key, max(len(shapes), 2))
    return {n: ROUTER_INIT(k, s, jnp.float32) for k, (n, s) in zip(keys, shapes.items())}

  # --- The rule. -----------------------------------------------------------

  def route(self, params: dict, x: jax.Array, bias: Optional[jax.Array], cfg, *,
            token_ids: Optional[jax.Array], rng: Optional[jax.Array],
            train: bool):
    """RoutingResult for x[T, d] (already in the router dtype and jittered).

    Add a ``context`` keyword parameter to receive the
    :class:`~moejax.routing.types.RoutingContext` (batch-wide routers).
    """
    raise NotImplementedError(f"router {self.name!r} does not implement route()")

  def result_k(self, cfg) -> int:
    """K, the slots per token of the RoutingResult ``route`` returns (what a replay holds):
    ``routing.top_k`` for a token-choice router, every router output otherwise."""
    return cfg.routing.top_k if self.token_choice else cfg.num_routed

  def replay_weights(self, result, expert_ids: jax.Array, valid: jax.Array, cfg) -> jax.Array:
    """Gates f32[T, K] of a replayed selection (routing replay, :mod:`moejax.routing.replay`).

    ``result`` is this router's decision for the same tokens (its ``logits``
    and ``probs`` are this forward's scores); ``expert_ids`` / ``valid`` the
    recorded selection. Default: ``moe.routing.gating`` of the scores of the
    logits (:func:`~moejax.routing.gating.gate_weights`), right for a router
    that gates its own selection that way (top-k, top-p, S-BASE); a router
    that gates otherwise overrides it, so replaying its own selection gives
    its own weights.
    """
    rc = cfg.routing
    s = scores(result.logits, rc.score_fn)
    return gate_weights(s, result.logits, expert_ids, valid, rc.gating, rc.routed_scaling_factor)

  # --- Accounting. ---------------------------------------------------------

  def slots(self, cfg) -> tuple[float, float]:
    """(expected FFN-expert slots per token, maximal slots per token).

    Default: K E / E_r expected (the other slots land on zero-computation
    experts, for a router that spreads them like the experts) and K at most.
    """
    r = cfg.routing
    return r.top_k * cfg.num_experts / cfg.num_routed, float(r.top_k)

  def router_flops(self, d_model: int, cfg) -> float:
    """Forward FLOPs per token of the router: default 2 x every parameter (matmuls)."""
    return 2.0 * self.param_count(d_model, cfg)

  def param_count(self, d_model: int, cfg) -> int:
    return sum(math.prod(s) for s in self.param_shapes(d_model, cfg).values())

  def __repr__(self) -> str:
    return f"<router {self.name!r} ({type(self).__module__}.{type(self).__name__})>"


@functools.lru_cache(maxsize=None)
def _takes_context(route_fn) -> bool:
  return "context" in inspect.signature(route_fn).parameters


def register(spec: RouterSpec) -> RouterSpec:
  """Registers a router kind (an instance of a :class:`RouterSpec` subclass).

  A name already registered is an error. Call it at the import of the
  module that defines the router; a config file that imports that module
  can then use ``routing.kind=<name>`` in every binary.
  """
  if not isinstance(spec, RouterSpec):
    raise TypeError(f"moejax.routing.register takes a RouterSpec instance, got "
                    f"{type(spec).__name__}. Fix: subclass moejax.routing.RouterSpec and "
                    "pass an instance")
  if not dataclasses.is_dataclass(spec.Options):
    raise TypeError(f"router {spec.name!r}: Options must be a frozen dataclass, got "
                    f"{spec.Options!r}")
  return ROUTERS.register(spec)


def get(kind: str) -> RouterSpec:
  """The registered spec of ``kind`` (ConfigError naming moe.routing.kind otherwise)."""
  return ROUTERS.get(kind)
