"""Routing replay: run a forward on a recorded expert selection, gated by the current router.

Legend: T tokens, K slots per token, E_r router outputs (FFN plus
zero-computation experts).

A :class:`RoutingReplay` is one layer's selection: which experts each token
used (``expert_ids``) and which slots were used (``valid``), nothing else.
:func:`apply_replay` is the one place it enters the routing path: it takes
the router's own :class:`~moejax.routing.types.RoutingResult` for the same
tokens, keeps its scores (``probs``, ``logits``) and replaces the selection
by the recorded one; the combine weights are recomputed by the router's
gating (:meth:`~moejax.routing.spec.RouterSpec.replay_weights`) from this
forward's scores of the recorded experts. This is the contract of
Megatron-Core's router replay ("R3", ``megatron/core/transformer/moe/
router_replay.py``, ``RouterReplay.get_replay_topk``): in the replay actions
the top-k indices come from the recording and the probabilities are
``scores.gather(1, top_indices)``, then normalised and scaled as the router
would (``topk_routing_with_score_function`` in ``moe_utils.py``). So the
selection is fixed (integers carry no gradient) and the gradient reaches
the router only through the recomputed weights.

Everything after routing reads the replayed decision: capacity, the
executor, balance losses (the selection as the routing map, the current
probabilities), loads and so the bias controller, and the stateful ideas'
observations, as Megatron's aux loss counts the replayed ``routing_map``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from moejax.config import MoEConfig
from moejax.config.registry import ROUTERS
from moejax.routing.types import RoutingResult, make_result


@struct.dataclass
class RoutingReplay:
  """One layer's expert selection, token-major; immutable pytree.

  Attributes:
    expert_ids: int[..., K] the expert of each slot (ids >= E name
      zero-computation experts; 0 where not valid).
    valid: bool[..., K] the slots used.

  The leading axes are the tokens: [T] in the layer, [B, S] in the model
  (``aux['moe'][layer]['selection']``, the input of ``Transformer(...,
  replay=)``).
  """

  expert_ids: jax.Array
  valid: jax.Array

  @classmethod
  def of(cls, result: RoutingResult) -> "RoutingReplay":
    """The selection of a routing decision."""
    return cls(expert_ids=result.expert_ids, valid=result.valid)

  @property
  def k(self) -> int:
    return self.expert_ids.shape[-1]

  def reshape(self, *lead: int) -> "RoutingReplay":
    """The same selection with leading (token) axes ``lead``."""
    return RoutingReplay(self.expert_ids.reshape(*lead, self.k),
                         self.valid.reshape(*lead, self.k))


def check_replay(replay, token_shape: tuple, cfg: MoEConfig, *, where: str,
                 k: Optional[int] = None) -> None:
  """Refuses a selection that cannot be the decision of ``token_shape`` tokens of ``cfg``.

  Shapes and dtypes always; the expert ids' range only when they are concrete
  (outside ``jax.jit``). ``k``: the router's slots per token (default: its
  ``RouterSpec.result_k``).
  """
  if not isinstance(replay, RoutingReplay):
    raise TypeError(f"{where}: replay must be a RoutingReplay, got {type(replay).__name__}. "
                    "Fix: build it with RoutingReplay(expert_ids=..., valid=...)")
  if k is None:
    k = cfg.router.result_k(cfg)
  want = tuple(token_shape) + (k,)
  for name, arr in (("expert_ids", replay.expert_ids), ("valid", replay.valid)):
    if tuple(arr.shape) != want:
      raise ValueError(f"{where}: replay.{name} has shape {tuple(arr.shape)}, the layer "
                       f"routes {want} (tokens {tuple(token_shape)}, K={k} slots of "
                       f"moe.routing.kind={cfg.routing.kind!r}). Fix: replay a recording of "
                       "this batch made by a model of this config")
  if not jnp.issubdtype(replay.expert_ids.dtype, jnp.integer):
    raise ValueError(f"{where}: replay.expert_ids has dtype {replay.expert_ids.dtype}. "
                     "Fix: pass integer expert ids (int32)")
  if replay.valid.dtype != jnp.bool_:
    raise ValueError(f"{where}: replay.valid has dtype {replay.valid.dtype}. "
                     "Fix: pass a bool mask")
  ids = replay.expert_ids
  if not isinstance(ids, jax.core.Tracer) and ids.size:
    ids = np.asarray(ids)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= cfg.num_routed:
      raise ValueError(f"{where}: replay.expert_ids span [{lo}, {hi}], the layer has "
                       f"{cfg.num_routed} router outputs (moe.topology.num_experts="
                       f"{cfg.num_experts} + {cfg.num_zero_compute} zero-computation). Fix: "
                       "replay a recording made by a model of this config")


def apply_replay(result: RoutingResult, replay: RoutingReplay, cfg: MoEConfig) -> RoutingResult:
  """The router's decision ``result`` with its selection replaced by ``replay``'s.

  Scores stay this forward's; the weights are the router's gating of the
  replayed experts (:meth:`RouterSpec.replay_weights`), so replaying a
  forward's own selection gives that forward's result.
  """
  check_replay(replay, (result.num_tokens,), cfg, where="routing replay", k=result.k)
  ids = replay.expert_ids.astype(jnp.int32)
  valid = replay.valid
  ids = jnp.where(valid, ids, 0)
  weights = ROUTERS.get(cfg.routing.kind).replay_weights(result, ids, valid, cfg)
  return make_result(ids, weights, valid, result.probs, result.logits)


def check_layers(replay, layers: tuple, where: str) -> None:
  """Refuses a model-level replay whose layers are not exactly ``layers`` (names)."""
  if not isinstance(replay, dict):
    raise TypeError(f"{where}: replay must be a dict {{'layer_<i>': RoutingReplay}}, got "
                    f"{type(replay).__name__}")
  missing, extra = sorted(set(layers) - set(replay)), sorted(set(replay) - set(layers))
  if missing or extra:
    raise ValueError(f"{where}: replay has layers {sorted(replay)}, the model routes "
                     f"{list(layers)} (missing {missing}, not routed {extra}). Fix: replay "
                     "a recording made by a model of this config")
