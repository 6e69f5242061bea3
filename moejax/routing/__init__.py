"""The routing plane: which experts each token uses, with what weight.

Entry points: :func:`moejax.routing.router.route` and
:func:`moejax.routing.router.init_router_params` (routed layers),
:func:`moejax.routing.soft.soft_weights` and
:func:`moejax.routing.soft.init_soft_params` (Soft MoE).

A router kind is a registered :class:`RouterSpec` (``moejax.routing.spec``);
importing this package registers the shipped ones (topk, expert_choice,
hash, top_p, hierarchical, sbase, remoe) with the same :func:`register` a
researcher's module calls. ``ROUTERS`` is the registry: ``ROUTERS.get(name)``
is the spec of a name, ``ROUTERS.names()`` every name.
A router reads the batch it decides on through a :class:`RoutingContext`; a
router, balance loss or bias rule may declare per-layer state with an
:class:`IdeaState` (:mod:`moejax.routing.state`).
"""

from moejax.config.registry import ROUTERS
from moejax.routing.spec import NoOptions, RouterSpec, register
# Importing a router's module registers it.
from moejax.routing import topk, expert_choice, hashing, top_p, hierarchical  # noqa: F401
from moejax.routing import sbase, remoe  # noqa: F401
from moejax.routing.router import init_router_params, route, spec_of
from moejax.routing.soft import init_soft_params, soft_weights
from moejax.routing.types import IdeaState, RouterState, RoutingContext, RoutingResult

__all__ = ["IdeaState", "NoOptions", "ROUTERS", "RouterSpec", "RouterState", "RoutingContext",
           "RoutingResult",
           "init_router_params", "init_soft_params", "register", "route", "soft_weights",
           "spec_of"]
