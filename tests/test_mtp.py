"""Multi-token prediction (model.mtp_depth): the loss by hand, the modules' causality and
shifted inputs, training with weight 0 equal to training without the modules' loss,
generation unchanged by the modules, and the accounting and audit counting them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig
from moejax.model import Transformer, param_count, param_role_tree
from moejax.nn import mtp as mtp_lib
from moejax.serve.generate import generate
from moejax.topology import accounting, memory
from moejax.train import audit
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from moejax.train.optimizers import path_keys
from tests.train import helpers

V = 32


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, dense_ff_width=24, moe=None)
  base.update(kw)
  return ModelConfig(**base)


def test_mtp_loss_by_hand_depth_1_predicts_the_token_after_next():
  """Inputs t_0..t_3, targets t_1..t_4. Module 1 at position i is scored on t_{i+2}: a
  half-probability on that token gives log 2 per position, three positions, divided by
  the 4 tokens the main loss scores (the paper's 1/T)."""
  targets = jnp.array([[1, 2, 0, 1]])
  mask = jnp.ones((1, 4), bool)
  want_next_next = targets[0, 1:]                      # t_2, t_3, t_4
  probs = jnp.full((1, 3, 3), 0.25).at[0, jnp.arange(3), want_next_next].set(0.5)
  loss = mtp_lib.mtp_loss((jnp.log(probs),), targets, mask, jnp.float32(4))
  np.testing.assert_allclose(loss, 3 * math.log(2) / 4, rtol=1e-6)
  # The same half-probability on t_{i+1} (the main model's target) is a worse prediction.
  probs_next = jnp.full((1, 3, 3), 0.25).at[0, jnp.arange(3), targets[0, :3]].set(0.5)
  assert mtp_lib.mtp_loss((jnp.log(probs_next),), targets, mask, jnp.float32(4)) > loss
  # Two depths: the mean of their losses; a masked target is not scored.
  masked = mask.at[0, 3].set(False)
  two = mtp_lib.mtp_loss((jnp.log(probs), jnp.zeros((1, 2, 3))), targets, masked,
                         jnp.float32(3))
  np.testing.assert_allclose(two, (2 * math.log(2) / 3 + math.log(3) / 3) / 2, rtol=1e-6)


def test_module_k_at_position_i_reads_tokens_up_to_i_plus_k():
  model = Transformer(tiny(mtp_depth=2), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, V)
  _, aux = model(tokens, mtp=True)
  assert [lg.shape for lg in aux["mtp"]] == [(1, 7, V), (1, 6, V)]
  _, changed = model(tokens.at[0, 5].set((tokens[0, 5] + 1) % V), mtp=True)
  for k, (a, b) in enumerate(zip(aux["mtp"], changed["mtp"]), start=1):
    diff = np.abs(np.asarray(a - b)).max(axis=-1)[0]
    assert np.all(diff[:5 - k] == 0) and diff[5 - k] > 0, (k, diff)
  # Without mtp=True (evaluation, inference) the modules do not run.
  assert "mtp" not in model(tokens)[1]


def test_generation_is_unchanged_by_the_mtp_modules():
  plain = Transformer(tiny(), rngs=nnx.Rngs(3))
  with_mtp = Transformer(tiny(mtp_depth=2), rngs=nnx.Rngs(3))
  main = lambda m: {k: v for k, v in nnx.to_pure_dict(nnx.state(m, nnx.Param)).items()
                    if k != "mtp"}
  jax.tree.map(np.testing.assert_array_equal, main(plain), main(with_mtp))
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  a = generate(plain, prompts, max_new_tokens=5)
  b = generate(with_mtp, prompts, max_new_tokens=5)
  assert a.tokens == b.tokens and len(a.tokens[0]) == 5


def _train(tmp_path, steps=2, **model):
  cfg = helpers.experiment("tiny", str(tmp_path), data__batch_size=4, data__seq_len=16,
                           train__steps=10, train__warmup_steps=1,
                           **{f"model__{k}": v for k, v in model.items()})
  tx = make_optimizer(cfg.train, cfg.model)
  graphdef, state = step_lib.init_state(cfg, tx)
  step = step_lib.make_train_step(graphdef, cfg, tx)
  tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((4, 16), bool)}
  metrics = []
  for _ in range(steps):
    state, m = step(state, batch)
    metrics.append(m)
  return state, metrics


def test_training_with_mtp_weight_0_equals_training_without_the_modules_loss(tmp_path):
  base, m_base = _train(tmp_path)
  zero, m_zero = _train(tmp_path, mtp_depth=1, mtp_loss_weight=0.0)
  main = {k: v for k, v in zero.params.items() if k != "mtp"}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               main, base.params)
  for a, b in zip(m_zero, m_base):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    assert "mtp/loss" not in b and a["mtp/loss"] > 0
  # With a weight, the objective is ce + aux + weight * mtp/loss, and the modules train.
  weighted, m_w = _train(tmp_path, steps=1, mtp_depth=1, mtp_loss_weight=0.5)
  m = m_w[0]
  np.testing.assert_allclose(m["loss"], m["ce"] + m["aux_loss"] + 0.5 * m["mtp/loss"],
                             rtol=1e-6)
  assert not np.allclose(weighted.params["mtp"][0]["proj"]["kernel"],
                         zero.params["mtp"][0]["proj"]["kernel"])


def test_the_accounting_and_the_audit_count_the_modules():
  cfg = tiny(mtp_depth=2)
  d, f = 16, 24
  block = 4 * d * d + 3 * d * f + 2 * d              # MHA, SwiGLU, 2 block norms
  per_module = 2 * d * d + block + 3 * d             # projection, block, 3 norms
  b, plain = accounting.budget(cfg, seq_len=8), accounting.budget(tiny(), seq_len=8)
  assert b.breakdown["mtp"].total == 2 * per_module == b.total - plain.total
  assert b.active == plain.active                    # inference drops the modules
  matmul = 2 * d * d + 4 * d * d + 3 * d * f
  assert b.breakdown["mtp"].flops == 2 * (2 * matmul + 2 * 8 * 2 * 2 * 8 + 2 * V * d)
  assert param_count(Transformer(cfg, rngs=nnx.Rngs(0))) == b.total
  assert {r.name: r.initialised for r in audit.audit_model(cfg)}["mtp"] == 2 * per_module
  fp32 = memory.standard_formats()["fp32"]
  assert memory.weight_memory(cfg, fp32).params == plain.total


def test_mtp_projection_is_a_muon_matrix_and_its_norms_adamw():
  model = nnx.eval_shape(lambda: Transformer(tiny(mtp_depth=1), rngs=nnx.Rngs(0)))
  got = {"/".join(str(k) for k in path_keys(p)[2:]): r.matrix
         for p, r in jax.tree_util.tree_leaves_with_path(param_role_tree(model))
         if path_keys(p)[0] == "mtp"}
  assert got == {"proj/kernel": True, "hidden_norm/scale": False, "embed_norm/scale": False,
                 "head_norm/scale": False, "block/attn_norm/scale": False,
                 "block/ffn_norm/scale": False, "block/attn/q_proj/kernel": True,
                 "block/attn/k_proj/kernel": True, "block/attn/v_proj/kernel": True,
                 "block/attn/o_proj/kernel": True, "block/ffn/w_gate/kernel": True,
                 "block/ffn/w_up/kernel": True, "block/ffn/w_down/kernel": True}


@pytest.mark.parametrize("field, value", [("mtp_depth", -1), ("mtp_loss_weight", -0.1)])
def test_bad_mtp_fields_are_config_errors(field, value):
  with pytest.raises(ConfigError, match=f"model.{field}="):
    tiny(**{field: value})
