"""Switch-Base-128 (Fedus et al. 2021, arXiv 2101.03961).

Hyperparameters: Hugging Face google/switch-base-128 config.json, a T5-Base
encoder-decoder (d_model 768, d_ff 3072, d_kv 64, 12 heads, 12 encoder + 12
decoder layers, vocab 32128, shared input / output embedding) whose every
other FFN (encoder_sparse_step = decoder_sparse_step = 2: layers 1, 3, ...)
is a top-1 Switch layer over 128 experts of width 3072. The FFNs use ReLU;
we declare 'gelu', which has the same two matrices and so the same
parameter count and FLOPs (ReLU is not a moejax activation). Router: float32
(selective precision), input jitter 1e-2, z-loss 1e-3, capacity factor 1.25.
Published: 7.4B parameters. The paper publishes no "active" count: Switch-
Base is FLOP-matched to T5-Base, so the active reference is T5-Base's 220M
parameters (Raffel et al. 2019, section 3.7); the dense T5-Base checkpoint
has 222.9M, our active count adds the 12 routers (1.2M).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.model = dict(
      vocab_size=32128,
      d_model=768,
      n_layers=12,
      n_heads=12,
      head_dim=64,
      dense_ff_width=3072,
      dense_activation="gelu",
      moe_layout="every_other",
      tie_embeddings=True,
      moe=dict(
          kind="sparse",
          topology=dict(num_experts=128, expert_width=3072, activation="gelu"),
          routing=dict(kind="topk", score_fn="softmax", top_k=1, gating="scores",
                       router_dtype="float32", input_jitter=0.01),
          balance=dict(capacity_factor=1.25, aux_loss_coef=0.01, aux_loss_convention="switch",
                       z_loss_coef=0.001),
      ),
  )
  # Parts the moejax model does not build; only the accounting reads them.
  cfg.accounting = dict(
      encoder_layers=12,
  )
  cfg.published = dict(
      total=7.4e9, active=220e6, active_convention="matmul",
      source="arXiv 2101.03961 / HF google/switch-base-128 (7.4B); active: FLOP-matched "
             "T5-Base, 220M (arXiv 1910.10683)")
  return cfg
