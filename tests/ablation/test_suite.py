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
  assert repro == {"lossfree", "capacity", "deepseekmoe", "expert_choice_leak", "moe_vs_dense"}


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
