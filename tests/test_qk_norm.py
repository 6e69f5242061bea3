"""Qwen3's per-head q / k RMSNorm, the ``mha`` option ``qk_norm``: it normalises each head's
query and key before the rotation, its scales are counted as norms by the accounting and the
audit, and they are AdamW (element-wise) parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, from_dict
from moejax.model import Transformer, param_count, param_role_tree
from moejax.nn.attention import CausalSelfAttention
from moejax.nn.attention_kinds import MHAOptions
from moejax.topology import accounting
from moejax.train import audit
from moejax.train.optimizers import path_keys


def _cfg(**kw) -> ModelConfig:
  base = dict(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=6,
              dense_ff_width=64, moe=None, attention_options=MHAOptions(qk_norm=True))
  return ModelConfig(**{**base, **kw})


def test_qk_norm_normalises_each_head_before_the_rotation():
  """At position 0 the rotation is the identity, so the attention of one token is o(v) and
  the scores use q / rms(q) * s_q; checked through _qkv against a by-hand normalisation."""
  attn = CausalSelfAttention(8, 2, 1, 4, qk_norm=True, norm_eps=1e-6, rngs=nnx.Rngs(0))
  attn.q_norm.scale[...] = jnp.asarray([1.0, 2.0, 3.0, 4.0])
  x = jax.random.normal(jax.random.key(1), (1, 1, 8))
  q, k, _ = attn._qkv(x, jnp.zeros((1, 1), jnp.int32))
  raw_q = np.asarray(attn.q_proj(x)).reshape(2, 4)
  raw_k = np.asarray(attn.k_proj(x)).reshape(1, 4)
  rms = lambda a: np.sqrt(np.mean(a ** 2, -1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(q)[0, 0], raw_q / rms(raw_q) * [1, 2, 3, 4], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(k)[0, 0], raw_k / rms(raw_k), rtol=1e-5)
  plain = CausalSelfAttention(8, 2, 1, 4, rngs=nnx.Rngs(0))
  q0, _, _ = plain._qkv(x, jnp.zeros((1, 1), jnp.int32))
  np.testing.assert_allclose(np.asarray(q0)[0, 0], raw_q, rtol=1e-6)


def test_qk_norm_scales_are_counted_as_norms_by_the_accounting_and_the_audit():
  cfg = _cfg()
  b = accounting.budget(cfg, seq_len=5)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert param_count(model) == b.total
  plain = accounting.budget(_cfg(attention_options=None), seq_len=5)
  assert b.total - plain.total == 2 * 6   # one [H] scale for queries, one for keys
  rows = {r.name: r for r in audit.audit_model(cfg)}
  assert rows["norms"].initialised == 3 * 32 + 2 * 6 and rows["norms"].ok
  assert rows["attention"].ok


def test_qk_norm_scales_are_adamw_norms():
  model = nnx.eval_shape(lambda: Transformer(_cfg(), rngs=nnx.Rngs(0)))
  got = {"/".join(str(k) for k in path_keys(p)[2:]): (r.matrix, r.component)
         for p, r in jax.tree_util.tree_leaves_with_path(param_role_tree(model))
         if path_keys(p)[:1] == ("blocks",) and path_keys(p)[2] == "attn"}
  assert got["attn/q_norm/scale"] == (False, "norm")
  assert got["attn/k_norm/scale"] == (False, "norm")
  assert got["attn/q_proj/kernel"] == (True, "attention")


def test_qk_norm_from_a_config_dict_and_a_bad_value():
  cfg = from_dict(ModelConfig, dict(attention_options=dict(qk_norm=True), moe=None), "model")
  assert cfg.attention_options.qk_norm is True
  with pytest.raises(ConfigError, match=r"model\.attention_options\.qk_norm.*bool"):
    MHAOptions(qk_norm="yes")
