"""Parameter / FLOP accounting: hand-computed tiny configs and real params."""

import dataclasses
import math

import jax
import pytest

from moejax.config import ArchitectureConfig, ModelConfig, MoEConfig, RoutingConfig
from moejax.topology import accounting
from moejax.topology.accounting import Component
from tests.configs import moe_config

R1 = RoutingConfig(top_k=1)


def _tiny(**kw):
  """vocab 10, d 4, 2 layers, 2 heads of width 2, 1 KV head; layer 1 is MoE."""
  base = dict(vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1,
              dense_ff_width=6, moe_layout="every_other",
              moe=moe_config(num_experts=2, expert_width=3, routing=R1))
  return ModelConfig(**{**base, **kw})


def test_tiny_model_by_hand():
  b = accounting.budget(_tiny(), seq_len=5)
  parts = b.breakdown
  assert parts["embedding"] == Component(40, 0, 0, 0)
  assert parts["lm_head"] == Component(40, 40, 40, 80)
  # q [4,4] + k [4,2] + v [4,2] + o [4,4] = 48 per layer; mixing 2*S*H*(h+h) = 80.
  assert parts["attention"] == Component(96, 96, 96, 2 * (96 + 80))
  assert parts["dense_ffn"] == Component(72, 72, 72, 144)  # 3 * 4 * 6
  # E=2 experts, d=4, f=3 swiglu: exactly 2*3*4*3 routed params, top-1 uses one.
  assert parts["routed_experts"] == Component(72, 36, 36, 72)
  assert parts["router"] == Component(8, 8, 8, 16)
  assert parts["norms"] == Component(20, 20, 20, 0)  # 2 per layer + final
  assert "shared_experts" not in parts and "peer" not in parts
  assert b.total == 348
  assert b.active == 272 and b.active_max == 272
  assert b.flops_per_token == 2 * 252 + 160
  assert b.input_embedding == 40 and b.active_with_embedding == 312
  assert b.non_embedding_total == 348 - 80


def test_tied_embeddings_counted_once():
  b = accounting.budget(_tiny(tie_embeddings=True), seq_len=5)
  assert b.breakdown["lm_head"] == Component(0, 40, 40, 80)
  assert b.total == 308 and b.active == 272 and b.active_with_embedding == 272


def test_gelu_and_gqa_counts():
  b = accounting.budget(_tiny(dense_activation="gelu", n_kv_heads=2,
                              moe=moe_config(num_experts=2, expert_width=3, activation="gelu",
                                            routing=R1)), seq_len=5)
  assert b.breakdown["dense_ffn"].total == 2 * 4 * 6
  assert b.breakdown["routed_experts"].total == 2 * 2 * 4 * 3
  assert b.breakdown["attention"].total == 2 * 4 * 4 * 4  # MHA: four [4, 4]


def test_attention_bias():
  assert accounting.attention_params(_tiny(attention_bias=True)) == 48 + (4 + 2 + 2 + 4)


def test_mla_by_hand():
  cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, dense_ff_width=5,
                    dense_activation="gelu", moe=None)
  arch = ArchitectureConfig(attention="mla", q_lora_rank=4, kv_lora_rank=3,
                            qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=2)
  # q_a 8*4 + q_b 4*(2*3) + kv_a 8*(3+1) + kv_b 3*(2*(2+2)) + o (2*2)*8.
  assert accounting.attention_params(cfg, arch) == 32 + 24 + 32 + 24 + 32
  b = accounting.budget(cfg, seq_len=4, arch=arch)
  assert b.breakdown["norms"].total == 2 * 8 + (3 + 4) + 8  # + MLA latent norms
  assert b.breakdown["attention"].flops == 2 * 144 + 2 * 4 * 2 * (3 + 2)
  assert b.total == 80 + 80 + 144 + 80 + 31
  no_q_lora = dataclasses.replace(arch, q_lora_rank=0)
  assert accounting.attention_params(cfg, no_q_lora) == 8 * 2 * 3 + 32 + 24 + 32


def test_encoder_decoder_by_hand():
  cfg = ModelConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2,
                    dense_ff_width=6, dense_activation="gelu", tie_embeddings=True, moe=None)
  b = accounting.budget(cfg, seq_len=3, arch=ArchitectureConfig(encoder_layers=1))
  # Encoder: attn 64, ffn 48, 2 norms; decoder: self + cross attn 128, ffn 48,
  # 3 norms; one final norm per stack; one shared table.
  assert b.breakdown["attention"].total == 3 * 64
  assert b.breakdown["norms"].total == 8 + 12 + 8
  assert b.total == 40 + 64 + 48 + 8 + 128 + 48 + 12 + 8 == 356
  assert b.active == b.total  # tied: the LM head's use of the table is the table
  assert b.flops_per_token == 2 * (40 + 64 + 48 + 128 + 48) + 3 * 2 * 3 * 2 * 4


def test_every_other_layout_in_encoder_and_decoder():
  cfg = ModelConfig(vocab_size=10, d_model=4, n_layers=2, n_heads=2,
                    dense_ff_width=6, moe_layout="every_other",
                    moe=moe_config(num_experts=4, expert_width=3, routing=R1))
  b = accounting.budget(cfg, seq_len=3, arch=ArchitectureConfig(encoder_layers=2))
  assert b.breakdown["routed_experts"].total == 2 * 4 * 36  # layer 1 of each stack
  assert b.breakdown["dense_ffn"].total == 2 * 72


def test_heterogeneous_widths_count_real_widths():
  moe = moe_config(num_experts=3, expert_widths=(2, 4, 3), routing=R1)
  c = accounting.moe_components(moe, 4, seq_len=8)["routed_experts"]
  assert c.total == 3 * 4 * (2 + 4 + 3)  # 108, not the padded 3 * 3*4*4 = 144
  assert c.active == 108 / 3  # one slot at the mean expert size
  assert c.active_max == 3 * 4 * 4  # one slot on the widest expert


def test_zero_compute_expected_active():
  moe = moe_config(num_experts=2, expert_width=3, zero_experts=1, constant_experts=1,
                  routing=RoutingConfig(top_k=2))
  c = accounting.moe_components(moe, 4, seq_len=8)
  # K E / (E + Z) = 2 * 2 / 4 = 1 FFN slot per token on average.
  assert c["routed_experts"] == Component(72, 36, 72, 72)
  # The constant expert: W_c [4, 2] + v [4]; 2 * 1/4 = 1/2 slot per token.
  assert c["zero_compute"] == Component(12, 6, 0, 8)
  assert c["router"].total == 4 * 4  # one column per routed output


def test_expert_choice_hash_topp_shared():
  ec = moe_config(num_experts=4, expert_width=3,
                 routing=RoutingConfig.build(kind="expert_choice", capacity=2.0))
  c = accounting.moe_components(ec, 4, 8)["routed_experts"]
  assert (c.active, c.active_max) == (2 * 36, 4 * 36)
  hashed = moe_config(num_experts=4, expert_width=3, routing=RoutingConfig.build(kind="hash", top_k=1))
  assert "router" not in accounting.moe_components(hashed, 4, 8)
  top_p = moe_config(num_experts=4, expert_width=3, routing=RoutingConfig.build(kind="top_p", top_k=3))
  assert accounting.moe_components(top_p, 4, 8)["routed_experts"].active == 3 * 36
  shared = moe_config(num_experts=4, expert_width=3, num_shared_experts=2,
                     shared_expert_gate=True, routing=R1)
  assert accounting.moe_components(shared, 4, 8)["shared_experts"] == \
      Component(76, 76, 76, 152)  # 2 * 3*4*3 + gate [4, 1]
  hier = moe_config(num_experts=4, expert_width=3,
                   routing=RoutingConfig.build(kind="hierarchical", n_families=2, top_k=1))
  assert accounting.moe_components(hier, 4, 8)["router"].total == 4 * 4 + 4 * 2


def test_soft_moe_by_hand():
  moe = moe_config(kind="soft", num_experts=2, expert_width=3, slots_per_expert=2)
  c = accounting.moe_components(moe, 4, seq_len=8)
  # Each sequence of 8 tokens fills 2 x 2 slots; a token's share is 2*72/8.
  assert c["routed_experts"] == Component(72, 18, 18, 36)
  # phi [4, 4] + scale; logits 2*16 plus dispatch and combine 2*4*4 each.
  assert c["soft_moe"] == Component(17, 16, 16, 32 + 64)


def test_peer_by_hand():
  moe = moe_config(kind="peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=4,
                  activation="gelu")
  c = accounting.moe_components(moe, 3, seq_len=8)["peer"]
  # 16 experts x (u, v) of 3; W_q 2*3*4 + LayerNorm 2*2*4; sub-keys 2 x 4 x 2.
  assert c.total == 96 + 24 + 16 + 16 == 152
  assert c.active == 2 * 2 * 6 + 40 + 16 == 80
  # Expert and query matmuls, plus each head scoring 2 x 4 sub-keys of width 2.
  assert c.flops == 2 * (24 + 24) + 2 * 2 * 4 * 4


def _leaf_count(tree):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("moe", [
    moe_config(num_experts=3, expert_width=4, num_shared_experts=2, shared_expert_gate=True,
              zero_experts=1, copy_experts=1, constant_experts=2, routing=R1),
    moe_config(num_experts=4, expert_width=4, activation="gelu",
              routing=RoutingConfig.build(kind="hierarchical", n_families=2, top_k=1)),
    moe_config(kind="soft", num_experts=2, expert_width=4, slots_per_expert=3),
    moe_config(kind="peer", peer_num_keys=3, peer_heads=2, peer_top_k=2, peer_key_dim=4,
              activation="swiglu"),
], ids=["sparse-shared-zero", "hierarchical-gelu", "soft", "peer"])
def test_totals_equal_initialised_parameters(moe):
  from moejax import layer  # the layer's init is the ground truth
  # Shapes only (trace, no compile): the count is what matters.
  params = jax.eval_shape(lambda k: layer.init_moe_params(k, 5, moe), jax.random.key(0))
  comps = accounting.moe_components(moe, 5, seq_len=8)
  assert _leaf_count(params) == sum(c.total for c in comps.values())


def test_mixture_of_depths_and_expert_sharing():
  base = _tiny(n_layers=4, moe_layout="all")
  shared = accounting.budget(dataclasses.replace(base, expert_sharing_group=2), 5)
  plain = accounting.budget(base, 5)
  assert plain.breakdown["routed_experts"].total == 4 * 72
  assert shared.breakdown["routed_experts"].total == 2 * 72  # one copy per group of 2
  assert shared.active == plain.active

  mod = accounting.budget(dataclasses.replace(base, mod_every=2, mod_capacity=0.5), 5)
  # Blocks 1 and 3 process half the tokens; each has a d-wide router.
  assert mod.breakdown["mod_router"] == Component(8, 8, 8, 16)
  assert mod.total == plain.total + 8
  block = 48 + 8 + 36 + 8  # attention, norms, one expert, router
  assert mod.active == pytest.approx(plain.active - 2 * 0.5 * block + 8)
  mix = 2 * 5 * 2 * 4
  assert mod.breakdown["attention"].flops == pytest.approx(
      2 * (2 * 48 + mix) + 2 * 0.5 * (2 * 48 + 0.5 * mix))


def test_dense_model_and_budget_frozen():
  b = accounting.budget(_tiny(moe=None, moe_layout="all"), seq_len=5)
  assert b.breakdown["dense_ffn"].total == 2 * 72 and "router" not in b.breakdown
  with pytest.raises(dataclasses.FrozenInstanceError):
    b.total = 0
  with pytest.raises(ValueError, match="seq_len"):
    accounting.budget(_tiny(), seq_len=0)


def test_budget_table_aligned_with_published_errors():
  budgets = {"tiny": accounting.budget(_tiny(), 5),
             "tiny_tied": accounting.budget(_tiny(tie_embeddings=True), 5)}
  published = {"tiny": {"total": 348, "active": 312, "active_convention": "with_embedding"}}
  text = accounting.budget_table(budgets, published)
  lines = text.splitlines()
  summary = lines[:lines.index("")]
  assert len({len(l) for l in summary}) == 1  # aligned columns
  assert summary[2].startswith("tiny ") and "+0.00%" in summary[2]
  assert summary[3].rstrip().endswith("-")  # no published numbers for this row
  assert any(l.startswith("routed_experts") and "72 / 36" in l for l in lines)
  assert "matmul convention" in lines[-1]


def test_human():
  assert accounting.human(46.7e9) == "46.70B"
  assert accounting.human(1.04e12) == "1.04T"
  assert accounting.human(12) == "12"


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=11, d_model=8, n_layers=4, n_heads=2, n_kv_heads=1,
                dense_ff_width=6, moe_layout="every_other", mod_every=2,
                moe=moe_config(num_experts=4, expert_width=3, num_shared_experts=1,
                              shared_expert_gate=True, constant_experts=1,
                              routing=RoutingConfig(top_k=2))),
    ModelConfig(vocab_size=11, d_model=8, n_layers=4, n_heads=2, dense_ff_width=6,
                tie_embeddings=True, attention_bias=True, expert_sharing_group=2,
                moe=moe_config(num_experts=4, expert_width=3, activation="gelu", routing=R1)),
], ids=["untied-mod-shared-zero", "tied-bias-expert-sharing"])
def test_total_equals_transformer_param_count(cfg):
  from flax import nnx
  from moejax import model
  abstract = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  assert model.param_count(abstract) == accounting.budget(cfg, 4).total
