"""The dense baseline of configs/default.py: same active FFN parameters per token.

``moejax.model.dense_equivalent`` replaces every MoE FFN of the default model
by one dense FFN of width K * f = 2 * 128 = 256 (same activation), keeping
attention, embeddings, data and optimisation identical. The MoE model then
differs from this one only in holding 8x the FFN parameters, of which each
token uses the same number.

    python -m experiments.train --config=configs/dense.py --workdir=/tmp/moejax_dense
"""

import importlib.util
import os

from moejax.config import ModelConfig, from_dict, to_dict
from moejax.model import dense_equivalent


def _default():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
  spec = importlib.util.spec_from_file_location("moejax_configs_default", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config():
  default = _default()
  cfg = default.get_config()
  dense = dense_equivalent(from_dict(ModelConfig, default.model(), "model"))
  from moejax.train.config import experiment_config_dict
  return experiment_config_dict(model=to_dict(dense), data=cfg.data.to_dict(),
                                train=cfg.train.to_dict())
