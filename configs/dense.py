"""The dense baseline of configs/default.py: same active FFN parameters per token.

``model.dense_twin='active'`` replaces every MoE FFN of the default model by
one dense FFN of width K * f = 2 * 128 = 256 (same activation), keeping
attention, embeddings, data and optimisation identical (resolved when the
config is built: ``--print_config`` shows the width). The MoE model then
differs from this one only in holding 8x the FFN parameters, of which each
token uses the same number. Any config has such a twin from the command line:
``--config.model.dense_twin=active`` (or ``total`` for equal total parameters).

    python -m experiments.train --config=configs/dense.py --workdir=/tmp/moejax_dense
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
  return experiment_config_dict(model=dict(default.model(), dense_twin="active"),
                                data=cfg.data.to_dict(), train=cfg.train.to_dict())
