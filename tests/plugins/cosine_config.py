"""configs/tiny.py with the cosine router of tests/plugins/cosine_router.py, 6 steps.

A config file that imports a plugin module: the one line a researcher adds
(the module sits next to this file, as a researcher's own would).

  python -m experiments.train --config=tests/plugins/cosine_config.py --workdir=/tmp/cos
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cosine_router  # noqa: E402,F401  (registers routing.kind='cosine')

from moejax.config import files  # noqa: E402
from moejax.train.config import experiment_config_dict  # noqa: E402


def get_config():
  tree = files.load_config_file(os.path.join(HERE, "..", "..", "configs", "tiny.py")).to_dict()
  routing = tree["model"]["moe"]["routing"]
  routing.update(kind="cosine", score_fn="softmax", options=dict(proj_dim=8, temperature=0.1))
  tree["model"]["moe"]["balance"].update(aux_loss_scope="batch", z_loss_coef=0.0)
  tree["train"].update(steps=6, warmup_steps=1, log_every=3, eval_every=3, eval_batches=1,
                       checkpoint_every=3, progress=False)
  return experiment_config_dict(**tree)
