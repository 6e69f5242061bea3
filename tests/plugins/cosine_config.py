"""configs/tiny.py with the cosine router of tests/plugins/cosine_router.py.

A config file that imports a plugin module: the one line a researcher adds
(the module sits next to this file, as a researcher's own would).

  python -m experiments.train --config=tests/plugins/cosine_config.py --workdir=/tmp/cos
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cosine_router  # noqa: E402,F401  (registers routing.kind='cosine')

from moejax.train.config import experiment_config_dict  # noqa: E402


def get_config():
  return experiment_config_dict(
      model=dict(
          d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dense_ff_width=64,
          moe=dict(topology=dict(num_experts=4, expert_width=32),
                   routing=dict(kind="cosine", top_k=2, score_fn="softmax", gating="normalized",
                                use_bias=True, options=dict(proj_dim=8, temperature=0.1)),
                   balance=dict(bias_update="sign", bias_rate=1e-3, aux_loss_coef=1e-3))),
      data=dict(name="python_stdlib", seq_len=32, batch_size=8, stdlib_max_files=12,
                stdlib_val_fraction=0.3),
      train=dict(steps=6, learning_rate=1e-2, warmup_steps=1, log_every=3, eval_every=3,
                 eval_batches=1, checkpoint_every=3, keep_checkpoints=2, progress=False),
  )
