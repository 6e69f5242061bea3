"""Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088).

Hyperparameters: Hugging Face mistralai/Mixtral-8x7B-v0.1 config.json
(hidden_size 4096, intermediate_size 14336, 32 layers, 32 heads, 8 KV heads,
head_dim 128, vocab 32000, 8 local experts, top-2, rope_theta 1e6,
router_aux_loss_coef 0.02, untied embeddings).
Published: "46.7B total parameters but only uses 12.9B parameters per
token" (Mistral AI, "Mixtral of experts", mistral.ai/news/mixtral-of-experts).
Mistral's 12.9B counts the input embedding table (12.88B with it, 12.75B
without), hence active_convention='with_embedding'.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=32000,
      d_model=4096,
      n_layers=32,
      n_heads=32,
      n_kv_heads=8,
      head_dim=128,
      dense_ff_width=14336,
      moe_layout="all",
      tie_embeddings=False,
      rope_base=1e6,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=8, expert_width=14336, activation="swiglu"),
          routing=dict(kind="topk", score_fn="softmax", top_k=2, gating="topk_softmax"),
          balance=dict(aux_loss_coef=0.02, aux_loss_convention="topk"),
      ),
  )
  cfg.published = dict(
      total=46.7e9, active=12.9e9, active_convention="with_embedding",
      source="mistral.ai/news/mixtral-of-experts (46.7B total, 12.9B per token)")
  return cfg
