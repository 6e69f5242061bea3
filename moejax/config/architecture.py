"""Architecture facts that only the parameter/FLOP accounting reads.

Published MoE models have parts the moejax model does not build: DeepSeek's
multi-head latent attention (MLA) and the encoder stack of Switch / T5. Their
preset files (``configs/presets/*.py``) describe those in an ``accounting``
section, so the accounting reproduces the published sizes while
:class:`~moejax.config.model.ModelConfig` holds only what the model honours.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

from moejax.config import registry as reg
from moejax.config.core import check_count


@dataclasses.dataclass(frozen=True)
class ArchitectureConfig:
  """attention: None (the model's own ``model.attention``) or a registered
  attention kind counted in its place with the options below (``mla``:
  DeepSeek-V2/V3 multi-head latent attention with q_lora_rank r_q (0: no
  query compression), kv_lora_rank r_kv, per-head qk_nope / qk_rope / v
  widths). encoder_layers > 0 adds an encoder stack with the same layout and
  cross-attention in every decoder layer (T5 / Switch)."""

  attention: Optional[str] = None
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  encoder_layers: int = 0

  def __post_init__(self):
    p = "accounting"
    if self.attention is not None:
      reg.ATTENTIONS.get(self.attention, f"{p}.attention")
    for name in ("q_lora_rank", "encoder_layers"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=0)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      check_count(f"{p}.{name}", getattr(self, name))
