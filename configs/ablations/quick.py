"""Quick suite: auxiliary balance loss vs aux-loss-free bias on the default model.

The README's main command. Two arms of configs/default.py (3.5M params, d=128,
4 MoE layers of 16 experts top-2, sigmoid scores) for 250 steps of 16 x 128
tokens (512k tokens), same data order and seed:

- ``aux_loss``: Switch/GShard-style batch balance loss, alpha = 1e-2, no bias;
- ``lossfree``: the aux-loss-free sign-bias controller (Wang et al.
  2408.15664), no balance loss, u = 1e-2: the paper's u = 1e-3 moves a bias
  by at most 0.25 in 250 steps, too little to balance in a run this short
  (the lossfree block of RESULTS.md measures both).

Size: 2 arms of one seed; the wall time measured on 2 CPU cores is in the
README (its first command). Expect the loss-free arm to reach a much lower
MaxVio_global at a similar validation loss (Wang et al. Table 2: 0.72 -> 0.04).

  python -m experiments.ablate --config=configs/ablations/quick.py --workdir=/tmp/moejax_quick
"""

import importlib.util
import os

from moejax.ablation.bases import EVAL_BATCHES, eval_every, suite_config


def _default_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "default.py")
  spec = importlib.util.spec_from_file_location("_moejax_default_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config().to_dict()


def _balance(aux, bias, rate=1e-3):
  return dict(aux_loss_coef=aux, aux_loss_scope="batch", aux_loss_convention="topk",
              bias_update="sign" if bias else "none", bias_rate=rate)


def get_config():
  base = _default_config()
  base["train"].update(steps=250, warmup_steps=20, eval_every=eval_every(250),
                       eval_batches=EVAL_BATCHES,
                       checkpoint_every=50, keep_checkpoints=6, log_every=25)
  return suite_config(
      name="quick",
      description=__doc__,
      base=base,
      arms={
          "aux_loss": dict(model=dict(moe=dict(routing=dict(use_bias=False),
                                               balance=_balance(1e-2, False)))),
          "lossfree": dict(model=dict(moe=dict(routing=dict(use_bias=True),
                                               balance=_balance(0.0, True, 1e-2)))),
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="aux_loss",  # the published reference (aux loss)
      analysis=dict(comm_devices=8, routing_batches=4),
  )
