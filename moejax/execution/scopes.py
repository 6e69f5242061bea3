"""The ``jax.named_scope`` names of the MoE layer's phases, in one place.

A profile (``train.profile_steps``, :mod:`moejax.train.profiling`) and the
HLO's op metadata name every op under the scopes around it, so a trace
shows these phases of each MoE layer apart:

- ``moe_route``: the router (scores, selection, gates) and the capacity rule;
- ``moe_balance``: the balance losses and the routing metrics;
- ``moe_dispatch``: the dispatch layout (sort by expert, capacity slots) and
  the permutation of token rows into expert order;
- ``moe_expert_ffn``: the grouped matmuls of the routed experts (the fused
  ``blocked`` tile loop gathers, multiplies and scatters in one loop: all of
  it is here);
- ``moe_all_to_all``: the expert-parallel exchanges over the ``expert`` axis
  (padded, bucketed, ragged);
- ``moe_combine``: the unpermutation, gate weighting and sum back per token;
- ``moe_shared_experts``: shared and zero-computation experts.

Scopes change op names in metadata only, never the computation.
"""

from __future__ import annotations

ROUTE = "moe_route"
BALANCE = "moe_balance"
DISPATCH = "moe_dispatch"
EXPERT_FFN = "moe_expert_ffn"
ALL_TO_ALL = "moe_all_to_all"
COMBINE = "moe_combine"
SHARED = "moe_shared_experts"

PHASES = (ROUTE, BALANCE, DISPATCH, EXPERT_FFN, ALL_TO_ALL, COMBINE, SHARED)
