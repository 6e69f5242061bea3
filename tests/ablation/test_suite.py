"""Suite fields of the statistics: the baseline arm and the reproduction seed count."""

from __future__ import annotations

import os

import pytest

from moejax.ablation import suite as suite_lib
from moejax.config import ConfigError
from tests.ablation import helpers


def test_baseline_defaults_to_the_first_arm_and_can_be_named():
  assert suite_lib.suite_from_dict(helpers.tiny_suite()).baseline == "aux"
  assert suite_lib.suite_from_dict(helpers.tiny_suite(baseline="bias")).baseline == "bias"


def test_baseline_that_is_not_an_arm_names_the_field():
  with pytest.raises(ConfigError,
                     match=r"suite\.baseline.*'gshard'.*not an arm.*\['aux', 'bias'\]"):
    suite_lib.suite_from_dict(helpers.tiny_suite(baseline="gshard"))


def test_reproduction_needs_three_seeds():
  with pytest.raises(ConfigError, match=r"suite\.seeds.*1 seed.*reproduction=True.*at least 3"):
    suite_lib.suite_from_dict(helpers.tiny_suite(reproduction=True, seeds=(0,)))
  with pytest.raises(ConfigError, match=r"suite\.seeds.*2 seed"):
    suite_lib.suite_from_dict(helpers.tiny_suite(reproduction=True, seeds=(0, 1)))
  suite = suite_lib.suite_from_dict(helpers.tiny_suite(reproduction=True, seeds=(0, 1, 2)))
  assert suite.reproduction and suite.seeds == (0, 1, 2)
  assert not suite_lib.suite_from_dict(helpers.tiny_suite()).reproduction
  with pytest.raises(ConfigError, match=r"suite\.reproduction"):
    suite_lib.suite_from_dict(helpers.tiny_suite(reproduction="yes"))


@pytest.mark.parametrize("name", helpers.SUITES)
def test_every_shipped_suite_names_its_baseline(name):
  tree = suite_lib.load_suite_file(os.path.join(helpers.ROOT, "configs", "ablations",
                                                f"{name}.py"))
  assert "baseline" in tree  # stated, not defaulted
  suite = suite_lib.suite_from_dict(tree)
  assert suite.baseline in [a.name for a in suite.arms]
  if suite.reproduction:
    assert len(suite.seeds) >= suite_lib.MIN_REPRODUCTION_SEEDS


def test_the_reproductions_are_declared():
  repro = {n for n in helpers.SUITES if suite_lib.load_suite(
      os.path.join(helpers.ROOT, "configs", "ablations", f"{n}.py")).reproduction}
  assert repro == {"lossfree", "capacity", "deepseekmoe", "expert_choice_leak", "moe_vs_dense",
                   "recipe"}


@pytest.mark.parametrize("name", helpers.SUITES)
def test_every_group_limited_arm_can_bind(name):
  """Ranked by their best score, the groups of a token's top-k experts are always among its
  best k groups: a limit of topk_groups >= top_k then changes nothing (an arm equal to
  plain top-k in every number)."""
  from moejax.routing import groups  # pylint: disable=g-import-not-at-top
  suite = suite_lib.load_suite(os.path.join(helpers.ROOT, "configs", "ablations", f"{name}.py"))
  for arm in suite.arms:
    moe = arm.experiment.model.moe
    r = moe.routing if moe is not None else None
    if r is not None and r.n_groups > 1:
      assert groups.resolve_group_score(r) != "max" or r.topk_groups < r.top_k, arm.name


def _mtp_suite(**changes) -> dict:
  """tiny_suite with a third arm that adds one MTP module, steps matched to ``aux``'s compute."""
  tree = helpers.tiny_suite(steps=300, **changes)
  tree["arms"]["mtp"] = dict(model=dict(mtp_depth=1))
  tree["fixed"] = dict(active=0.0, compute=0.01)
  tree.setdefault("match_compute", {"mtp": "aux"})
  return tree


def test_match_compute_sets_the_steps_that_spend_the_reference_arms_compute():
  from moejax.ablation import budget  # pylint: disable=g-import-not-at-top
  suite = suite_lib.suite_from_dict(_mtp_suite())
  exp = {a.name: a.experiment for a in suite.arms}
  fpt = {n: budget.model_budget(e.model, e.data.seq_len).flops_per_token for n, e in exp.items()}
  assert fpt["mtp"] > fpt["aux"]  # the module's block and head
  assert exp["aux"].train.steps == exp["bias"].train.steps == 300
  assert exp["mtp"].train.steps == round(300 * fpt["aux"] / fpt["mtp"]) < 300
  assert suite.match_compute == {"mtp": "aux"}
  budgets = {n: budget.ArmBudget(total=0, active=0.0, active_max=0.0, flops_per_token=fpt[n],
                                 tokens=e.train.steps * e.data.batch_size * e.data.seq_len,
                                 optimizer="") for n, e in exp.items()}
  assert any(line.startswith("compute: spread") for line in budget.check(
      budgets, {"compute": 0.01}))  # within 1%: whole steps of a 300-step run


@pytest.mark.parametrize("match,message", [
    ({"mtp": "gshard"}, r"suite\.match_compute\.mtp.*'gshard'.*names an arm"),
    ({"mtp": "mtp"}, r"suite\.match_compute\.mtp.*not matched itself"),
    ({"mtp": "aux", "aux": "bias"}, r"suite\.match_compute\.mtp.*'aux'.*not matched itself")])
def test_match_compute_names_the_field_of_a_bad_reference(match, message):
  with pytest.raises(ConfigError, match=message):
    suite_lib.suite_from_dict(_mtp_suite(match_compute=match))


def test_deepseekmoe_on_bpe_tokens_changes_only_the_data_and_vocabulary():
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.path.join(helpers.ROOT, "configs", "ablations", "deepseekmoe.py")
  spec = importlib.util.spec_from_file_location("_deepseekmoe_cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  byte_suite = suite_lib.suite_from_dict(module.get_config())
  bpe_suite = suite_lib.suite_from_dict(module.get_config("bpe"))
  assert [a.name for a in bpe_suite.arms] == [a.name for a in byte_suite.arms]
  for b, s in zip(byte_suite.arms, bpe_suite.arms):
    assert (b.experiment.data.tokenizer, s.experiment.data.tokenizer) == ("bytes", "bpe")
    assert s.experiment.model.vocab_size == s.experiment.data.bpe_vocab_size == 1024
    assert s.experiment.model.moe == b.experiment.model.moe
  with pytest.raises(ValueError, match="unknown tokens"):
    module.get_config("bytez")
