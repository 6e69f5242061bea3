"""Tests for moejax.model and its NNX building blocks (moejax.nn).

Legend: B batch, S sequence length, V vocabulary, d model width, K slots.
Tiny configs (d=32, 2 layers, E=4) keep the whole file fast on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, MoEConfig, RouterConfig, BalanceConfig
from moejax.model import (RouterStateVar, Transformer, active_ffn_params,
                          dense_equivalent, param_count)
from moejax.nn import mod as mod_lib
from moejax.nn.attention import apply_rope

V, S = 32, 12


def _has_moe_layer() -> bool:
  try:
    import moejax.layer  # noqa: F401
    return True
  except ImportError:
    return False


needs_moe = pytest.mark.skipif(not _has_moe_layer(), reason="moejax.layer not importable yet")


def tiny(moe=None, **kw) -> ModelConfig:
  base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              dense_ff_width=64, moe=moe)
  base.update(kw)
  return ModelConfig(**base)


def tiny_moe(kind="topk", **moe_kw) -> MoEConfig:
  router = moe_kw.pop("router", None) or RouterConfig(kind=kind, top_k=2)
  return MoEConfig(num_experts=4, expert_width=16, router=router, **moe_kw)


def _tokens(seed=0, b=2, s=S):
  return jax.random.randint(jax.random.key(seed), (b, s), 0, V, jnp.int32)


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _logits(model, tokens):
  return _forward(model, tokens)[0]


# ---------------------------------------------------------------------------
# Shapes, dtypes, unsupported configs.

@pytest.mark.parametrize("kw", [
    {},
    {"compute_dtype": "bfloat16", "tie_embeddings": True},
    {"n_kv_heads": 1, "head_dim": 4},
])
def test_dense_shapes_and_dtypes(kw):
  model = Transformer(tiny(**kw), rngs=nnx.Rngs(0))
  logits, aux = _forward(model, _tokens())
  assert logits.shape == (2, S, V) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  assert aux["moe"] == {} and aux["mod"] == {} and float(aux["loss"]) == 0.0


def test_dense_param_count_by_hand():
  cfg = tiny(n_kv_heads=2)
  d, f, h = 32, 64, 8
  attn = d * 4 * h + 2 * d * 2 * h + 4 * h * d  # q, k, v (2 kv heads), o
  per_layer = attn + 3 * d * f + 2 * d  # swiglu, two RMSNorm scales
  want = V * d + 2 * per_layer + d + d * V  # embed, blocks, final norm, head
  assert param_count(Transformer(cfg, rngs=nnx.Rngs(0))) == want
  tied = Transformer(tiny(tie_embeddings=True), rngs=nnx.Rngs(0))
  assert param_count(tied) == want - d * V


@pytest.mark.parametrize("kw,field", [
    ({"attention": "mla"}, "model.attention"),
    ({"encoder_layers": 1}, "model.encoder_layers"),
    ({"head_dim": 5}, "model.head_dim"),
])
def test_unbuildable_configs_raise_config_error(kw, field):
  with pytest.raises(ConfigError, match=field):
    Transformer(tiny(**kw), rngs=nnx.Rngs(0))


def test_bad_tokens_rejected():
  model = Transformer(tiny(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="int\\[B, S\\]"):
    model(jnp.zeros((S,), jnp.int32))
  with pytest.raises(ValueError, match="int\\[B, S\\]"):
    model(jnp.zeros((1, S), jnp.float32))


def test_new_config_fields_validate():
  with pytest.raises(ConfigError, match="model.mod_capacity"):
    tiny(mod_capacity=1.5)
  with pytest.raises(ConfigError, match="model.expert_sharing_group"):
    tiny(expert_sharing_group=2)  # no MoE to share
  with pytest.raises(ConfigError, match="model.compute_dtype"):
    tiny(compute_dtype="float16")
  cfg = tiny(mod_every=2, n_layers=4)
  assert [cfg.is_mod_layer(i) for i in range(4)] == [False, True, False, True]


# ---------------------------------------------------------------------------
# Rotary embeddings and MoD token selection (pure pieces).

@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(m=st.integers(0, 50), n=st.integers(0, 50), shift=st.integers(0, 50))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
  kq, kk = jax.random.split(jax.random.key(m * 51 + n))
  q = jax.random.normal(kq, (1, 1, 1, 8))
  k = jax.random.normal(kk, (1, 1, 1, 8))
  pos = lambda p: jnp.full((1, 1), p)
  dot = lambda a, b: float(jnp.sum(apply_rope(q, pos(a), 100.0) * apply_rope(k, pos(b), 100.0)))
  np.testing.assert_allclose(dot(m, n), dot(m + shift, n + shift), rtol=1e-4, atol=1e-4)
  # A rotation keeps the norm.
  np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, pos(m), 100.0)),
                             jnp.linalg.norm(q), rtol=1e-5)


def test_rope_position_zero_is_identity_and_rotates_pairs():
  x = jnp.arange(1.0, 5.0).reshape(1, 1, 1, 4)  # pairs (1, 3), (2, 4)
  np.testing.assert_array_equal(apply_rope(x, jnp.zeros((1, 1), jnp.int32), 1e4), x)
  # Position 1, base 1: every pair rotates by 1 radian.
  out = apply_rope(x, jnp.ones((1, 1), jnp.int32), 1.0)[0, 0, 0]
  c, s = np.cos(1.0), np.sin(1.0)
  np.testing.assert_allclose(out, [1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s],
                             rtol=1e-6)


def test_mod_select_hand_case():
  scores = jnp.array([[0.1, 0.9, -1.0, 0.5, 0.7], [5.0, 4.0, 3.0, 2.0, 1.0]])
  idx = mod_lib.select_tokens(scores, 2)
  np.testing.assert_array_equal(idx, [[1, 4], [0, 1]])  # sorted, not by score
  assert mod_lib.capacity_tokens(16, 0.125) == 2
  assert mod_lib.capacity_tokens(4, 0.01) == 1


@jax.jit
def _select_roundtrip(scores, x, k_marker):
  idx = mod_lib.select_tokens(scores, k_marker.shape[0])
  return idx, mod_lib.gather(scores, idx), mod_lib.scatter(x, idx, mod_lib.gather(x, idx))


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(s=st.sampled_from([1, 5, 12]), cap=st.floats(0.01, 1.0),
                  seed=st.integers(0, 99))
def test_mod_gather_scatter_properties(s, cap, seed):
  k = mod_lib.capacity_tokens(s, cap)
  assert 1 <= k <= s and abs(k - cap * s) <= max(0.5, 1 - cap * s) + 1e-9
  scores = np.random.default_rng(seed).normal(size=(3, s)).astype(np.float32)
  x = np.arange(3 * s * 2.0, dtype=np.float32).reshape(3, s, 2)
  idx, picked, back = map(np.asarray, _select_roundtrip(scores, x, np.zeros(k)))
  assert idx.shape == (3, k)
  assert np.all(np.diff(idx, axis=-1) > 0)  # distinct, increasing
  # The selected scores are the k largest of each row.
  np.testing.assert_allclose(np.sort(picked, -1), np.sort(scores, -1)[:, s - k:])
  np.testing.assert_array_equal(back, x)


# ---------------------------------------------------------------------------
# Causality: a future token never changes an earlier position's logits.

def _assert_causal(cfg, seeds=(0, 1)):
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  for seed in seeds:
    tokens = _tokens(seed)
    base = _logits(model, tokens)
    for p in (3, S - 1):
      changed = tokens.at[:, p].set((tokens[:, p] + 7) % V)
      out = _logits(model, changed)
      np.testing.assert_allclose(out[:, :p], base[:, :p], atol=1e-6, rtol=0)
      assert not np.allclose(out[:, p], base[:, p])  # the probe did change something


def test_dense_is_causal():
  _assert_causal(tiny(n_layers=2, compute_dtype="float32"))


# ---------------------------------------------------------------------------
# Training reduces the loss.

def _train(model, tokens, steps, lr=1e-2):
  """A few AdamW steps; returns the per-step cross-entropies."""
  opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens, rng):
    def loss_fn(model):
      logits, aux = model(tokens[:, :-1], train=True, rng=rng)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return ce + aux["loss"], ce
    (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return ce

  return [float(step(model, opt, tokens, jax.random.key(i))) for i in range(steps)]


def _repeating_tokens(b=2, s=S + 1):
  period = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
  return jnp.stack([jnp.roll(jnp.resize(period, s), r) for r in range(b)]).astype(jnp.int32)


def test_dense_training_reduces_loss():
  losses = _train(Transformer(tiny(), rngs=nnx.Rngs(0)), _repeating_tokens(), steps=8)
  assert losses[-1] < 0.25 * losses[0], losses


# ---------------------------------------------------------------------------
# Mixture of depths.

def test_mod_block_processes_only_the_capacity_fraction():
  cfg = tiny(n_layers=2, mod_every=1, mod_capacity=0.25, mod_aux_loss_coef=0.1)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = _tokens()
  x = model.embed(tokens)
  pos = jnp.broadcast_to(jnp.arange(S), (2, S))
  out, moe_aux, mod_aux = nnx.jit(lambda blk, *a: blk(*a))(model.blocks[0], x, pos, tokens)
  k = mod_lib.capacity_tokens(S, 0.25)
  assert moe_aux is None
  np.testing.assert_array_equal(mod_aux["selected"].sum(-1), [k, k])
  sel = np.asarray(mod_aux["selected"])
  # Skipped tokens pass through unchanged; processed ones are updated.
  np.testing.assert_array_equal(np.asarray(out)[~sel], np.asarray(x)[~sel])
  assert not np.allclose(np.asarray(out)[sel], np.asarray(x)[sel])
  # The selected tokens are the top-k router scores of each sequence.
  scores = np.asarray(mod_aux["scores"])
  for b in range(2):
    assert set(np.flatnonzero(sel[b])) == set(np.argsort(scores[b])[-k:])
  _, aux = _forward(model, tokens)
  assert set(aux["mod"]) == {"layer_0", "layer_1"}
  assert float(aux["loss"]) > 0.0  # the membership BCE is included


def test_mod_training_reduces_loss_and_trains_router():
  model = Transformer(tiny(mod_every=2, mod_capacity=0.5), rngs=nnx.Rngs(0))
  w0 = model.blocks[1].router.kernel[...]
  losses = _train(model, _repeating_tokens(), steps=8)
  assert losses[-1] < 0.25 * losses[0], losses
  assert not np.allclose(model.blocks[1].router.kernel[...], w0)  # gate gives it gradients
