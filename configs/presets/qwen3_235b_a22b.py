"""Qwen3-235B-A22B (Qwen Team 2025, arXiv 2505.09388).

Hyperparameters: Hugging Face Qwen/Qwen3-235B-A22B config.json
(hidden_size 4096, 94 layers, 64 query heads, 4 KV heads, head_dim 128,
moe_intermediate_size 1536, 128 experts, num_experts_per_tok 8,
norm_topk_prob true, no shared experts, router_aux_loss_coef 0.001, vocab
151936, rope_theta 1e6, untied embeddings; the per-head QK RMSNorm weights,
256 per layer, are not modelled). The report trains with a global-batch
load-balancing loss (Qiu et al. 2501.11873).
Published: "235B in total and 22B activated" (model card / report Table 1);
the model card's "Non-Embedding: 234B" shows Qwen counts embeddings as
parameters, and 22B matches with the input table counted (22.19B; 21.57B
without).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=151936,
      d_model=4096,
      n_layers=94,
      n_heads=64,
      n_kv_heads=4,
      head_dim=128,
      dense_ff_width=12288,
      moe_layout="all",
      tie_embeddings=False,
      rope_base=1e6,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=128, expert_width=1536, activation="swiglu"),
          routing=dict(kind="topk", score_fn="softmax", top_k=8, gating="normalized"),
          balance=dict(aux_loss_coef=0.001, aux_loss_scope="global",
                       aux_loss_convention="topk"),
      ),
  )
  cfg.published = dict(
      total=235e9, active=22e9, active_convention="with_embedding",
      source="huggingface.co/Qwen/Qwen3-235B-A22B model card (235B total, 22B activated)")
  return cfg
