"""A suite's base, arm and source errors are one line with the one specific Fix."""

from __future__ import annotations

import pytest

from moejax.ablation import suite as suite_lib
from moejax.config import ConfigError
from tests.ablation import helpers


def test_suite_base_and_arm_errors_carry_one_specific_fix():
  tree = helpers.tiny_suite()
  tree["base"]["train"]["steps"] = 0
  with pytest.raises(ConfigError) as err:
    suite_lib.suite_from_dict(tree)
  assert str(err.value) == ("suite.base (the experiment every arm changes) is not valid: "
                            "train.steps=0: must be >= 1. Fix: set train.steps >= 1")
  tree = helpers.tiny_suite()
  tree["arms"]["wide"] = {"model": {"moe": {"routing": {"top_k": 9}}}}
  with pytest.raises(ConfigError) as err:
    suite_lib.suite_from_dict(tree)
  assert str(err.value) == ("suite.arms.wide builds an invalid experiment: moe.routing.top_k=9: "
                            "exceeds moe.topology.num_experts=4. Fix: set moe.routing.top_k <= 4")
  assert err.value.field == "moe.routing.top_k" and err.value.value == 9
  tree = helpers.tiny_suite(source=dict(helpers.tiny_base(), train=dict(steps=0)))
  with pytest.raises(ConfigError) as err:
    suite_lib.suite_from_dict(tree)
  assert str(err.value) == ("suite.source is not a valid experiment: train.steps=0: must be "
                            ">= 1. Fix: set train.steps >= 1")
