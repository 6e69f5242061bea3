"""Mixtral 8x22B (Mistral AI, April 2024).

Hyperparameters: Hugging Face mistral-community/Mixtral-8x22B-v0.1
config.json (hidden_size 6144, intermediate_size 16384, 56 layers, 48 heads,
8 KV heads, head_dim 128, vocab 32000 (the Instruct release extends it to
32768), 8 experts, top-2, rope_theta 1e6, router_aux_loss_coef 0.001,
untied embeddings).
Published: "141B total, 39B active" (Mistral AI, "Cheaper, Better, Faster,
Stronger", mistral.ai/news/mixtral-8x22b). Counted with the input table as
for Mixtral 8x7B (39.16B with it, 38.96B without; both within 1%).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=32000,
      d_model=6144,
      n_layers=56,
      n_heads=48,
      n_kv_heads=8,
      head_dim=128,
      dense_ff_width=16384,
      moe_layout="all",
      tie_embeddings=False,
      rope_base=1e6,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=8, expert_width=16384, activation="swiglu"),
          routing=dict(kind="topk", score_fn="softmax", top_k=2, gating="topk_softmax"),
          balance=dict(aux_loss_coef=0.001, aux_loss_convention="topk"),
      ),
  )
  cfg.published = dict(
      total=141e9, active=39e9, active_convention="with_embedding",
      source="mistral.ai/news/mixtral-8x22b (141B total, 39B active)")
  return cfg
