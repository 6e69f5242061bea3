"""configs/tiny.py balanced by the stateful plugin rule of tests/plugins/stateful_rule.py.

  python -m experiments.train --config=tests/plugins/stateful_config.py --workdir=/tmp/ema
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stateful_rule  # noqa: E402,F401  (registers balance.bias_update='ema_sign')

from moejax.config import files  # noqa: E402
from moejax.train.config import experiment_config_dict  # noqa: E402


def get_config():
  tree = files.load_config_file(os.path.join(HERE, "..", "..", "configs", "tiny.py")).to_dict()
  tree["model"]["moe"]["balance"].update(bias_update="ema_sign", bias_rate=1e-2)
  tree["train"].update(steps=24, warmup_steps=1, log_every=1, eval_every=24, eval_batches=1,
                       checkpoint_every=4)
  return experiment_config_dict(**tree)
