"""gpt-oss-120b (OpenAI 2025, model card arXiv 2508.10925).

Hyperparameters: Hugging Face openai/gpt-oss-120b config.json (hidden_size
2880, 36 layers, 64 query heads, 8 KV heads, head_dim 64, attention_bias
true, intermediate_size 2880, 128 local experts, experts_per_token 4, vocab
201088, rope_theta 150000, untied embeddings). Not modelled: the per-head
attention sinks, the expert and router biases (~40M, 0.03%), the clamped
SwiGLU variant (same parameter count), the alternating 128-token banded
attention (FLOPs counted as full attention).
Published: 116.8B total ("117B"), 5.1B active per token (model card; its
parameter table gives 116.83B / 5.13B and counts the unembedding but not the
embedding among the active parameters: the matmul convention used here).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=201088,
      d_model=2880,
      n_layers=36,
      n_heads=64,
      n_kv_heads=8,
      head_dim=64,
      attention_bias=True,
      dense_ff_width=2880,
      moe_layout="all",
      tie_embeddings=False,
      rope_base=150000.0,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=128, expert_width=2880, activation="swiglu"),
          routing=dict(kind="topk", score_fn="softmax", top_k=4, gating="topk_softmax"),
      ),
  )
  cfg.published = dict(
      total=116.8e9, active=5.1e9, active_convention="matmul",
      source="gpt-oss model card (arXiv 2508.10925): 116.8B total, 5.1B active")
  return cfg
