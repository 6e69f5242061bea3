"""Tests for moejax.model and its NNX building blocks (moejax.nn).

Legend: B batch, S sequence length, V vocabulary, d model width, K slots.
Tiny configs (d=32, 2 layers, E=4) keep the whole file fast on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, MoEConfig, RoutingConfig, BalanceConfig
from moejax.model import (RouterStateVar, Transformer, active_ffn_params,
                          dense_equivalent, param_count)
from moejax.nn import mod as mod_lib
from moejax.nn.attention import apply_rope
from moejax.topology import accounting
from tests.configs import moe_config, replace_moe

V, S = 32, 12


def tiny(moe=None, **kw) -> ModelConfig:
  base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              dense_ff_width=64, moe=moe)
  base.update(kw)
  return ModelConfig(**base)


def tiny_moe(kind="topk", **moe_kw) -> MoEConfig:
  router = moe_kw.pop("routing", None) or RoutingConfig(kind=kind, top_k=2)
  return moe_config(num_experts=4, expert_width=16, routing=router, **moe_kw)


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
    ({"head_dim": 5}, "model.head_dim"),
    ({"dense_twin": "active", "moe": tiny_moe()}, "model.dense_twin"),
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

_rope = jax.jit(apply_rope, static_argnums=2)


@jax.jit
def _rope_dot(q, k, pq, pk):
  return jnp.sum(apply_rope(q, pq, 100.0) * apply_rope(k, pk, 100.0))


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(m=st.integers(0, 50), n=st.integers(0, 50), shift=st.integers(0, 50))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
  kq, kk = jax.random.split(jax.random.key(m * 51 + n))
  q = jax.random.normal(kq, (1, 1, 1, 8))
  k = jax.random.normal(kk, (1, 1, 1, 8))
  dot = lambda a, b: float(_rope_dot(q, k, jnp.full((1, 1), a), jnp.full((1, 1), b)))
  np.testing.assert_allclose(dot(m, n), dot(m + shift, n + shift), rtol=1e-4, atol=1e-4)
  # A rotation keeps the norm.
  np.testing.assert_allclose(jnp.linalg.norm(_rope(q, jnp.full((1, 1), m), 100.0)),
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

def _train(model, tokens, steps, lr=1e-2, return_optimizer=False):
  """A few AdamW steps; returns the per-step cross-entropies (and the optimizer)."""
  opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens, rng):
    def loss_fn(model):
      logits, aux = model(tokens[:, :-1], train=True, rng=rng)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      loads = {k: v["router_load"] for k, v in aux["moe"].items() if "router_load" in v}
      return ce + aux["loss"], (ce, loads)
    (_, (ce, loads)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    model.apply_controllers(loads)  # once per step, outside the gradient
    return ce

  losses = [float(step(model, opt, tokens, jax.random.key(i))) for i in range(steps)]
  return (losses, opt) if return_optimizer else losses


def _repeating_tokens(b=2, s=S + 1):
  period = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
  return jnp.stack([jnp.roll(jnp.resize(period, s), r) for r in range(b)]).astype(jnp.int32)


def test_dense_training_reduces_loss_and_trains_the_mod_router():
  # Block 0 is a plain dense block, block 1 a mixture-of-depths one.
  model = Transformer(tiny(mod_every=2, mod_capacity=0.5), rngs=nnx.Rngs(0))
  w0 = model.blocks[1].router.kernel[...]
  losses = _train(model, _repeating_tokens(), steps=8)
  assert losses[-1] < 0.25 * losses[0], losses
  # The gate g(r) on the processed tokens' update is the router's only gradient path.
  assert not np.allclose(model.blocks[1].router.kernel[...], w0)


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


# ---------------------------------------------------------------------------
# MoE blocks (need moejax.layer and the planes it composes).

def _moe_cfg(kind="topk", n_layers=2, **kw):
  return tiny(moe=tiny_moe(kind), n_layers=n_layers, **kw)


@pytest.mark.parametrize("kind", ["topk", "hash", "top_p", "expert_choice"])
def test_moe_shapes_and_aux(kind):
  cfg = _moe_cfg(kind, moe_layout="every_other")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  logits, aux = _forward(model, _tokens())
  assert logits.shape == (2, S, V) and logits.dtype == jnp.float32
  assert set(aux["moe"]) == {"layer_1"}  # every_other: odd layers are MoE
  layer = aux["moe"]["layer_1"]
  k = layer["expert_ids"].shape[-1]
  assert layer["expert_ids"].shape == layer["valid"].shape == (2, S, k)
  assert layer["load"].shape == (4,)
  assert bool(jnp.all((layer["expert_ids"] >= 0) & (layer["expert_ids"] < 4)))
  np.testing.assert_allclose(aux["loss"], layer["losses"]["total"])


@pytest.mark.parametrize("kind", ["topk", "hash", "top_p"])
def test_token_choice_moe_is_causal(kind):
  # The shapes test's config: nnx.jit reuses its compiled forward.
  _assert_causal(_moe_cfg(kind, moe_layout="every_other"))


def _bias_cfg(bias_update="sign"):
  router = RoutingConfig(kind="topk", top_k=2, score_fn="sigmoid", gating="normalized",
                        use_bias=True)
  moe = moe_config(num_experts=4, expert_width=16, routing=router,
                  balance=BalanceConfig(bias_update=bias_update, bias_rate=0.1,
                                        aux_loss_coef=1e-2, z_loss_coef=1e-3))
  return tiny(moe=moe)


def _paths(state):
  return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}


def test_router_state_is_state_not_a_param():
  model = Transformer(_bias_cfg(), rngs=nnx.Rngs(0))
  param_paths = _paths(nnx.state(model, nnx.Param))
  state_paths = _paths(nnx.state(model, RouterStateVar))
  assert state_paths == {f"blocks/{i}/ffn/router_state/{f}"
                         for i in range(2) for f in ("bias", "step")}
  assert not param_paths & state_paths
  assert not any("router_state" in p for p in param_paths)
  # An optimizer built the usual way holds no moments for it.
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  assert not any("router_state" in p for p in _paths(nnx.state(opt)))


def test_moe_training_reduces_loss_and_the_controller_moves_the_bias():
  model = Transformer(_bias_cfg("sign"), rngs=nnx.Rngs(0))
  tokens = _repeating_tokens()
  _forward(model, tokens)  # evaluation never moves the bias
  np.testing.assert_array_equal(model.blocks[0].ffn.router_state.bias[...], 0.0)
  steps = 8
  losses = _train(model, tokens, steps=steps)
  assert losses[-1] < 0.25 * losses[0], losses
  for i in range(2):
    state = model.blocks[i].ffn.router_state
    bias = np.asarray(state.bias[...])
    assert int(state.step[...]) == steps
    # Sign updates of rate 0.1: every bias is a multiple of 0.1, at most 0.8.
    units = bias / 0.1
    np.testing.assert_allclose(units, np.round(units), atol=1e-4)
    assert np.all(np.abs(bias) <= 0.1 * steps + 1e-6) and np.any(bias != 0), bias
  before = model.blocks[0].ffn.router_state.bias[...]
  _forward(model, tokens)
  np.testing.assert_array_equal(model.blocks[0].ffn.router_state.bias[...], before)


def test_expert_sharing_shares_exactly_the_routed_experts():
  cfg = _moe_cfg(n_layers=4)
  shared = dataclasses.replace(cfg, expert_sharing_group=2)
  plain_model = Transformer(cfg, rngs=nnx.Rngs(0))
  shared_model = Transformer(shared, rngs=nnx.Rngs(0))
  d, f, e = 32, 16, 4
  expert_params = e * 3 * d * f  # swiglu: w_gate, w_up, w_down
  # Layers 1 and 3 reuse the experts of layers 0 and 2.
  assert param_count(shared_model) == param_count(plain_model) - 2 * expert_params
  ffn = [shared_model.blocks[i].ffn for i in range(4)]
  for a, b in ((0, 1), (2, 3)):
    for name in ffn[a].params["experts"]:
      assert ffn[a].params["experts"][name] is ffn[b].params["experts"][name]
    assert ffn[a].params["router"] is not ffn[b].params["router"]
  assert ffn[1].params["experts"]["w_gate_up"] is not ffn[2].params["experts"]["w_gate_up"]


def test_mod_block_around_moe_routes_only_selected_tokens():
  cfg = _moe_cfg(mod_every=1, mod_capacity=0.5)
  logits, aux = _forward(Transformer(cfg, rngs=nnx.Rngs(0)), _tokens())
  assert logits.shape == (2, S, V)
  for i in range(2):
    sel = np.asarray(aux["mod"][f"layer_{i}"]["selected"])
    valid = np.asarray(aux["moe"][f"layer_{i}"]["valid"])
    assert sel.sum() == 2 * (S // 2)
    assert not valid[~sel].any() and valid[sel].all()  # top-k: K valid slots each
    m = aux["mod"][f"layer_{i}"]["metrics"]
    scores = np.asarray(aux["mod"][f"layer_{i}"]["scores"])
    assert float(m["tokens"]) == 2 * (S // 2) and float(m["capacity_use"]) == 0.5
    np.testing.assert_allclose(m["causal_share"], np.mean(scores > 0), rtol=1e-6)
    np.testing.assert_allclose(m["causal_agreement"], np.mean((scores > 0) == sel), rtol=1e-6)


def test_moe_bf16_compute():
  cfg = _moe_cfg(compute_dtype="bfloat16")
  logits, aux = _forward(Transformer(cfg, rngs=nnx.Rngs(0)), _tokens())
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


# ---------------------------------------------------------------------------
# Dense baseline with the same active parameters.

def _ffn_param_count(model) -> int:
  """Params under every block's ffn (routed experts counted in full)."""
  return sum(param_count(b.ffn if hasattr(b, "ffn") else b.block.ffn) for b in model.blocks)


def test_dense_equivalent_by_hand():
  moe = moe_config(num_experts=4, expert_width=16, num_shared_experts=1,
                  shared_expert_width=8, routing=RoutingConfig(top_k=2))
  cfg = tiny(moe=moe)
  dense = dense_equivalent(cfg)
  assert dense.moe is None and dense.dense_ff_width == 2 * 16 + 8
  assert dense.dense_activation == "swiglu"
  assert active_ffn_params(cfg) == active_ffn_params(dense) == 2 * 3 * 32 * 40
  # The dense model really has those FFN params.
  assert _ffn_param_count(Transformer(dense, rngs=nnx.Rngs(0))) == 2 * 3 * 32 * 40
  # Everything but the FFN (and the twin's label) is unchanged.
  assert dataclasses.replace(dense, dense_ff_width=cfg.dense_ff_width, moe=cfg.moe,
                             dense_twin="none") == cfg

  gelu = tiny(moe=replace_moe(moe, activation="gelu"))
  assert dense_equivalent(gelu).dense_activation == "gelu"
  assert dense_equivalent(gelu).dense_ff_width == 40
  # Mixed layout: layer 0 dense (64), layer 1 MoE (40) -> average 52.
  mixed = tiny(moe=moe, moe_layout="every_other")
  assert dense_equivalent(mixed).dense_ff_width == 52
  assert active_ffn_params(dense_equivalent(mixed)) == active_ffn_params(mixed)
  with pytest.raises(ConfigError, match="moe.kind"):
    dense_equivalent(tiny(moe=moe_config(kind="soft", num_experts=4, expert_width=16)))


def test_dense_twin_total_matches_the_total_parameters():
  from moejax.model import dense_twin
  from moejax.topology import accounting
  cfg = tiny(moe=tiny_moe())
  twin = dense_twin(cfg, "total")
  assert twin.moe is None and twin.dense_twin == "total"
  moe_total, dense_total = accounting.budget(cfg, 8).total, accounting.budget(twin, 8).total
  # Within half a hidden unit per layer (2 layers x 3 d / 2 parameters).
  assert abs(moe_total - dense_total) <= 2 * 3 * 32 / 2, (moe_total, dense_total)
  assert param_count(Transformer(twin, rngs=nnx.Rngs(0))) == dense_total
  assert dense_twin(twin, "total") is twin  # already dense


def test_dense_equivalent_matches_accounting():
  moe = moe_config(num_experts=4, expert_width=16, num_shared_experts=1,
                  routing=RoutingConfig(top_k=2))
  cfg = tiny(moe=moe)
  a, b = accounting.budget(cfg), accounting.budget(dense_equivalent(cfg))
  router = a.breakdown["router"].active
  assert a.active - router == b.active
  # Zero-computation experts take a share of the K slots (MoE++ accounting).
  zero = replace_moe(moe, zero_experts=4)
  assert dense_equivalent(tiny(moe=zero)).dense_ff_width == round(2 * 16 * 4 / 8 + 16)


@pytest.mark.parametrize("kw", [
    {},
    {"tie_embeddings": True, "n_kv_heads": 1, "mod_every": 2, "n_layers": 4},
    {"moe": "topk", "moe_layout": "every_other"},
    {"moe": "shared", "expert_sharing_group": 2, "n_layers": 4, "mod_every": 2},
])
def test_param_count_equals_accounting_total(kw):
  kw = dict(kw)
  if kw.get("moe") == "topk":
    kw["moe"] = tiny_moe()
  elif kw.get("moe") == "shared":
    kw["moe"] = tiny_moe(num_shared_experts=1, shared_expert_width=8)
  cfg = tiny(**kw)
  assert param_count(Transformer(cfg, rngs=nnx.Rngs(0))) == accounting.budget(cfg).total


@pytest.mark.parametrize("kind", ["soft", "peer"])
def test_every_layer_kind_logs_its_metrics(kind):
  from moejax.train.step import routing_summary
  moe = (moe_config("soft", num_experts=2, expert_width=8, slots_per_expert=2) if kind == "soft"
         else moe_config("peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=8))
  _, aux = _forward(Transformer(tiny(moe=moe), rngs=nnx.Rngs(0)), _tokens())
  summary = routing_summary(aux)
  want = {"soft": {"soft_dispatch_entropy", "soft_combine_entropy"},
          "peer": {"peer_experts_touched", "peer_key_max_vio"}}[kind]
  assert want <= set(summary) and "max_vio_batch" in summary, summary
