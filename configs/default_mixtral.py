"""configs/default.py routed as Mixtral: the default model that exports to Hugging Face.

The default model routes DeepSeek-V3 style (sigmoid scores and a selection
bias), which no Hugging Face family the moejax Transformer can be written as
expresses: ``experiments.export_hf`` writes whole models only as Mixtral
(Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 need attentions the Transformer does
not build; docs/interop.md). This config keeps everything of
configs/default.py (d=128, 4 layers, 16 experts f=128 top-2, data,
optimisation, 600 steps) except the router and its balancing, which become
Mixtral's (``modeling_mixtral.py``): softmax over the top-2 logits, no
selection bias, and a Switch-style batch balance loss (alpha = 1e-2, the
top-k convention) instead of the bias controller.

    python -m experiments.train --config=configs/default_mixtral.py --workdir=/tmp/moejax_mixtral
    python -m experiments.finetune --source=/tmp/moejax_mixtral --workdir=/tmp/ft_mixtral
    python -m experiments.export_hf --workdir=/tmp/ft_mixtral --out=/tmp/ft_hf
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


def get_config():
  default = _default()
  cfg = default.get_config()
  model = default.model()
  model["moe"]["routing"] = dict(kind="topk", top_k=2, score_fn="softmax",
                                 gating="topk_softmax", use_bias=False)
  model["moe"]["balance"] = dict(bias_update="none", aux_loss_coef=1e-2,
                                 aux_loss_scope="batch", aux_loss_convention="topk")
  return experiment_config_dict(model=model, data=cfg.data.to_dict(), train=cfg.train.to_dict())
