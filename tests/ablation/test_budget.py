"""The budget check: refuses unequal arms before any write, accepts every shipped suite."""

from __future__ import annotations

import io
import os

import pytest

from moejax.ablation import budget as budget_lib
from moejax.ablation import runner, suite as suite_lib
from moejax.config import ConfigError
from tests.ablation import helpers


def _never_train(*args, **kwargs):
  raise AssertionError("training must not start")


def test_refuses_arms_with_different_active_params(tmp_path):
  tree = helpers.tiny_suite()
  # top-1 instead of top-2: half the routed expert parameters per token.
  tree["arms"]["aux"]["model"]["moe"]["routing"]["top_k"] = 1
  suite = suite_lib.suite_from_dict(tree)
  workdir = str(tmp_path / "suite")
  out = io.StringIO()
  with pytest.raises(budget_lib.BudgetError, match=r"active: spread [0-9.]+% \(tolerance 0.00%"):
    runner.run_suite(suite, workdir, out=out, train_fn=_never_train)
  assert not os.path.exists(workdir)  # nothing written
  assert "active" in out.getvalue()  # the table was printed before refusing


def test_tolerance_admits_a_small_difference():
  tree = helpers.tiny_suite()
  tree["arms"]["aux"]["model"]["moe"]["topology"] = {"expert_width": 33}  # 32 -> 33: ~2% of active
  b = runner.budgets(suite_lib.suite_from_dict(tree))
  s = budget_lib.spread([b["aux"].active, b["bias"].active])
  assert 0 < s < 0.05
  budget_lib.check(b, {"active": 0.05})
  with pytest.raises(budget_lib.BudgetError):
    budget_lib.check(b, {"active": s / 2})


def test_refuses_different_optimizer_and_data():
  tree = helpers.tiny_suite()
  tree["arms"]["aux"]["train"] = {"learning_rate": 5e-3}
  suite = suite_lib.suite_from_dict(tree)
  with pytest.raises(budget_lib.BudgetError, match="optimizer settings differ"):
    runner.check_suite(suite, io.StringIO())
  tree = helpers.tiny_suite()
  tree["arms"]["aux"]["data"] = {"seed": 3}
  with pytest.raises(budget_lib.BudgetError, match="data differs"):
    runner.check_suite(suite_lib.suite_from_dict(tree), io.StringIO())


def test_tokens_are_steps_batch_seq():
  suite = suite_lib.suite_from_dict(helpers.tiny_suite(steps=6))
  b = runner.budgets(suite)["aux"]
  assert b.tokens == 6 * 8 * 32  # tiny: batch 8, seq 32


def test_spread_by_hand():
  assert budget_lib.spread([100.0, 98.0]) == pytest.approx(0.02)
  assert budget_lib.spread([5.0, 5.0]) == 0.0
  assert budget_lib.spread([0.0, 0.0]) == 0.0


def test_bad_suites_are_config_errors():
  tree = helpers.tiny_suite()
  tree["arms"]["aux"]["model"]["moe"]["num_expert"] = 4  # typo
  with pytest.raises(ConfigError, match="num_expert.*did you mean|num_expert.*not a field"):
    suite_lib.suite_from_dict(tree)
  with pytest.raises(ConfigError, match="not a budget quantity"):
    suite_lib.suite_from_dict(helpers.tiny_suite(fixed={"params": 0.0}))
  with pytest.raises(ConfigError, match="at least two arms"):
    suite_lib.suite_from_dict(helpers.tiny_suite(arms={"only": {}}))
  with pytest.raises(ConfigError, match="seeds"):
    suite_lib.suite_from_dict(helpers.tiny_suite(seeds=(0, 0)))


def test_merge_keeps_base_and_replaces_leaves():
  base = {"a": {"b": 1, "c": 2}, "d": None}
  assert suite_lib.merge(base, {"a": {"b": 5}, "d": {"x": 1}}) == {"a": {"b": 5, "c": 2},
                                                                   "d": {"x": 1}}
  assert base == {"a": {"b": 1, "c": 2}, "d": None}


def test_run_dirs():
  assert suite_lib.run_dir("arm", 0, 1) == "arm"
  assert suite_lib.run_dir("arm", 3, 2) == os.path.join("arm", "seed_3")


@pytest.mark.parametrize("name", helpers.SUITES)
def test_every_shipped_suite_passes_its_budget_check(name):
  path = os.path.join(helpers.ROOT, "configs", "ablations", f"{name}.py")
  suite = suite_lib.load_suite(path)
  assert suite.name == name
  assert len(suite.arms) >= 2
  assert "tokens" in suite.fixed
  # The optimizer is held unless it is the suite's axis (recipe: AdamW vs Muon).
  assert "optimizer" in suite.fixed or len({a.experiment.train.optimizer
                                            for a in suite.arms}) > 1
  out = io.StringIO()
  runner.check_suite(suite, out)
  assert all(a.name in out.getvalue() for a in suite.arms)


_OPT = ("adamw lr=0.001 warmup=10 cosine->x0.1 b1=0.9 b2=0.95 eps=1e-08 wd=0.1 clip=1 "
        "steps=100")


def _arm(total, optimizer=_OPT, source_tokens=None):
  return budget_lib.ArmBudget(total=total, active=148_800.0, active_max=148_800.0,
                              flops_per_token=329_730.0, tokens=102_400, optimizer=optimizer,
                              source_tokens=source_tokens,
                              source_flops=None if source_tokens is None else 3e11)


def test_the_budget_table_fits_100_columns_with_the_optimizer_under_it():
  names = ("full_new", "frozen_new", "lora_experts_new")
  sourced = {n: _arm(460_100 + i, source_tokens=307_200) for i, n in enumerate(names)}
  text = budget_lib.table(sourced, {"tokens": 0.0, "optimizer": 0.0})
  assert max(len(line) for line in text.splitlines()) <= 100
  assert text.splitlines() == [
      "arm                 total   active  active_max  flops_per_token  tokens*  train_FLOPs"
      "  source_tokens",
      "-" * 100,
      "full_new          460.10K  148.80K     148.80K          329.73K  102.40K      101.29B"
      "        307.20K",
      "frozen_new        460.10K  148.80K     148.80K          329.73K  102.40K      101.29B"
      "        307.20K",
      "lora_experts_new  460.10K  148.80K     148.80K          329.73K  102.40K      101.29B"
      "        307.20K",
      "",
      "arm               total_tokens  compute",
      "-" * 39,
      "full_new               409.60K  401.29B",
      "frozen_new             409.60K  401.29B",
      "lora_experts_new       409.60K  401.29B",
      "optimizer* (every arm): adamw lr=0.001 warmup=10 cosine->x0.1 b1=0.9 b2=0.95 eps=1e-08 "
      "wd=0.1 clip=1",
      "    steps=100"]
  # Arms on other optimizers: a letter each, the strings under the table.
  mixed = budget_lib.table({"a": _arm(1000), "b": _arm(1000, _OPT.replace("lr=0.001", "lr=0.01"))})
  assert mixed.splitlines() == [
      "arm  total   active  active_max  flops_per_token   tokens  train_FLOPs  optimizer",
      "-" * 81,
      "a    1.00K  148.80K     148.80K          329.73K  102.40K      101.29B          A",
      "b    1.00K  148.80K     148.80K          329.73K  102.40K      101.29B          B",
      "optimizer A: " + _OPT,
      "optimizer B: " + _OPT.replace("lr=0.001", "lr=0.01")]
  assert max(len(line) for line in mixed.splitlines()) <= 100


def test_the_printed_budget_and_its_notes_fit_100_columns():
  out = io.StringIO()
  runner.check_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), out)
  lines = out.getvalue().splitlines()
  assert max(len(line) for line in lines) <= 100 and "  ok  data: identical" in "\n".join(lines)
