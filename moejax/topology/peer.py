"""PEER: parameter-efficient expert retrieval (He 2024, arXiv 2407.04153).

Legend: T tokens, d model width, H retrieval heads, N = n^2 singleton
experts, n sub-keys per half (:class:`PeerOptions` ``num_keys``, in
``moe.layer_options``), k experts per head (``top_k``), D query width
(``key_dim``), D/2 half width.

Expert i is a single hidden neuron: e_i(x) = act(u_i . x) v_i (SwiGLU:
silu(g_i . x) (u_i . x) v_i). Retrieval uses product keys (Lample et al.
1907.05242): the key of expert i = (a, b) is the concatenation of sub-keys
c_a (first half) and c'_b (second half), so its score against a query
q = [q1, q2] is q1 . c_a + q2 . c'_b. The top-k of the N = n^2 sums must
consist of pairs whose halves are each in their own half's top-k, so scoring
the n sub-keys per half, keeping the top-k of each and taking the top-k of
the k^2 candidate sums is *exact* (not an approximation) at O(n D + k^2)
cost instead of O(N D).

Each of the H heads has its own query network W_q[h] and retrieves its own k
experts; all heads share one pool of experts and one set of product keys (as
in the paper); head outputs are summed. Gates are the softmax over the k
retrieved scores of a head.

Query normalisation: the paper (after PKM) batch-normalises the query, which
spreads the queries over the sub-keys and so raises expert usage. Batch
norm makes one token's retrieval depend on the other tokens of its batch
(leaking future tokens into a causal LM's routing), needs running statistics
(state, a train/eval switch), and breaks the pure ``f(params, x)`` form. We
use a per-token LayerNorm over the D query features of each head, with
learned scale and bias: it gives the query the same controlled scale and
centring, per token, without batch statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moejax.config import ConfigError, MoEConfig
from moejax.config.core import check_count
from moejax.topology import roles

Params = dict[str, Any]

_LN_EPS = 1e-6
# Standard deviation of a unit normal truncated to [-2, 2].
_TRUNC_STD = 0.87962566103423978


def _trunc_normal(key: jax.Array, shape: tuple, std: float) -> jax.Array:
  """Truncated (2 std) normal rescaled to have exactly standard deviation std."""
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * (std / _TRUNC_STD)


@dataclasses.dataclass(frozen=True)
class PeerOptions:
  """PEER's options (``moe.layer_options`` with ``moe.kind='peer'``).

  Attributes:
    num_keys: n sub-keys per half; N = n^2 singleton experts.
    heads: H retrieval heads, each with its own query network.
    top_k: k experts per head (taken per sub-key set first, so k <= n).
    key_dim: D query width, split into two halves for the product keys.
  """

  num_keys: int = 32
  heads: int = 4
  top_k: int = 8
  key_dim: int = 128

  def __post_init__(self):
    p = "moe.layer_options"
    for name in ("num_keys", "heads", "top_k", "key_dim"):
      check_count(f"{p}.{name}", getattr(self, name))
    if self.top_k > self.num_keys:
      raise ConfigError(f"{p}.top_k", self.top_k,
                        f"exceeds {p}.num_keys={self.num_keys} (top-k is taken per sub-key set)",
                        f"set {p}.top_k <= {p}.num_keys")
    if self.key_dim % 2:
      raise ConfigError(f"{p}.key_dim", self.key_dim,
                        "the query is split into two halves for product keys",
                        "use an even key dimension")


def _check(cfg: MoEConfig) -> None:
  if not cfg.layer.product_keys:
    raise ConfigError("moe.kind", cfg.kind, "PEER functions need a PEER layer config",
                      "set moe.kind='peer'")


def num_peer_experts(cfg: MoEConfig) -> int:
  """N = num_keys ** 2."""
  return cfg.layer_options.num_keys ** 2


def init_peer(key: jax.Array, d_model: int, cfg: MoEConfig, dtype=jnp.float32) -> Params:
  """PEER parameters.

  Returns:
    'w_q' [H, d, D] query networks, 'q_norm' {'scale', 'bias'} [H, D],
    'sub_keys' [2, n, D/2] (shared by all heads), 'u' [N, d] and 'v' [N, d]
    expert input / output vectors, plus 'u_gate' [N, d] for swiglu.

  Init (truncated normal, variance scaling): W_q and u (and u_gate) fan-in d;
  sub-keys std 1/sqrt(D/2), so a normalised query half scores O(1) against
  them; v fan-in H k, the number of hidden neurons a token activates.
  """
  _check(cfg)
  o = cfg.layer_options
  h, n, dk, k = o.heads, o.num_keys, o.key_dim, o.top_k
  big_n = n * n
  k_q, k_keys, k_u, k_v, k_g = jax.random.split(key, 5)
  params = {
      "w_q": _trunc_normal(k_q, (h, d_model, dk), d_model ** -0.5),
      "q_norm": {"scale": jnp.ones((h, dk), jnp.float32),
                 "bias": jnp.zeros((h, dk), jnp.float32)},
      "sub_keys": _trunc_normal(k_keys, (2, n, dk // 2), (dk // 2) ** -0.5),
      "u": _trunc_normal(k_u, (big_n, d_model), d_model ** -0.5),
      "v": _trunc_normal(k_v, (big_n, d_model), (h * k) ** -0.5),
  }
  if cfg.topology.activation == "swiglu":
    params["u_gate"] = _trunc_normal(k_g, (big_n, d_model), d_model ** -0.5)
  return jax.tree.map(lambda a: a.astype(dtype), params)


def peer_roles(params: Params) -> dict:
  """Optimizer roles of :func:`init_peer`' weights: the H query networks [H, d, D] are a
  stack of matrices; the sub-keys, the singleton experts' vectors (u, v, u_gate: one row
  per expert, embeddings looked up by key) and the query norm are element-wise."""
  declared = {"w_q": roles.stack("peer_query"), "q_norm": roles.elementwise("norm"),
              "sub_keys": roles.elementwise("peer_keys")}
  return roles.roles_like(params, declared, roles.elementwise("peer_embedding"))


def peer_queries(params: Params, x: jax.Array) -> jax.Array:
  """Normalised queries f32[T, H, D] (per-token, per-head LayerNorm)."""
  q = jnp.einsum("td,hdk->thk", x, params["w_q"].astype(x.dtype)).astype(jnp.float32)
  mean = jnp.mean(q, axis=-1, keepdims=True)
  var = jnp.var(q, axis=-1, keepdims=True)
  q = (q - mean) * jax.lax.rsqrt(var + _LN_EPS)
  return q * params["q_norm"]["scale"] + params["q_norm"]["bias"]


def sub_key_scores(params: Params, q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Half scores s1, s2: f32[T, H, n] each, s = q_half . sub_key."""
  half = q.shape[-1] // 2
  keys = params["sub_keys"].astype(jnp.float32)
  s1 = jnp.einsum("thk,nk->thn", q[..., :half], keys[0])
  s2 = jnp.einsum("thk,nk->thn", q[..., half:], keys[1])
  return s1, s2


def product_key_topk(s1: jax.Array, s2: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of s1[a] + s2[b] over all n^2 pairs.

  Args:
    s1, s2: f32[..., n] half scores.
    k: experts to keep (<= n).

  Returns:
    scores f32[..., k] in descending order and expert ids int32[..., k],
    id = a * n + b.
  """
  n = s1.shape[-1]
  v1, i1 = jax.lax.top_k(s1, k)  # [..., k]
  v2, i2 = jax.lax.top_k(s2, k)
  cand = v1[..., :, None] + v2[..., None, :]  # [..., k, k]
  scores, flat = jax.lax.top_k(cand.reshape(*cand.shape[:-2], k * k), k)
  a = jnp.take_along_axis(i1, flat // k, axis=-1)
  b = jnp.take_along_axis(i2, flat % k, axis=-1)
  return scores, (a * n + b).astype(jnp.int32)


def peer_apply(params: Params, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict]:
  """One PEER layer: x[T, d] -> (y[T, d], aux).

  y = sum_h sum_{i in top-k_h(x)} g_{h,i}(x) e_i(x), g_h = softmax of head
  h's k retrieved scores.

  Returns:
    y with x's dtype, and aux with 'expert_ids' int32[T, H, k] (for load
    metrics over the N experts), 'gates' f32[T, H, k] and 'scores'
    f32[T, H, k].
  """
  _check(cfg)
  if x.ndim != 2:
    raise ValueError(f"peer_apply: x has shape {x.shape}; expected [T, d]")
  q = peer_queries(params, x)
  s1, s2 = sub_key_scores(params, q)
  scores, ids = product_key_topk(s1, s2, cfg.layer_options.top_k)
  gates = jax.nn.softmax(scores, axis=-1)  # [T, H, k]
  u = params["u"].astype(x.dtype)[ids]  # [T, H, k, d]
  pre = jnp.einsum("td,thkd->thk", x, u)
  if "u_gate" in params:
    g = params["u_gate"].astype(x.dtype)[ids]
    hidden = jax.nn.silu(jnp.einsum("td,thkd->thk", x, g)) * pre
  else:
    hidden = jax.nn.gelu(pre)
  v = params["v"].astype(x.dtype)[ids]  # [T, H, k, d]
  y = jnp.einsum("thk,thkd->td", gates.astype(x.dtype) * hidden, v)
  return y, {"expert_ids": ids, "gates": gates, "scores": scores}
