"""The names every config field may take: one source of truth per registry.

Implementations register under these names (``moejax.routing.router.ROUTERS``,
``moejax.execution.gmm``'s backend modules, ...) and check at import time
that they cover exactly this list, so a name cannot be valid in a config and
unknown to the code, or the other way round. This module imports nothing:
configs are checked without loading JAX.
"""

# Routing plane.
ROUTER_KINDS = ("topk", "expert_choice", "hash", "top_p", "hierarchical")
SCORE_FNS = ("softmax", "sigmoid", "sqrtsoftplus")
GATINGS = ("topk_softmax", "scores", "normalized")
GROUP_SCORES = ("auto", "top2_sum", "max")
ROUTER_DTYPES = ("float32", "bfloat16", "float16")

# Balance plane.
AUX_SCOPES = ("batch", "sequence", "global")
AUX_CONVENTIONS = ("switch", "topk")
BIAS_UPDATES = ("none", "sign", "proportional")
DROP_PRIORITIES = ("position", "score")

# Topology plane.
LAYER_KINDS = ("sparse", "soft", "peer")
ACTIVATIONS = ("swiglu", "gelu")

# Execution plane. Grouped-matmul backends live in moejax.execution.<module>
# (GMM_BACKEND_MODULES); ``reference`` is the layer-level oracle that runs
# every expert on every token.
GMM_BACKEND_MODULES = {
    "ragged_dot": "moejax.execution.gmm",
    "blocked": "moejax.execution.blocked",
    "pallas_tpu": "moejax.execution.pallas_tpu",
    "pallas_gpu": "moejax.execution.pallas_gpu",
}
GMM_BACKENDS = tuple(GMM_BACKEND_MODULES)
EXPERT_BACKENDS = ("reference",) + GMM_BACKENDS
DISPATCHES = ("capacity", "ragged")
DISPATCH_UNITS = ("token", "copy", "node")
RAGGED_IMPLS = ("auto", "native", "emulated")
ROUTE_LIMITS = ("none", "nodes", "devices")

# Model.
MOE_LAYOUTS = ("all", "every_other", "first_dense")
MOE_SCHEDULES = ("serial", "scmoe")
DENSE_TWINS = ("none", "active", "total")
COMPUTE_DTYPES = ("float32", "bfloat16")
MOD_GATES = ("sigmoid", "raw")
