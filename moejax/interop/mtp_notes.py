"""The one line an export prints when it leaves multi-token prediction modules out.

transformers builds no MTP module for any family (DeepSeek-V3's own
checkpoints keep theirs as an extra decoder layer that transformers skips on
load), so a whole-model export writes the main model and says, on stderr,
what it left out.
"""

from __future__ import annotations

import sys

from moejax.config import ModelConfig


def left_out(cfg: ModelConfig, model_type: str) -> str:
  """The note for ``cfg``'s MTP modules, or '' without any."""
  if not cfg.mtp_depth:
    return ""
  return (f"note: {model_type} export leaves out the {cfg.mtp_depth} multi-token prediction "
          f"module(s) (model.mtp_depth={cfg.mtp_depth}): transformers has no MTP module; the "
          "exported model is the main model, which is all that inference runs")


def note_left_out(cfg: ModelConfig, model_type: str) -> None:
  """Prints :func:`left_out`'s line on stderr (nothing without MTP)."""
  line = left_out(cfg, model_type)
  if line:
    print(line, file=sys.stderr)
