"""A bad ``--config.*`` value is one ``error:`` line naming the override, the value and the fix.

The flags are parsed in-process (``experiments.cli.parse_flags`` on a
private ``FlagValues``, as ``cli.run`` does on absl's), so each case costs
milliseconds; two subprocess runs check that the binaries are wired to it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from experiments import cli, flag_errors
from tests.ablation import helpers as ablation_helpers

ROOT = ablation_helpers.ROOT
TINY = "configs/tiny.py"
QUICK = "configs/ablations/quick.py"


def _parse_error(capsys, config: str, *overrides: str, experiment_at=None) -> str:
  """The one stderr line of parsing ``--config=config overrides`` (which must exit 1)."""
  argv = ["binary", f"--config={config}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, sys_argv=argv)
  with pytest.raises(SystemExit) as exit_:
    cli.parse_flags(argv, experiment_at=experiment_at, flag_values=fv)
  assert exit_.value.code == 1
  err = capsys.readouterr().err
  assert "Traceback" not in err and len(err.splitlines()) == 1, err
  return err.splitlines()[0]


@pytest.mark.parametrize("override, line", [
    ("--config.train.steps=abc", "error: --config.train.steps='abc': not an integer. Fix: pass "
     "a whole number (the field is an int), e.g. --config.train.steps=40"),
    ("--config.train.steps=1.5", "error: --config.train.steps='1.5': not an integer. Fix: pass "
     "a whole number (the field is an int), e.g. --config.train.steps=40"),
    ("--config.train.eval_batches=all", "error: --config.train.eval_batches='all': not an "
     "integer. Fix: pass a whole number (the field is an int), e.g. "
     "--config.train.eval_batches=4"),
    ("--config.train.learning_rate=fast", "error: --config.train.learning_rate='fast': not a "
     "number. Fix: pass a number (the field is a float), e.g. --config.train.learning_rate=0.01"),
    ("--config.model.moe.routing.use_bias=maybe", "error: --config.model.moe.routing.use_bias="
     "'maybe': not a boolean. Fix: pass true or false (the field is a bool), e.g. "
     "--config.model.moe.routing.use_bias=true (or --config.model.moe.routing.use_bias / "
     "--noconfig.model.moe.routing.use_bias)"),
    ("--config.model.moe=3", "error: --config.model.moe='3': a config section, not a value. "
     "Fix: set its fields instead, e.g. --config.model.moe.FIELD=VALUE (--print_config lists "
     "the fields)"),
    ("--config.data.loss_domains=('code',", "error: --config.data.loss_domains=\"('code',\": "
     "not a tuple. Fix: pass a Python tuple in single quotes (the field is a tuple), e.g. "
     "--config.data.loss_domains='(1, 2)'"),
])
def test_a_value_of_the_wrong_type_names_the_override_the_value_and_the_type(capsys, override,
                                                                              line):
  assert _parse_error(capsys, TINY, override, experiment_at="") == line


def test_the_example_of_a_tuple_field_is_its_own_value_quoted_for_a_shell(capsys):
  line = _parse_error(capsys, "configs/finetune.py", "--config.data.loss_domains=('code',")
  assert line.endswith("e.g. --config.data.loss_domains='(\"comment\", \"docstring\")'")


@pytest.mark.parametrize("override, use", [
    ("--config.model.d_model=64", "--config.base.model.d_model"),
    ("--config.train.steps=5", "--config.base.train.steps"),
    ("--config.data.name=synthetic_domains", "--config.base.data.name"),  # not parallel.data
    ("--config.balance.aux_loss_coef=0.1", "--config.base.model.moe.balance.aux_loss_coef"),
    ("--config.steps=5", "--config.base.train.steps"),
])
def test_a_suite_override_without_base_points_to_it(capsys, override, use):
  key = override.split("=")[0].split(".")[1]
  assert _parse_error(capsys, QUICK, override, experiment_at="base") == (
      f"error: {override.split('=')[0]}: {key!r} is not a field of the suite; the experiment's "
      f"fields are under 'base': use {use} (it changes every arm)")


def test_a_section_given_at_the_top_of_an_experiment_points_to_its_place(capsys):
  assert _parse_error(capsys, TINY, "--config.balance.aux_loss_coef=0.1", experiment_at="") == (
      "error: --config.balance.aux_loss_coef: 'balance' is not a top-level field; use "
      "--config.model.moe.balance.aux_loss_coef")
  assert _parse_error(capsys, TINY, "--config.seed=1", experiment_at="") == (
      "error: --config.seed: 'seed' is not a top-level field; use --config.data.seed or "
      "--config.train.seed")
  # A misspelt key keeps ml_collections' "did you mean".
  assert _parse_error(capsys, TINY, "--config.train.stepz=3", experiment_at="") == (
      "error: --config.train.stepz: 'stepz' is not a config field; did you mean \"steps\"? "
      "(--print_config lists every field with its default)")


@pytest.mark.parametrize("config, line", [
    ("configs/tinny.py", "error: --config=configs/tinny.py: no such file. Fix: did you mean "
     "configs/tiny.py? the config files in configs/ are deepseek_v3_small.py, default.py, "
     "default_bpe.py, default_mixtral.py, dense.py, finetune.py, tiny.py, upcycle.py (more in "
     "configs/ablations/, configs/presets/)"),
    ("configs/ablations/quik.py", "error: --config=configs/ablations/quik.py: no such file. Fix: "
     "did you mean configs/ablations/quick.py? the config files in configs/ablations/ are "
     "balance_scope.py, balancing.py, capacity.py, deepseekmoe.py, dynamic.py, "
     "expert_choice_leak.py, finetune.py, granularity.py, lossfree.py, moe_vs_dense.py, "
     "quick.py, recipe.py, ..."),
    ("confgs/nope.py", "error: --config=confgs/nope.py: no such file. Fix: the config files in "
     "configs/ are deepseek_v3_small.py, default.py, default_bpe.py, default_mixtral.py, "
     "dense.py, finetune.py, tiny.py, upcycle.py (more in configs/ablations/, configs/presets/)"),
])
def test_a_missing_config_file_lists_the_ones_that_exist(monkeypatch, config, line):
  monkeypatch.chdir(ROOT)
  assert "error: " + _missing_file_error(config) == line


def test_a_missing_config_file_outside_a_checkout_says_what_to_pass(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  assert _missing_file_error("nope.py") == ("--config=nope.py: no such file. Fix: pass the path "
                                            "of an existing config file")


def _missing_file_error(config: str) -> str:
  # What config_flags raises on first access to a --config file that is not there.
  e = FileNotFoundError(2, "No such file or directory")
  return flag_errors.describe_config_error(e, ["binary", f"--config={config}"],
                                           flag_values=flags.FlagValues())


def _run(binary: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", f"experiments.{binary}", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("binary, args, line", [
    ("train", [f"--config={TINY}", "--config.train.steps=abc"],
     "error: --config.train.steps='abc': not an integer. Fix: pass a whole number (the field "
     "is an int), e.g. --config.train.steps=40"),
    ("ablate", [f"--config={QUICK}", "--config.model.d_model=64"],
     "error: --config.model.d_model: 'model' is not a field of the suite; the experiment's "
     "fields are under 'base': use --config.base.model.d_model (it changes every arm)"),
])
def test_the_binaries_print_the_line_and_exit_1(tmp_path, binary, args, line):
  workdir = tmp_path / "run"
  proc = _run(binary, *args, f"--workdir={workdir}")
  assert (proc.returncode, proc.stderr, proc.stdout) == (1, line + "\n", "")
  assert not workdir.exists()
