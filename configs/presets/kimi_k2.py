"""Kimi K2 (Moonshot AI 2025, arXiv 2507.20534).

Hyperparameters: Hugging Face moonshotai/Kimi-K2-Instruct config.json, the
DeepSeek-V3 architecture with hidden_size 7168, 61 layers,
first_k_dense_replace 1, intermediate_size 18432, moe_intermediate_size 2048,
n_routed_experts 384, n_shared_experts 1, num_experts_per_tok 8, n_group 1,
topk_group 1, scoring_func sigmoid, norm_topk_prob true,
routed_scaling_factor 2.827, topk_method noaux_tc; MLA with 64 heads,
q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
v_head_dim 128; vocab 163840, untied embeddings, no MTP layer.
Published: 1.04T total, 32B activated (technical report; the model card
rounds to 1T / 32B). 32B matches the matmul convention (31.7B; 32.9B with the
input table counted).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=163840,
      d_model=7168,
      n_layers=61,
      n_heads=64,
      dense_ff_width=18432,
      moe_layout="first_dense",
      first_dense_layers=1,
      tie_embeddings=False,
      rope_base=50000.0,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=384, expert_width=2048, activation="swiglu",
                        num_shared_experts=1, shared_expert_width=2048),
          routing=dict(kind="topk", score_fn="sigmoid", top_k=8, gating="normalized",
                       routed_scaling_factor=2.827, use_bias=True),
          balance=dict(bias_update="sign", bias_rate=1e-3),
      ),
  )
  # Parts the moejax model does not build; only the accounting reads them.
  cfg.accounting = dict(
      attention="mla",
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
  )
  cfg.published = dict(
      total=1.04e12, active=32e9, active_convention="matmul",
      source="arXiv 2507.20534 (1.04T total, 32B activated)")
  return cfg
