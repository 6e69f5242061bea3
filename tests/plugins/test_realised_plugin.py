"""A plugin router that uses more experts than it declares is refused at the end of its run.

tests/plugins/overreach_router.py selects top-2 but declares one expert per
token at most: the budget check passes (it trusts the declaration), the run
trains, and the runner refuses it from the logged counts, in one line,
before its result.json is written.
"""

import io
import os

import pytest

from moejax.ablation import realised, runner, suite as suite_lib
from tests.ablation import helpers
from tests.plugins import overreach_router  # noqa: F401  (registers 'overreach')


def test_a_router_over_its_declared_maximum_is_refused_at_the_end_of_its_run(tmp_path):
  base = helpers.tiny_base(2)
  base["train"].update(log_every=1, eval_every=0, checkpoint_every=2)
  tree = dict(name="overreach", description="a router that under-declares", base=base,
              arms={"over": dict(model=dict(moe=dict(routing=dict(kind="overreach")))),
                    "topk": {}},
              fixed=dict(tokens=0.0), seeds=(0,), analysis=dict(routing_batches=1))
  out = io.StringIO()
  with pytest.raises(realised.RealisedBudgetError) as e:
    runner.run_suite(suite_lib.suite_from_dict(tree), str(tmp_path), out=out,
                     analyse_runs=False)
  line = str(e.value)
  assert "\n" not in line
  assert line.startswith("run over: router 'overreach' declares at most 1 FFN expert per token "
                         "(RouterSpec.slots) but used more (100% of tokens over it in the steps "
                         "logged at step 2; 2 per token on average over training)")
  assert "Fix: return from the router's slots() the most experts" in line
  # The budget table showed what each router declares; the run trained and was kept, but
  # it has no result (a rerun refuses it again), and the next arm never started.
  printed = out.getvalue().splitlines()
  assert printed[1].endswith("slots") and printed[3].endswith("1/1")
  assert printed[4].endswith("2/2")
  assert os.path.isdir(tmp_path / "over" / "checkpoints")
  assert not os.path.exists(tmp_path / "over" / "result.json")
  assert not os.path.exists(tmp_path / "topk")
