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


# MoE MTP blocks (model.mtp_ffn='moe', DeepSeek-V3's MTP layer).

def tiny_moe(**kw) -> ModelConfig:
  moe = dict(topology=dict(num_experts=4, expert_width=8),
             routing=dict(kind="topk", top_k=2, score_fn="sigmoid", use_bias=True),
             balance=dict(aux_loss_coef=1e-2, z_loss_coef=1e-3, bias_update="sign"))
  from moejax.config import from_dict, MoEConfig  # pylint: disable=g-import-not-at-top
  return tiny(moe=from_dict(MoEConfig, moe, "model.moe"), **kw)


def test_an_moe_mtp_block_routes_with_its_own_experts_and_adds_its_balance_loss():
  cfg = tiny_moe(mtp_depth=2, mtp_ffn="moe")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert list(model.mtp_moe_ffns()) == ["mtp_1", "mtp_2"]
  assert list(model.moe_ffns()) == ["layer_0", "layer_1"]   # inference's layers
  own = model.mtp[0].block.ffn.params["experts"]
  assert own is not model.blocks[0].ffn.params["experts"]
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, V)
  _, aux = model(tokens, mtp=True)
  assert list(aux["mtp_moe"]) == ["mtp_1", "mtp_2"]
  assert aux["mtp_moe"]["mtp_2"]["load"].shape == (4,)
  layers = [*aux["moe"].values(), *aux["mtp_moe"].values()]
  np.testing.assert_allclose(aux["loss"], sum(a["losses"]["total"] for a in layers), rtol=1e-6)
  assert all(a["losses"]["total"] > 0 for a in aux["mtp_moe"].values())
  # Without the modules (evaluation, inference) only the main layers route and cost.
  _, plain = model(tokens)
  assert "mtp_moe" not in plain and set(plain["moe"]) == {"layer_0", "layer_1"}
  np.testing.assert_allclose(plain["loss"], sum(a["losses"]["total"]
                                                for a in aux["moe"].values()), rtol=1e-6)
  # A dense MTP block reports no MoE aux.
  _, dense = Transformer(tiny_moe(mtp_depth=1), rngs=nnx.Rngs(0))(tokens, mtp=True)
  assert dense["mtp_moe"] == {}


def test_a_replay_covers_the_main_layers_and_the_mtp_blocks_route_freely():
  from moejax import routing_record  # pylint: disable=g-import-not-at-top
  model = Transformer(tiny_moe(mtp_depth=1, mtp_ffn="moe"), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, V)
  recorded = routing_record.selections(model(tokens)[1])
  assert sorted(recorded) == ["layer_0", "layer_1"]
  _, aux = model(tokens, replay=recorded, mtp=True)
  free = model(tokens, mtp=True)[1]["mtp_moe"]["mtp_1"]["expert_ids"]
  np.testing.assert_array_equal(aux["mtp_moe"]["mtp_1"]["expert_ids"], free)


def test_training_moves_the_mtp_blocks_selection_bias_and_logs_their_loads(tmp_path):
  state, metrics = _train(tmp_path, steps=1, mtp_depth=1, mtp_ffn="moe")
  bias = state.router_state["mtp"][0]["block"]["ffn"]["router_state"]["bias"]
  assert np.abs(np.asarray(bias)).max() > 0      # the sign controller stepped it
  m = metrics[0]
  assert m["load/mtp_1"].shape == (4,) and "max_vio_batch/mtp_1" in m
  balance = sum(v for k, v in m.items() if k.startswith("balance/"))
  np.testing.assert_allclose(balance, m["aux_loss"], rtol=1e-5)
  _, dense = _train(tmp_path, steps=1, mtp_depth=1)
  assert "load/mtp_1" not in dense[0] and dense[0]["aux_loss"] < m["aux_loss"]


def test_the_accounting_and_the_audit_count_an_moe_mtp_block():
  cfg = tiny_moe(mtp_depth=2, mtp_ffn="moe")
  d, e, f = 16, 4, 8
  moe_ffn = e * 3 * d * f + d * e              # experts, router (its bias is router state)
  per_module = 2 * d * d + 4 * d * d + moe_ffn + 2 * d + 3 * d
  b, plain = accounting.budget(cfg, seq_len=8), accounting.budget(tiny_moe(), seq_len=8)
  assert b.breakdown["mtp"].total == 2 * per_module == b.total - plain.total
  assert b.active == plain.active
  assert param_count(Transformer(cfg, rngs=nnx.Rngs(0))) == b.total
  assert {r.name: r.initialised for r in audit.audit_model(cfg)}["mtp"] == 2 * per_module
  # Training FLOPs: the MoE layer's active ones (K=2 experts of f=8, as a dense FFN of
  # 2 f) plus its router's 2 d E, per module.
  dense_b = accounting.budget(tiny_moe(mtp_depth=2, dense_ff_width=2 * f), seq_len=8)
  assert b.breakdown["mtp"].flops - dense_b.breakdown["mtp"].flops == 2 * (2 * d * e)


def test_an_moe_mtp_blocks_experts_are_muon_matrices_and_its_router_adamw():
  model = nnx.eval_shape(lambda: Transformer(tiny_moe(mtp_depth=1, mtp_ffn="moe"),
                                             rngs=nnx.Rngs(0)))
  got = {"/".join(str(k) for k in path_keys(p)[3:]): r.matrix
         for p, r in jax.tree_util.tree_leaves_with_path(param_role_tree(model))
         if path_keys(p)[0] == "mtp" and "ffn" in path_keys(p)}
  main = {"/".join(str(k) for k in path_keys(p)[2:]): r.matrix
          for p, r in jax.tree_util.tree_leaves_with_path(param_role_tree(model))
          if path_keys(p)[:2] == ("blocks", 0) and "ffn" in path_keys(p)}
  assert got == main and any(got.values()) and not all(got.values())


def test_mtp_ffn_moe_needs_an_moe_and_the_dense_twin_drops_it():
  with pytest.raises(ConfigError, match=r"model.mtp_ffn='moe': builds the MTP blocks' FFN from "
                                        r"model.moe, and this model is dense.*Fix: set "):
    tiny(mtp_depth=1, mtp_ffn="moe")
  with pytest.raises(ConfigError, match=r"model.mtp_ffn='sparse'"):
    tiny_moe(mtp_ffn="sparse")
  from moejax.model import dense_twin  # pylint: disable=g-import-not-at-top
  twin = dense_twin(tiny_moe(mtp_depth=1, mtp_ffn="moe"))
  assert (twin.moe, twin.mtp_ffn, twin.mtp_depth) == (None, "dense", 1)
