"""Multi-head latent attention (model.attention='mla'): cached decoding equals the full
forward, the cache holds the latent and the rotary key only (and the serving accounting
counts exactly that), the parameters are what the accounting and the audit count, the
optimizer roles are declared, and bad options are one-line config errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, from_dict
from moejax.model import Transformer, param_count, param_role_tree
from moejax.nn import adapters
from moejax.nn.attention_kinds import MLAOptions
from moejax.nn.mla import LatentAttention, LatentCache
from moejax.serve import Decoder
from moejax.serve.decode import cache_bytes
from moejax.topology import accounting, memory
from moejax.train import audit
from moejax.train.optimizers import path_keys
from tests.configs import moe_config
from tests.serve.test_decode import _check, _tokens

OPTS = MLAOptions(q_lora_rank=0, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=6)
Q_LORA = MLAOptions(q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=6)


def mla(opts=OPTS, **kw) -> ModelConfig:
  base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, dense_ff_width=64, moe=None,
              attention="mla", attention_options=opts)
  base.update(kw)
  return ModelConfig(**base)


def test_latent_attention_by_hand_on_one_head():
  """One head, one token: the output is o(v) of that token's own latent, whatever q is."""
  attn = LatentAttention(4, 1, MLAOptions(kv_lora_rank=2, qk_nope_head_dim=2,
                                          qk_rope_head_dim=2, v_head_dim=2),
                         norm_eps=1e-6, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 1, 4))
  kv = attn.kv_a(x)
  latent = attn.kv_norm(kv[..., :2])
  v = attn.kv_b(latent)[..., 2:]  # [k_nope (2) | v (2)] of the one head
  np.testing.assert_allclose(attn(x, jnp.zeros((1, 1), jnp.int32)), attn.o_proj(v), atol=1e-6)


@pytest.mark.parametrize("opts", [OPTS, Q_LORA], ids=["kv_latent", "q_and_kv_latents"])
def test_mla_decode_equals_the_full_forward(opts):
  """Left-padded prompts, prefill, then one token per step: the logits of every position
  equal the full forward's (f32 rounding of sums over a different number of slots)."""
  _check(mla(opts))


def test_mla_with_moe_layers_decodes():
  cfg = mla(n_layers=2, moe=moe_config(num_experts=4, expert_width=16, routing=dict(top_k=2),
                                       backend="reference"))
  _check(cfg)


def test_the_cache_holds_the_latent_and_the_rope_key_and_the_accounting_counts_it():
  cfg = mla()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  dec = Decoder(model)
  caches = dec.init_caches(batch=3, capacity=7)
  assert all(isinstance(c, LatentCache) for c in caches)
  assert caches[0].latent.shape == (3, 7, 12) and caches[0].rope_key.shape == (3, 7, 4)
  # r_kv + h_r = 16 numbers per token and layer (MHA of the same heads: 2 * 4 * 8 = 64).
  assert memory.kv_numbers_per_token(cfg) == 2 * (12 + 4)
  numbers = cache_bytes(caches) - sum(int(c.valid.nbytes) for c in caches)
  assert numbers == memory.kv_bytes(cfg, context=7, batch=3, bits=32)


@pytest.mark.parametrize("opts", [OPTS, Q_LORA], ids=["kv_latent", "q_and_kv_latents"])
def test_mla_parameters_are_what_the_accounting_and_the_audit_count(opts):
  cfg = mla(opts, n_layers=1)
  d, n = 32, 4
  q = d * n * 12 if not opts.q_lora_rank else d * 10 + 10 * n * 12
  by_hand = q + d * (12 + 4) + 12 * n * (8 + 6) + n * 6 * d
  assert accounting.attention_params(cfg) == by_hand
  b = accounting.budget(cfg, seq_len=5)
  assert b.breakdown["attention"].total == by_hand
  assert b.breakdown["attention"].flops == 2 * by_hand + 2 * 5 * n * (12 + 6)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert param_count(model) == b.total
  rows = {r.name: r for r in audit.audit_model(cfg)}
  assert rows["attention"].initialised == by_hand and rows["attention"].ok
  # The latent norms are norms: 2 block norms + the final norm + r_kv (+ r_q).
  assert rows["norms"].initialised == 3 * d + 12 + opts.q_lora_rank and rows["norms"].ok


def test_mla_projections_are_muon_matrices_and_latent_norms_adamw():
  model = nnx.eval_shape(lambda: Transformer(mla(Q_LORA, n_layers=1), rngs=nnx.Rngs(0)))
  got = {"/".join(str(k) for k in path_keys(p)[2:]): (r.matrix, r.component)
         for p, r in jax.tree_util.tree_leaves_with_path(param_role_tree(model))
         if path_keys(p)[:1] == ("blocks",) and path_keys(p)[2] == "attn"}
  assert got == {
      "attn/q_a/kernel": (True, "attention"), "attn/q_b/kernel": (True, "attention"),
      "attn/kv_a/kernel": (True, "attention"), "attn/kv_b/kernel": (True, "attention"),
      "attn/o_proj/kernel": (True, "attention"),
      "attn/q_norm/scale": (False, "norm"), "attn/kv_norm/scale": (False, "norm")}


@pytest.mark.parametrize("tree, field, fix", [
    (dict(attention_options=dict(qk_rope_head_dim=5)),
     "model.attention_options.qk_rope_head_dim=5", "use 6"),
    (dict(attention_options=dict(kv_lora_rank=0)), "model.attention_options.kv_lora_rank=0",
     ">= 1"),
    (dict(n_kv_heads=2), "model.n_kv_heads=2", "remove model.n_kv_heads"),
    (dict(attention_bias=True), "model.attention_bias=True", "attention_bias=False"),
    (dict(attention_options=dict(kv_rank=4)), "model.attention_options.kv_rank=4",
     "did you mean 'kv_lora_rank'"),
])
def test_bad_mla_options_are_one_line_errors_naming_field_value_and_fix(tree, field, fix):
  with pytest.raises(ConfigError) as info:
    from_dict(ModelConfig, dict(attention="mla", n_heads=4, **tree), "model")
  msg = str(info.value)
  assert msg.startswith(field) and "Fix:" in msg and fix in msg and "\n" not in msg


def test_mla_options_are_refused_under_mha_and_old_fields_name_their_place():
  with pytest.raises(ConfigError, match="attention_options.kv_lora_rank=8: is an option of "
                                        "model.attention='mla'"):
    from_dict(ModelConfig, dict(attention_options=dict(kv_lora_rank=8)), "model")
  with pytest.raises(ConfigError, match="moved to model.attention_options.kv_lora_rank"):
    from_dict(ModelConfig, dict(kv_lora_rank=8), "model")


@pytest.mark.parametrize("opts", [OPTS, Q_LORA], ids=["kv_latent", "q_and_kv_latents"])
def test_lora_on_mla_adapts_its_projections_as_counted_and_starts_as_the_base(opts):
  cfg = mla(opts)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(_tokens(1))
  before, n_before = model(tokens)[0], param_count(model)
  adapters.attach(model, ("attention",), 2, 1.0, jax.random.key(0))
  assert param_count(model) - n_before == adapters.lora_param_count(cfg, ("attention",), 2)
  np.testing.assert_array_equal(model(tokens)[0], before)  # B = 0


def test_a_whole_model_export_to_mixtral_names_the_latent_attention_it_cannot_hold():
  from moejax.interop.errors import InteropError  # pylint: disable=g-import-not-at-top
  from moejax.interop.models import hf_config_of  # pylint: disable=g-import-not-at-top
  cfg = mla(moe=moe_config(num_experts=4, expert_width=16,
                           routing=dict(top_k=2, score_fn="softmax", gating="topk_softmax")))
  with pytest.raises(InteropError, match=r"model.attention='mla' \(needs q / k / v / o"):
    hf_config_of(cfg, "mixtral")
  assert hf_config_of(dataclasses.replace(cfg, attention="mha", attention_options=None),
                      "mixtral")["num_attention_heads"] == 4
