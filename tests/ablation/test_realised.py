"""The budget of what ran (moejax.ablation.realised), on hand-made rows, budgets and results."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest

from moejax.ablation import budget as budget_lib
from moejax.ablation import realised, summary as summary_lib, tables
from moejax.balance import metrics as M
from tests.balance.helpers import make_result, uniform_probs
from tests.configs import moe_config
from tests.plugins import overreach_router  # noqa: F401  (registers 'overreach')

_OPT = "adamw lr=0.001 warmup=10 cosine->x0.1 b1=0.9 b2=0.95 eps=1e-08 wd=0.1 clip=1 steps=6"
# A top-k arm (declares 2 of 2 slots) and a top-p arm of the same model (top-p declares its
# maximum k, 2, so its budget is the same); the routed experts are 12288 of the 27040 active
# parameters per token and 24576 of the 61950 FLOPs.
TOPK = budget_lib.ArmBudget(total=47_520, active=27_040.0, active_max=27_040.0,
                            flops_per_token=61_950.0, tokens=512, optimizer=_OPT, slots=2.0,
                            slots_max=2.0, routed_active=12_288.0, routed_flops=24_576.0)
TOPP = dataclasses.replace(TOPK)


def test_the_training_mean_weights_each_logged_window_by_its_steps():
  rows = [{"step": 6, "active_experts_mean": 1.0}, {"step": 3, "active_experts_mean": 2.0},
          {"step": 7, "active_experts_mean": 4.0}, {"step": 8, "loss": 1.0}]
  assert realised.step_mean(rows, "active_experts_mean") == pytest.approx((3 * 2 + 3 + 4) / 7)
  assert realised.step_mean(rows, "absent") is None
  # Validation: per layer the kept copies over the targets counted, mean over layers.
  assert realised.val_active({"layer_0": np.array([3.0, 1.0]),
                              "layer_1": np.array([1.0, 1.0])}, 2.0) == 1.5
  assert realised.run_metrics(rows, {}, 0.0) == {"active_experts_train": pytest.approx(13 / 7)}
  # From a final evaluation: the targets its loads counted are its per-domain counts; the
  # layer of a mixture-of-depths block (only the tokens it selected reach it) is left out.
  ev = types.SimpleNamespace(loads={"layer_0": np.array([3.0, 1.0]),
                                    "layer_1": np.array([1.0, 0.0])},
                             domain_count=np.array([1.0, 1.0]), metrics={"tokens": 5.0})
  mod_odd = types.SimpleNamespace(is_mod_layer=lambda i: i % 2 == 1)
  assert realised.from_evaluation(rows, ev, mod_odd)["active_experts_val"] == 2.0
  no_mod = types.SimpleNamespace(is_mod_layer=lambda i: False)
  assert realised.from_evaluation(rows, ev, no_mod)["active_experts_val"] == 1.25


def test_a_router_over_its_declared_maximum_fails_in_one_line():
  rows = [{"step": 2, "active_experts_mean": 2.0, "active_experts_over_max": 0.0},
          {"step": 4, "active_experts_mean": 2.0, "active_experts_over_max": 0.25}]
  line = realised.over_max_error("overreach", 1.0, rows, "over/seed_0")
  assert "\n" not in line
  assert line.startswith(
      "run over/seed_0: router 'overreach' declares at most 1 FFN expert per token "
      "(RouterSpec.slots) but used more (25% of tokens over it in the steps logged at step 4; "
      "2 per token on average over training), so its budget counted fewer experts than ran; "
      "no result.json was written. Fix: return from the router's slots() the most experts")
  # A router that keeps its word, or nothing to check against.
  assert realised.over_max_error("topk", 2.0, [dict(r, active_experts_over_max=0.0)
                                                for r in rows], "r") == ""
  assert realised.over_max_error("soft", None, rows, "r") == ""
  # Logs without the share (written before it existed): the mean alone can still exceed it.
  old = [{"step": 4, "active_experts_mean": 2.5}]
  assert "2.5 per token on average" in realised.over_max_error("x", 2.0, old, "r")
  assert realised.over_max_error("x", 3.0, old, "r") == ""


def test_the_layer_logs_the_share_of_tokens_over_the_declared_maximum():
  probs = uniform_probs(4, 4)
  valid = [[True, True], [True, False], [True, True], [True, False]]
  result = make_result([[0, 1], [2, 0], [3, 1], [1, 0]], probs, valid=valid)
  over = lambda kind: float(M.routing_metrics(
      result, moe_config(num_experts=4, routing=dict(kind=kind, top_k=2))).active_over_max)
  assert over("topk") == 0.0        # declares 2 at most: no token has more
  assert over("overreach") == 0.5   # declares 1 at most: two tokens of four have 2


def test_declared_slots_and_realised_columns_side_by_side():
  real = {"topk": realised.Realised(train=2.0, val=2.0),
          "topp": realised.Realised(train=1.4, val=1.5, variable=True)}
  text = realised.table({"topk": TOPK, "topp": TOPP}, real)
  lines = text.splitlines()
  assert max(len(line) for line in lines) <= 100
  assert lines[:4] == [
      "arm          k  slots  train  val  train/slots  active  FLOPs/token",
      "-" * 67,
      "topk     fixed    2/2      2    2        +0.0%  27.04K       61.95K",
      "topp  variable    2/2    1.4  1.5       -30.0%  23.35K       54.58K"]
  assert "Arms are compared on realised compute" in " ".join(lines[4:])
  # Top-k's realised compute is its declared one; top-p's scales the routed share by 1.4/2.
  assert realised.realised_budget(TOPK, 2.0) == (TOPK.active, TOPK.flops_per_token)
  assert realised.realised_budget(TOPP, 1.4) == pytest.approx(
      (27_040 - 0.3 * 12_288, 61_950 - 0.3 * 24_576))
  # What experiments.ablate prints after training: the table, then the check's lines.
  results = [dict(arm="topk", active_experts_train=2.0, active_experts_val=2.0),
             dict(arm="topp", active_experts_train=1.4, active_experts_val=1.5,
                  active_experts_var=0.3)]
  printed = realised.report({"topk": TOPK, "topp": TOPP}, results,
                            {"active": 0.0, "flops_per_token": 0.0}, baseline="topk")
  assert printed[1] == text and printed[2:] == [
      "  !   realised active experts differ: arm topp 1.4 vs baseline topk 2 per token (-30%); "
      "realised", "      active/token -13.6%, FLOPs/token -11.9% (tolerance active 0%, "
      "flops_per_token 0%)"]
  # The budget table printed before training shows the declared slots.
  assert budget_lib.table({"topk": TOPK}).splitlines()[0].endswith("train_FLOPs  slots")


def test_an_arm_budget_records_the_routers_declaration():
  from tests.ablation import helpers
  from moejax.ablation import suite as suite_lib
  tree = helpers.tiny_suite(2)
  tree["arms"]["topp"] = dict(model=dict(moe=dict(
      routing=dict(kind="top_p", use_bias=False, options=dict(top_p=0.5)),
      balance=dict(bias_update="none"))))
  tree["fixed"] = dict(tokens=0.0)
  suite = suite_lib.suite_from_dict(tree)
  exp = suite.arm("aux").experiment
  b = budget_lib.arm_budget(exp)
  moe = exp.model.moe
  assert (b.slots, b.slots_max) == (2.0, 2.0) == (moe.routing.top_k, moe.routing.top_k)
  routed = budget_lib.model_budget(exp.model, exp.data.seq_len).breakdown["routed_experts"]
  assert (b.routed_active, b.routed_flops) == (routed.active, routed.flops)
  topp = budget_lib.arm_budget(suite.arm("topp").experiment)
  assert (topp.slots, topp.slots_max) == (2.0, 2.0)   # top-p declares its maximum k
  assert budget_lib.from_dict(b.as_dict()) == b


def _write_results(tmp_path, train: dict, fixed: dict) -> str:
  root = tmp_path / "suite"
  for arm, experts in train.items():
    for seed in (0, 1):
      run = root / arm / f"seed_{seed}"
      run.mkdir(parents=True)
      res = {"suite": "s", "arm": arm, "seed": seed, "run": f"{arm}/seed_{seed}",
             "budget": TOPK.as_dict(), "val_loss": 3.0 + seed,
             "active_experts_train": experts, "active_experts_val": experts,
             "active_experts_var": 0.0 if experts == 2.0 else 0.2}
      (run / "result.json").write_text(json.dumps(res))
  (root / "suite.json").write_text(json.dumps({
      "name": "s", "fixed": fixed, "baseline": "topk", "arm_order": list(train)}))
  return str(root)


def test_the_summary_flags_arms_whose_realised_compute_differs(tmp_path):
  fixed = {"active": 0.0, "flops_per_token": 0.0, "tokens": 0.0}
  summ = summary_lib.suite_summary(_write_results(tmp_path, {"topk": 2.0, "topp": 1.4}, fixed))
  flag = ("realised active experts differ: arm topp 1.4 vs baseline topk 2 per token (-30%); "
          "realised active/token -13.6%, FLOPs/token -11.9% (tolerance active 0%, "
          "flops_per_token 0%)")
  assert summ["budget_flags"] == [flag]  # the declared budgets are equal: only what ran differs
  assert summ["arms"]["topp"]["metrics"]["active_experts_train"]["interval"]["mean"] == 1.4
  md = tables.section_markdown(summ)
  assert f"- ! budget: {flag}" in md
  assert "| topk | fixed | 2/2 | 2 | 2 | +0.0% | 27.04K | 61.95K |" in md
  assert "| topp | variable | 2/2 | 1.4 | 1.4 | -30.0% | 23.35K | 54.58K |" in md
  # Within the suite's tolerance: no flag, the check's note instead.
  loose = {"active": 0.2, "flops_per_token": 0.2}
  assert summary_lib.suite_summary(_write_results(
      tmp_path / "b", {"topk": 2.0, "topp": 1.9}, loose))["budget_flags"] == []
  notes, flags = realised.check({"topk": TOPK, "topp": TOPP},
                                {"topk": realised.Realised(2.0), "topp": realised.Realised(1.4)},
                                loose, baseline="topk")
  assert flags == [] and notes[0] == "realised active/token: spread 13.63% (tolerance 20.00%)"
  # A quantity the suite does not hold fixed is not compared; an exempt arm is left out.
  assert realised.check({"topk": TOPK, "topp": TOPP}, {"topk": realised.Realised(2.0),
                                                      "topp": realised.Realised(1.0)},
                        {"tokens": 0.0}) == ([], [])
  assert realised.check({"topk": TOPK, "topp": TOPP}, {"topk": realised.Realised(2.0),
                                                      "topp": realised.Realised(1.0)},
                        {"active": 0.0}, exempt={"topp": ["active"]}) == ([], [])


def test_a_suite_records_and_prints_what_ran(tiny_suite_dir):
  """The shared tiny suite (tests/ablation/conftest.py): dropless top-2 computes exactly the
  2 experts it declares, in training and on the validation pass."""
  workdir, printed, results = tiny_suite_dir
  for res in results.values():
    assert res["active_experts_train"] == 2.0 and res["active_experts_val"] == 2.0
    assert res["active_experts_over_max"] == 0.0
    assert (res["budget"]["slots"], res["budget"]["slots_max"]) == (2.0, 2.0)
  lines = printed.splitlines()
  at = lines.index("budget of what ran (realised FFN experts per token, mean over seeds):")
  assert lines[at + 3].split()[:6] == ["aux", "fixed", "2/2", "2", "2", "+0.0%"]
  assert "  ok  realised active/token: spread 0.00% (tolerance 0.00%)" in lines
  assert max(len(line) for line in lines[at:at + 12]) <= 100
  with open(f"{workdir}/summary.json", encoding="utf-8") as f:
    assert json.load(f)["budget_flags"] == []
