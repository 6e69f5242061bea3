"""PEER: product-key retrieval is exact; the layer equals a brute-force PEER."""

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, MoEConfig
from moejax.topology import peer
from tests.configs import moe_config, replace_moe

SETTINGS = hypothesis.settings(max_examples=25, deadline=None)


def _cfg(n=6, heads=2, k=3, dk=8, activation="gelu"):
  return moe_config(kind="peer", peer_num_keys=n, peer_heads=heads, peer_top_k=k,
                   peer_key_dim=dk, activation=activation)


D_MODEL = 5


@pytest.fixture(scope="module")
def gelu_layer():
  """One (cfg, params, x) reused by several tests: every new shape costs compiles."""
  cfg = _cfg()
  return cfg, peer.init_peer(jax.random.key(0), D_MODEL, cfg), \
      jax.random.normal(jax.random.key(1), (7, D_MODEL))


def _brute_topk(s1, s2, k):
  """Scores every one of the N = n^2 experts (s1[a] + s2[b]) and takes the exact top-k."""
  n = s1.shape[-1]
  full = (s1[..., :, None] + s2[..., None, :]).reshape(*s1.shape[:-1], n * n)  # id = a n + b
  return jax.lax.top_k(full, k)


def test_product_key_topk_hand_made():
  s1 = jnp.array([1.0, 3.0])
  s2 = jnp.array([2.0, 0.5])
  scores, ids = peer.product_key_topk(s1, s2, 2)
  # Sums: (a=1,b=0) 5 -> id 2; (1,1) 3.5 -> id 3; (0,0) 3 -> id 0; (0,1) 1.5 -> id 1.
  np.testing.assert_array_equal(scores, [5.0, 3.5])
  np.testing.assert_array_equal(ids, [2, 3])


@functools.partial(jax.jit, static_argnums=(2,))
def _product_vs_brute(s1, s2, k):
  return peer.product_key_topk(s1, s2, k), _brute_topk(s1, s2, k)


@SETTINGS
@hypothesis.given(n=st.sampled_from([3, 8]), k=st.sampled_from([1, 3]), seed=st.integers(0, 2 ** 16))
def test_product_key_topk_equals_brute_force(n, k, seed):
  # Inputs are materialised before the jitted call: inside one jit XLA may
  # recompute a random producer per consumer with different rounding.
  rng = np.random.default_rng(seed)
  s1, s2 = (rng.standard_normal((5, 2, n)).astype(np.float32) for _ in range(2))
  (scores, ids), (b_scores, b_ids) = _product_vs_brute(s1, s2, k)
  # Same float additions on both sides, so the scores agree exactly.
  np.testing.assert_array_equal(scores, b_scores)
  np.testing.assert_array_equal(ids, b_ids)


def _brute_peer(params, x, cfg):
  """PEER computed over all N experts: dense scores, exact top-k, all outputs."""
  q = peer.peer_queries(params, x)
  s1, s2 = peer.sub_key_scores(params, q)
  scores, ids = _brute_topk(s1, s2, cfg.layer_options.top_k)  # [T, H, k]
  gates = jax.nn.softmax(scores, axis=-1)
  pre = x @ params["u"].T  # [T, N]: every expert's hidden neuron
  if cfg.topology.activation == "swiglu":
    hidden = jax.nn.silu(x @ params["u_gate"].T) * pre
  else:
    hidden = jax.nn.gelu(pre)
  weight = jnp.zeros_like(hidden)  # [T, N] summed gate of each expert over heads
  t_idx = jnp.arange(x.shape[0])[:, None, None]
  weight = weight.at[t_idx, ids].add(gates)
  return (weight * hidden) @ params["v"], ids


def _check_against_brute_force(cfg, params, x):
  y, aux = peer.peer_apply(params, x, cfg)
  y_ref, ids_ref = _brute_peer(params, x, cfg)
  np.testing.assert_array_equal(aux["expert_ids"], ids_ref)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


def test_peer_apply_equals_brute_force_gelu(gelu_layer):
  _check_against_brute_force(*gelu_layer)


def test_peer_apply_equals_brute_force_swiglu():
  cfg = _cfg(activation="swiglu")
  params = peer.init_peer(jax.random.key(2), D_MODEL, cfg)
  assert params["u_gate"].shape == (36, D_MODEL)
  _check_against_brute_force(cfg, params, jax.random.normal(jax.random.key(3), (7, D_MODEL)))


def test_layout_aux_and_gates(gelu_layer):
  cfg, params, x = gelu_layer  # n=6 (N=36), H=2, k=3, D=8
  assert params["w_q"].shape == (2, D_MODEL, 8)
  assert params["sub_keys"].shape == (2, 6, 4)  # shared by the heads
  assert params["u"].shape == (36, D_MODEL) and params["v"].shape == (36, D_MODEL)
  assert params["q_norm"]["scale"].shape == (2, 8) and "u_gate" not in params
  assert peer.num_peer_experts(cfg) == 36
  y, aux = peer.peer_apply(params, x, cfg)
  assert y.shape == x.shape and y.dtype == x.dtype
  ids = aux["expert_ids"]
  assert ids.shape == (7, 2, 3) and ids.dtype == jnp.int32
  assert jnp.all((ids >= 0) & (ids < 36))
  np.testing.assert_allclose(aux["gates"].sum(-1), 1.0, rtol=1e-6)
  # Scores come out best first and the k experts of a head are distinct.
  assert jnp.all(jnp.diff(aux["scores"], axis=-1) <= 0)
  assert all(len(set(r)) == 3 for r in np.asarray(ids).reshape(-1, 3).tolist())


def test_heads_sum(gelu_layer):
  """With H heads the output is the sum of H one-head layers sharing keys and experts."""
  cfg, params, x = gelu_layer
  one = replace_moe(cfg, peer_heads=1)
  parts = []
  for h in range(cfg.layer_options.heads):
    ph = dict(params, w_q=params["w_q"][h:h + 1],
              q_norm=jax.tree.map(lambda a: a[h:h + 1], params["q_norm"]))
    parts.append(peer.peer_apply(ph, x, one)[0])
  np.testing.assert_allclose(peer.peer_apply(params, x, cfg)[0], sum(parts),
                             rtol=1e-5, atol=1e-6)


def test_query_layernorm_per_token(gelu_layer):
  """At init (scale 1, bias 0) each head's query has zero mean and unit variance."""
  _, params, x = gelu_layer
  q = peer.peer_queries(params, x)
  np.testing.assert_allclose(q.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(q.var(-1), 1.0, rtol=1e-3)
  # Per token: one token's query does not depend on the others in the batch.
  np.testing.assert_allclose(q[:1], peer.peer_queries(params, x[:1]), rtol=1e-6)


def test_non_peer_config_errors():
  with pytest.raises(ConfigError, match="moe.kind"):
    peer.init_peer(jax.random.key(0), 4, MoEConfig())
