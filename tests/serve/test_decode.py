"""Cached decoding (moejax.serve.decode) equals the model's full forward.

Legend: B batch, S sequence length, V vocabulary, P prompt slots.

Every check: two prompts of different lengths, left-padded into one batch,
prefilled, then teacher-forced one token per step through the cache; the
logits at every position of every row must equal the full forward pass of
the model on the unpadded sequence (float32, |diff| <= 2e-5; observed ~1e-6).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, MoEConfig, RoutingConfig
from moejax.model import RouterStateVar, Transformer
from moejax.nn import mod as mod_lib
from moejax.nn.attention import CausalSelfAttention, KVCache
from moejax.serve import Decoder, check_decodable, left_pad, serving_model
from moejax.serve.decode import causal_mod_forward
from moejax.serve.generate import prefill_inputs
from tests.configs import moe_config

V, S = 32, 10
ATOL = 2e-5


def tiny(moe=None, **kw) -> ModelConfig:
  base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              dense_ff_width=64, moe=moe)
  base.update(kw)
  return ModelConfig(**base)


def moe(kind="topk", top_k=2, backend="reference", **kw) -> MoEConfig:
  router = kw.pop("routing", None) or RoutingConfig(kind=kind, top_k=top_k)
  return moe_config(num_experts=4, expert_width=16, routing=router, backend=backend, **kw)


def _tokens(seed=1, b=2, s=S):
  return np.asarray(jax.random.randint(jax.random.key(seed), (b, s), 0, V, jnp.int32))


@nnx.jit
def _full(model, tokens):
  return model(tokens)[0]


def _randomize_bias(model, seed=0):
  """A non-zero selection bias in every router state, so biased selection is exercised."""
  for i, (_, node) in enumerate(nnx.iter_graph(model)):
    if isinstance(node, RouterStateVar) and jnp.issubdtype(node.get_value().dtype, jnp.floating):
      v = node.get_value()
      node.set_value(0.3 * jax.random.normal(jax.random.key(seed + i), v.shape, v.dtype))


def decode_logits(dec: Decoder, tokens: np.ndarray, prompt_lens) -> np.ndarray:
  """f32[B, S, V]: logits at every position from prefill + teacher-forced decode steps."""
  b, s = tokens.shape
  t, lengths = left_pad([tokens[i, :n].tolist() for i, n in enumerate(prompt_lens)])
  p = t.shape[1]
  positions, write = prefill_inputs(lengths, p)
  caches = dec.init_caches(b, p + s)
  logits, caches, _ = dec.extend(t, positions, write, caches, 0)
  out = np.zeros((b, s, logits.shape[-1]), np.float32)
  for i, n in enumerate(prompt_lens):
    out[i, :n] = np.asarray(logits[i, p - n:])
  for step in range(s - min(prompt_lens)):
    pos = np.asarray(prompt_lens) + step
    nxt = np.where(pos < s, tokens[np.arange(b), np.minimum(pos, s - 1)], 0)
    logits, caches, _ = dec.extend(nxt[:, None], pos[:, None], np.ones((b, 1), bool), caches,
                                   p + step)
    for i in range(b):
      if pos[i] < s:
        out[i, pos[i]] = np.asarray(logits[i, 0])
  return out


def _check(cfg: ModelConfig, prompt_lens=(3, 6), seed=0, bias=False, atol=ATOL):
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  if bias:
    _randomize_bias(model, seed)
  tokens = _tokens(seed + 1)
  want = np.asarray(_full(model, jnp.asarray(tokens)))
  got = decode_logits(Decoder(model), tokens, prompt_lens)
  np.testing.assert_allclose(got, want, atol=atol, rtol=0)
  return model


# ---------------------------------------------------------------------------
# Attention: the cached call.

def test_attention_extend_equals_full_call_and_skips_invalid_slots():
  attn = CausalSelfAttention(16, 4, 2, 4, rngs=nnx.Rngs(0))
  full = jax.jit(lambda x, pos: attn(x, pos))
  extend = jax.jit(lambda *a: attn.extend(*a))
  x = jax.random.normal(jax.random.key(0), (1, 5, 16))
  pos = jnp.arange(5)[None]
  want = full(x, pos)
  cache = attn.init_cache(1, 8)
  y, cache = extend(x, pos, cache, jnp.int32(0), jnp.ones((1, 5), bool))
  np.testing.assert_allclose(y, want, atol=1e-6)
  np.testing.assert_array_equal(cache.valid[0], [1, 1, 1, 1, 1, 0, 0, 0])
  # A slot written with write=False is invisible: token 2 then sees tokens 0 and 2 only,
  # exactly what the full call gives on the 2-token sequence [x0, x2] at positions [0, 2].
  cache = attn.init_cache(1, 8)
  _, cache = extend(x[:, :2], pos[:, :2], cache, jnp.int32(0), jnp.array([[True, False]]))
  y2, _ = extend(x[:, 2:3], pos[:, 2:3], cache, jnp.int32(2), jnp.ones((1, 1), bool))
  sub = full(x[:, jnp.array([0, 2])], pos[:, jnp.array([0, 2])])
  np.testing.assert_allclose(y2[0, 0], sub[0, 1], atol=1e-6)
  assert isinstance(cache, KVCache) and cache.k.shape == (1, 8, 2, 4)


# ---------------------------------------------------------------------------
# Decoding equals the full forward.

@pytest.mark.parametrize("kw", [
    {},                                                  # dense, GQA
    {"n_kv_heads": 1, "head_dim": 4, "tie_embeddings": True},   # MQA, tied head
])
def test_dense_decode_equals_forward(kw):
  _check(tiny(**kw))


@pytest.mark.parametrize("name,moe_cfg", [
    ("topk_softmax", moe(routing=RoutingConfig(top_k=2, gating="topk_softmax"))),
    ("sigmoid_bias_groups_blocked", moe(
        backend="blocked", routing=RoutingConfig(top_k=2, score_fn="sigmoid",
                                               gating="normalized", use_bias=True,
                                               n_groups=2, topk_groups=1,
                                               routed_scaling_factor=2.5))),
    ("hash", moe("hash")),
    ("top_p", moe(routing=RoutingConfig.build(kind="top_p", top_k=3, top_p=0.5))),
    ("hierarchical", moe(routing=RoutingConfig.build(kind="hierarchical", top_k=2, n_families=2,
                                             top_k_families=1))),
    ("zero_compute", moe(zero_experts=1, copy_experts=1, constant_experts=1, top_k=3)),
    ("shared_gated_ragged_dot", moe(backend="ragged_dot", num_shared_experts=1,
                                    shared_expert_width=8, shared_expert_gate=True)),
    pytest.param("heterogeneous_gelu", moe(expert_widths=(8, 16, 8, 24), activation="gelu"),
                 marks=pytest.mark.slow),
])
def test_moe_decode_equals_forward(name, moe_cfg):
  _check(tiny(moe=moe_cfg), bias=moe_cfg.routing.use_bias)


def test_scmoe_and_peer_decode_equal_forward():
  _check(tiny(moe=moe(backend="blocked"), n_layers=3, moe_layout="every_other",
              moe_schedule="scmoe"))
  peer = moe_config(kind="peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=8)
  _check(tiny(moe=peer))


@pytest.mark.slow
def test_first_dense_layout_with_expert_sharing_decodes():
  _check(tiny(moe=moe(), n_layers=3, moe_layout="first_dense", first_dense_layers=1,
              expert_sharing_group=2))


@pytest.mark.slow
def test_bfloat16_decode_close_to_forward():
  # bf16 activations: the cached softmax sums in another order, so rounding differs.
  _check(tiny(moe=moe(backend="blocked"), compute_dtype="bfloat16"), atol=0.1)


@pytest.mark.slow
def test_prompts_of_one_token_and_of_the_whole_sequence():
  _check(tiny(moe=moe()), prompt_lens=(1, 1))
  _check(tiny(moe=moe()), prompt_lens=(S, 2))


# ---------------------------------------------------------------------------
# Capacity: decoding is dropless.

def test_capacity_model_decodes_its_dropless_twin():
  cfg = tiny(moe=moe(capacity_factor=0.5))
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(_tokens(1))
  trained_fn, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert int(aux["moe"]["layer_0"]["num_dropped"]) > 0  # the full forward does drop
  twin = serving_model(model)
  assert twin.cfg.moe.balance.capacity_factor is None
  assert model.cfg.moe.balance.capacity_factor == 0.5
  dropless = np.asarray(_full(twin, tokens))
  got = decode_logits(Decoder(model), np.asarray(tokens), (3, 6))
  np.testing.assert_allclose(got, dropless, atol=ATOL, rtol=0)
  assert not np.allclose(got, np.asarray(trained_fn), atol=1e-3)


# ---------------------------------------------------------------------------
# Non-causal layers are refused.

@pytest.mark.parametrize("cfg,field", [
    (tiny(moe=moe("expert_choice")), "model.moe.routing.kind='expert_choice'"),
    (tiny(moe=moe_config(kind="soft", num_experts=4, expert_width=16)), "model.moe.kind='soft'"),
])
def test_non_causal_layers_are_refused(cfg, field):
  with pytest.raises(ConfigError, match="not causal") as e:
    check_decodable(cfg)
  assert str(e.value).startswith(field)
  with pytest.raises(ConfigError, match="not causal"):
    Decoder(Transformer(cfg, rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------------------
# Mixture of depths: the causal threshold rule.

def _threshold_forward(model, tokens):
  """The model's own eager forward with MoD selection = {t : score_t > 0} (B = 1)."""
  orig = mod_lib.select_tokens

  def select(scores, k):
    del k
    idx = np.flatnonzero(np.asarray(scores[0]) > 0)
    assert idx.size, "pick a seed where every MoD block processes a token"
    return jnp.asarray(idx, jnp.int32)[None]

  mod_lib.select_tokens = select
  try:
    return np.asarray(model(jnp.asarray(tokens))[0])
  finally:
    mod_lib.select_tokens = orig


@pytest.mark.slow  # ~9 s of decoding compiles; MoD selection itself: tests/test_model.py
def test_mod_decodes_with_the_causal_threshold_rule():
  cfg = tiny(moe=moe(), n_layers=2, mod_every=1, mod_capacity=0.5)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = _tokens(3, b=1)
  want = _threshold_forward(model, tokens)
  np.testing.assert_allclose(causal_mod_forward(model, jnp.asarray(tokens)), want, atol=ATOL)
  got = decode_logits(Decoder(model), np.concatenate([tokens, tokens]), (2, 5))
  np.testing.assert_allclose(got[0], want[0], atol=ATOL)
  np.testing.assert_allclose(got[1], want[0], atol=ATOL)
  # The rule does skip tokens here, so the check covers invalid cache slots.
  scores = model.blocks[0].router(model.embed(jnp.asarray(tokens)))[0, :, 0]
  assert 0 < int(jnp.sum(scores > 0)) < S


def test_causal_forward_without_mod_is_the_model_forward():
  model = Transformer(tiny(moe=moe()), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(_tokens(2))
  np.testing.assert_allclose(causal_mod_forward(model, tokens), _full(model, tokens),
                             atol=ATOL)


# ---------------------------------------------------------------------------
# Decoder bookkeeping.

def test_experts_touched_and_cache_overflow():
  model = Transformer(tiny(moe=moe()), rngs=nnx.Rngs(0))
  dec = Decoder(model)
  caches = dec.init_caches(1, 4)
  logits, caches, info = dec.extend(np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32),
                                    np.ones((1, 1), bool), caches, 0)
  # One token, top-2 of 4: exactly 2 distinct experts in each of the 2 MoE layers.
  np.testing.assert_array_equal(info["experts_touched"], [2, 2])
  with pytest.raises(ValueError, match="cache overflow"):
    dec.extend(np.zeros((1, 4), np.int32), np.zeros((1, 4), np.int32), np.ones((1, 4), bool),
               caches, 1)
  assert dataclasses.is_dataclass(dec.cfg)
