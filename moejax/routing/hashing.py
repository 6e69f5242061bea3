"""Hash routing (``kind='hash'``), Roller et al. 2106.04426.

Legend: T tokens, E_r router outputs (FFN plus zero-computation experts), K =
top_k slots per token, V vocabulary.

No router parameters: the experts of a token are a fixed function of its id.
We use a *balanced* random hash that needs no vocabulary size: ids are cut
into blocks of E_r consecutive ids (block b = id // E_r, position r = id % E_r) and
each block gets its own pseudo-random permutation pi_b of the E_r experts,
keyed by (options.seed, b). Slot j of token id is

    expert_j(id) = pi_b[(r + j) mod E_r],   j = 0..K-1.

For each slot j the map id -> expert is a bijection inside every full block,
so over any vocabulary 0..V-1 each expert owns floor(V/E_r) or ceil(V/E_r) ids
(exactly V/E_r when E_r divides V): the "random permutation of ids modulo E_r"
split, without knowing V. Using consecutive positions of one permutation
(rather than K independent tables) keeps a token's K experts distinct while
every slot's table stays balanced.

Gates are uniform: 1/K per slot (1 for K=1), times routed_scaling_factor;
probs put 1/K on each chosen expert; logits are zeros. Token ids must be
non-negative. pi_b is the argsort of murmur3-mixed (seed, b, expert) keys:
integer arithmetic only, so the table is identical on every backend and JAX
version (a trained hash-routed model depends on it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.config.core import check_count
from moejax.routing.spec import RouterSpec, register
from moejax.routing.types import RoutingResult, make_result


def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3 32-bit finaliser: a bijective avalanche mix of uint32 values."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hash_experts(token_ids: jax.Array, num_experts: int, top_k: int, seed: int) -> jax.Array:
  """int32[T, K] experts of each token id (see the module docstring)."""
  if top_k > num_experts:
    raise ValueError(f"moe.routing.top_k={top_k} exceeds the {num_experts} experts a hash "
                     f"router can assign distinctly. Fix: set top_k <= {num_experts}.")
  ids = jnp.asarray(token_ids).astype(jnp.int32)
  block, pos = ids // num_experts, ids % num_experts
  # Per-block random keys from an integer mixer (murmur3's finaliser), chained
  # over (seed, block, expert): pure uint32 arithmetic, so the table does not
  # depend on JAX's PRNG implementation or version, and compiles instantly.
  h = _fmix32(_fmix32(jnp.uint32(seed & 0xFFFFFFFF)) ^ block.astype(jnp.uint32))  # [T]
  keys = _fmix32(h[:, None] ^ jnp.arange(num_experts, dtype=jnp.uint32))  # [T, E_r]
  # argsort of any key vector is a permutation (ties included), so each
  # block's map stays a bijection.
  perms = jnp.argsort(keys, axis=-1, stable=True)  # [T, E_r], row = pi_b of the block
  slots = (pos[:, None] + jnp.arange(top_k)) % num_experts  # [T, K]
  return jnp.take_along_axis(perms, slots, axis=-1).astype(jnp.int32)


def select_hash(token_ids: jax.Array, cfg: MoEConfig) -> RoutingResult:
  """Hash routing decision for token_ids int[T]."""
  rc, e = cfg.routing, cfg.num_routed
  ids = hash_experts(token_ids, e, rc.top_k, rc.opts.seed)
  t, k = ids.shape
  w = jnp.full((t, k), rc.routed_scaling_factor / k, jnp.float32)
  probs = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32), axis=1) / k
  return make_result(ids, w, jnp.ones((t, k), bool), probs, jnp.zeros((t, e), jnp.float32))


def route_hash(params, x, bias, cfg: MoEConfig, *, token_ids=None, rng=None,
               train=False) -> RoutingResult:
  del params, bias, rng, train
  if token_ids is None:
    raise ValueError("moe.routing.kind='hash' routes by token id but token_ids=None. "
                     "Fix: pass token_ids=int[T] (the input ids, flattened like x) to route().")
  token_ids = jnp.asarray(token_ids)
  if token_ids.shape != (x.shape[0],):
    raise ValueError(f"token_ids has shape {token_ids.shape} but x has {x.shape[0]} tokens. "
                     f"Fix: pass token_ids of shape ({x.shape[0]},), flattened like x.")
  if not jnp.issubdtype(token_ids.dtype, jnp.integer):
    raise ValueError(f"token_ids has dtype {token_ids.dtype}. Fix: pass integer token ids.")
  return select_hash(token_ids, cfg)


@dataclasses.dataclass(frozen=True)
class HashOptions:
  """seed: seed of the balanced token-id -> expert table."""

  seed: int = 0

  def __post_init__(self):
    check_count("moe.routing.options.seed", self.seed, minimum=0)


class Hash(RouterSpec):
  """Experts as a fixed balanced function of the token id: no parameters, no noise."""

  name = "hash"
  Options = HashOptions
  reads_activations = False
  needs_token_ids = True
  scores_all_columns = False
  trainable = False
  isolates_shared = True

  def param_shapes(self, d_model, cfg):
    return {}  # so init, the accounting and the audit count no router weights or FLOPs

  def replay_weights(self, result, expert_ids, valid, cfg):
    del result, valid  # every slot weighs the same, as in select_hash
    k = expert_ids.shape[-1]
    return jnp.full(expert_ids.shape, cfg.routing.routed_scaling_factor / k, jnp.float32)

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return route_hash(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train)


register(Hash())
