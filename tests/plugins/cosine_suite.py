"""A two-arm suite: the shipped top-k router against the plugin cosine router.

  python -m experiments.ablate --config=tests/plugins/cosine_suite.py --workdir=/tmp/cos_suite

``--config.router=cosine_scaled`` swaps in the variant whose parameters the
accounting does not know; the budget audit must refuse that suite.
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cosine_router  # noqa: E402,F401  (registers 'cosine' and 'cosine_scaled')
import cosine_config  # noqa: E402

import ml_collections  # noqa: E402


def get_config(arg: str = "cosine"):
  base = cosine_config.get_config().to_dict()
  routing = base["model"]["moe"]["routing"]
  plugin = dict(kind=arg, options=copy.deepcopy(routing["options"]))
  # The base (and the baseline arm) is the shipped router; the plugin arm names its kind
  # and its options (a changed routing.kind brings its own options).
  routing.update(kind="topk", options={})
  return ml_collections.ConfigDict(dict(
      name="cosine_vs_topk",
      description=__doc__,
      base=base,
      arms={"topk": {}, "cosine": dict(model=dict(moe=dict(routing=plugin)))},
      # The routers differ in their parameters (d E vs d r + r E): a few hundred of the
      # model's ~40k, held within 2%; everything else is held exactly.
      fixed=dict(total=0.02, active=0.02, flops_per_token=0.02, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="topk",
      analysis=dict(routing_batches=1, comm_devices=4, causal_probe=False, latency_reps=2),
  ), sort_keys=False)
