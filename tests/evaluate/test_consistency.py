"""Routing consistency (moejax.evaluate.consistency): flip rates on (token, expert) pairs.

By hand: fixed-K and variable-K selections, a near-tie case whose flip a
small perturbation causes (and the margin that predicts it); a model's
forward against itself flips nothing, and hash routing flips nothing under
bf16 compute.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ModelConfig, RoutingConfig
from moejax.evaluate import consistency as C
from moejax.model import Transformer
from moejax.routing.replay import RoutingReplay
from moejax.routing.topk import select_topk
from tests.configs import moe_config


def _sel(ids, valid=None):
  ids = jnp.asarray(ids, jnp.int32)
  return RoutingReplay(ids, jnp.ones(ids.shape, bool) if valid is None else jnp.asarray(valid))


def test_flip_rates_by_hand():
  ref = {"layer_0": _sel([[0, 1], [2, 3]]), "layer_1": _sel([[1, 0], [2, 3]], [[1, 0], [1, 1]])}
  other = {"layer_0": _sel([[0, 2], [3, 2]]), "layer_1": _sel([[1, 3], [2, 3]])}
  got = C.compare(ref, other, num_routed=4)
  # layer_0: token 0 moved 1 -> 2 (2 of 8 pairs differ); slot order does not matter.
  # layer_1: token 0 gained expert 3 (1 of 3 + 4 = 7 pairs).
  assert got.layer_flip_rate == {"layer_0": 2 / 8, "layer_1": 1 / 7}
  assert got.token_flip_share == 0.5
  assert got.flip_rate == 3 / 15
  assert C.compare(ref, ref, 4).flip_rate == 0.0


def test_a_near_tie_flips_under_a_perturbation_its_margin_allows():
  cfg = moe_config(num_experts=4, routing=RoutingConfig.build(top_k=2, gating="topk_softmax"))
  # Token 0: experts 1 and 2 nearly tie for the second slot; token 1 has a wide gap.
  logits = jnp.asarray([[2.0, 1.0, 0.999, -1.0], [3.0, 2.0, 0.0, -1.0]], jnp.float32)
  noise = jnp.asarray([[0.0, 0.0, 0.002, 0.0], [0.0, 0.0, 0.002, 0.0]], jnp.float32)
  a = {"layer_0": RoutingReplay.of(select_topk(logits, None, cfg))}
  b = {"layer_0": RoutingReplay.of(select_topk(logits + noise, None, cfg))}
  got = C.compare(a, b, 4)
  assert got.layer_flip_rate == {"layer_0": 0.25} and got.token_flip_share == 0.5
  margin = np.asarray(C.topk_margin(logits, 2))
  np.testing.assert_allclose(margin, [0.001, 2.0], rtol=1e-4)
  assert margin[0] < 0.002 < margin[1]  # the perturbation crosses token 0's margin only
  hist = C.margin_histogram(margin, bins=2, top=2.0)
  assert hist["counts"] == [1, 1] and hist["edges"] == [0.0, 1.0, 2.0]


def _selections(cfg, tokens, seed=0):
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  aux = model(tokens)[1]
  return {n: layer["selection"] for n, layer in aux["moe"].items()}


def test_a_forward_against_itself_and_hash_under_bf16_flip_nothing():
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 32, jnp.int32)
  base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              dense_ff_width=64)
  topk = ModelConfig(**base, moe=moe_config(num_experts=4, expert_width=16,
                                            routing=RoutingConfig.build(top_k=2)))
  sel = _selections(topk, tokens)
  assert C.compare(sel, sel, 4).flip_rate == 0.0
  hashed = ModelConfig(**base, moe=moe_config(num_experts=4, expert_width=16,
                                              routing=RoutingConfig.build(kind="hash", top_k=2)))
  f32 = _selections(hashed, tokens)
  bf16 = _selections(dataclasses.replace(hashed, compute_dtype="bfloat16"), tokens)
  got = C.compare(f32, bf16, 4)
  assert got.flip_rate == 0.0 and got.token_flip_share == 0.0


def test_forwards_of_other_layers_are_refused():
  with pytest.raises(ValueError, match=r"layers \['layer_0'\] and \['layer_1'\].*Fix:"):
    C.compare({"layer_0": _sel([[0, 1]])}, {"layer_1": _sel([[0, 1]])}, 4)


def test_measure_under_perturbations():
  from moejax.serve import routing_consistency as perturbed
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 6), 0, 32, jnp.int32))
  base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              dense_ff_width=64)
  hashed = ModelConfig(**base, moe=moe_config(num_experts=4, expert_width=16,
                                              routing=RoutingConfig.build(kind="hash", top_k=2)))
  got = perturbed.measure(Transformer(hashed, rngs=nnx.Rngs(0)), tokens,
                          ("bf16", "decode", "microbatch4"))
  assert sorted(got) == ["bf16", "decode", "microbatch4"]
  for name, row in got.items():
    assert row["flip_rate"] == 0.0 and row["token_flip_share"] == 0.0, name
  ec = ModelConfig(**base, moe=moe_config(num_experts=4, expert_width=16,
                                          routing=RoutingConfig.build(kind="expert_choice")))
  got = perturbed.measure(Transformer(ec, rngs=nnx.Rngs(0)), tokens, ("decode", "microbatch4"))
  assert "not causal" in got["decode"]["n/a"]
  # Each expert picks among a quarter of the tokens: the choices move.
  assert 0 < got["microbatch4"]["flip_rate"] <= 1
  with pytest.raises(ValueError, match=r"unknown perturbations \['int3'\]"):
    perturbed.measure(Transformer(ec, rngs=nnx.Rngs(0)), tokens, ("int3",))
