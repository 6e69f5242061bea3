"""The routing plane: which experts each token uses, with what weight.

Entry points: :func:`moejax.routing.router.route` and
:func:`moejax.routing.router.init_router_params` (sparse layers),
:func:`moejax.routing.soft.soft_weights` and
:func:`moejax.routing.soft.init_soft_params` (Soft MoE).
"""

from moejax.routing.router import ROUTERS, init_router_params, route
from moejax.routing.soft import init_soft_params, soft_weights
from moejax.routing.types import RouterState, RoutingResult

__all__ = ["ROUTERS", "RouterState", "RoutingResult", "init_router_params",
           "init_soft_params", "route", "soft_weights"]
