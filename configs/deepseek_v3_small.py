"""configs/default.py trained with DeepSeek-V3's recipe: MLA, loss-free MoE, MTP and Muon.

The default model's width, depth, heads, experts and routing (d=128, 4
layers, 4 heads; 16 experts of f=128, top-2, sigmoid scores normalised over
the selection, the aux-loss-free selection bias moved by the sign
controller plus a tiny sequence-wise balance loss), data and schedule, with:

- multi-head latent attention (``model.attention='mla'``, arXiv 2405.04434):
  a KV latent of 72 numbers and one rotary key of 8 per token (what the
  cache holds: 80 numbers per token and layer against the default's 256),
  4 heads of 32 content + 8 rotary query/key features and 32 value
  features, queries projected from x directly (no query latent). These
  widths make the attention weights exactly the default's (65,536 per
  layer), so the active parameters are the default's plus the 72-wide
  latent norm of each layer;
- one multi-token prediction module (``model.mtp_depth=1``, arXiv
  2412.19437 Sec. 2.2) with DeepSeek-V3's early loss weight 0.3; its block's
  FFN is an MoE layer like the main ones, with its own 16 experts
  (``model.mtp_ffn='moe'``, as DeepSeek-V3's MTP layer). Training only: its
  parameters are not active and generation ignores it;
- Muon (``train.optimizer='muon'``) on the attention, MTP and expert
  matrices, each expert orthogonalised on its own, AdamW on the rest, at
  the default's learning rate (Liu et al.'s update-RMS matching).

    python -m experiments.train --config=configs/deepseek_v3_small.py --workdir=/tmp/moejax_dsv3
"""

import importlib.util
import os

from moejax.train.config import experiment_config_dict


def _default():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
  spec = importlib.util.spec_from_file_location("moejax_configs_default", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def model():
  """The default model with MLA and one MTP module."""
  return dict(
      _default().model(),
      attention="mla",
      attention_options=dict(q_lora_rank=0, kv_lora_rank=72, qk_nope_head_dim=32,
                             qk_rope_head_dim=8, v_head_dim=32),
      mtp_depth=1, mtp_loss_weight=0.3, mtp_ffn="moe")


def get_config():
  cfg = _default().get_config()
  return experiment_config_dict(model=model(), data=cfg.data.to_dict(),
                                train=dict(cfg.train.to_dict(), optimizer="muon",
                                           optimizer_options=dict()))
