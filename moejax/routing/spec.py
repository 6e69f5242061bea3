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

A minimal router (a linear router with a temperature)::

    @dataclasses.dataclass(frozen=True)
    class Options:
      temperature: float = 1.0

    class Tempered(RouterSpec):
      name = "tempered"
      Options = Options
      def route(self, params, x, bias, cfg, *, token_ids, rng, train):
        logits = router_logits(params["w"], x, cfg.routing, rng, train)
        return topk_decision(logits / cfg.routing.opts.temperature, bias, cfg)

    register(Tempered())
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from moejax.config.registry import ROUTERS

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
  - ``expert_parallel``: runs under ``ep_moe_layer`` (the token-major result
    is all it needs).
  - ``isolates_shared``: DeepSeekMoE shared-expert isolation (routing
    ``m K - K_s`` of a fixed K) is defined for it.
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
  expert_parallel: ClassVar[bool] = True
  isolates_shared: ClassVar[bool] = False

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
    """RoutingResult for x[T, d] (already in the router dtype and jittered)."""
    raise NotImplementedError(f"router {self.name!r} does not implement route()")

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
