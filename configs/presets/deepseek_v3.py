"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437), main model without MTP.

Hyperparameters: Hugging Face deepseek-ai/DeepSeek-V3 config.json
(hidden_size 7168, 61 layers, first_k_dense_replace 3, intermediate_size
18432, moe_intermediate_size 2048, n_routed_experts 256, n_shared_experts 1,
num_experts_per_tok 8, n_group 8, topk_group 4, scoring_func sigmoid,
norm_topk_prob true, routed_scaling_factor 2.5, topk_method noaux_tc; MLA
with 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
qk_rope_head_dim 64, v_head_dim 128; vocab 129280, untied embeddings).
Balance (paper section 2.1.2 / 4.2): bias update speed gamma = 1e-3, a
complementary sequence-wise balance loss with alpha = 1e-4.
Published: 671B total, 37B activated per token (paper abstract). The
repository's README_WEIGHTS.md states "Activation parameters: 36.6B
(including 0.9B for the output Head)" for the 671B main model (the 14B MTP
module excluded), i.e. the matmul convention used here.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=129280,
      d_model=7168,
      n_layers=61,
      n_heads=128,
      dense_ff_width=18432,
      moe_layout="first_dense",
      first_dense_layers=3,
      tie_embeddings=False,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=256, expert_width=2048, activation="swiglu",
                        num_shared_experts=1, shared_expert_width=2048),
          routing=dict(kind="topk", score_fn="sigmoid", top_k=8, gating="normalized",
                       routed_scaling_factor=2.5, use_bias=True, n_groups=8,
                       topk_groups=4, group_score="top2_sum"),
          balance=dict(aux_loss_coef=1e-4, aux_loss_scope="sequence",
                       aux_loss_convention="topk", bias_update="sign", bias_rate=1e-3),
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
      total=671e9, active=37e9, active_convention="matmul",
      source="arXiv 2412.19437 abstract (671B / 37B); README_WEIGHTS.md: 36.6B "
             "activated incl. 0.9B output head")
  return cfg
