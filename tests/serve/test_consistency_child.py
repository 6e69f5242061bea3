"""Expert-parallel perturbations measured in a child process (moejax.serve.consistency_child).

A suite's process has one CPU device, so ep2 / ep8 run in a child that
simulates them: the child's rows are those of an in-process measurement
where both can run (ep1), a suite's columns carry ep2 next to the in-process
perturbations, and a child that fails leaves ``n/a`` rows that say why.
"""

from __future__ import annotations

import numpy as np
import pytest

from moejax.ablation import runner
from moejax.serve import consistency_child as cc
from moejax.serve import routing_consistency as rc
from moejax.serve.generate import load_run


def test_only_perturbations_needing_more_devices_go_to_a_child_and_only_on_cpu():
  names = ("bf16", "ep1", "ep2", "ep8")
  assert cc.needs_child(names, visible=1, backend="cpu") == ("ep2", "ep8")
  assert cc.needs_child(names, visible=2, backend="cpu") == ("ep8",)
  assert cc.needs_child(names, visible=8, backend="cpu") == ()
  assert cc.needs_child(names, visible=1, backend="gpu") == ()   # cannot simulate a GPU


@pytest.fixture(scope="module")
def measured(tiny_run):
  _, model, step = load_run(tiny_run)
  tokens = np.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (4, 16)),
                      np.int32)
  return model, step, tokens


def test_the_childs_rows_are_the_in_process_ones(tiny_run, measured):
  model, step, tokens = measured
  got = cc.measure(tiny_run, step, tokens, ("ep1", "ep2"))
  here = rc.measure(model, tokens, ("ep1",))
  assert got["ep1"] == here["ep1"]
  assert 0.0 <= got["ep2"]["flip_rate"] <= 1.0 and len(got["ep2"]["layer_flip_rate"]) == 2


def test_a_suites_columns_carry_ep2_from_a_one_device_process(tiny_run, measured, monkeypatch):
  model, step, tokens = measured
  monkeypatch.setattr(runner.jax, "device_count", lambda: 1)
  got = runner._consistency(model, [{"inputs": tokens[:2]}, {"inputs": tokens[2:]}],
                            ("remat", "ep2"), tiny_run, step)
  assert got["flip_rate_remat"] == 0.0 and 0.0 <= got["flip_rate_ep2"] <= 1.0
  assert got["consistency_na"] == {} and "token_flip_share_ep2" in got


def test_a_failing_child_leaves_na_rows_that_say_why(tiny_run, measured):
  _, _, tokens = measured
  got = cc.measure(tiny_run, 99, tokens, ("ep2",))
  why = got["ep2"]["n/a"]
  assert why.startswith("its child process on 2 simulated devices failed:")
  assert "no checkpoint at step 99" in why and "\n" not in why
