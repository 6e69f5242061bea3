"""Experiment configs: the shipped files, validation, typo-proof overrides, the binary's refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from moejax.config import ConfigError
from moejax.model import active_ffn_params
from moejax.train.config import TrainConfig, diff, experiment_from_dict, experiment_to_json
from tests.train import helpers


@pytest.mark.parametrize("name", ["default", "dense", "tiny"])
def test_shipped_configs_build_and_round_trip_through_json(name):
  cfg = experiment_from_dict(helpers.config_file(name))
  import json
  assert experiment_from_dict(json.loads(experiment_to_json(cfg))) == cfg


def test_dense_config_is_the_default_with_the_same_active_ffn_params():
  default = experiment_from_dict(helpers.config_file("default"))
  dense = experiment_from_dict(helpers.config_file("dense"))
  assert dense.model.moe is None and default.model.moe is not None
  assert active_ffn_params(dense.model) == active_ffn_params(default.model)
  assert dense.data == default.data and dense.train == default.train
  assert [c.split(":")[0] for c in diff(default.model.__dict__, dense.model.__dict__)] == [
      "dense_ff_width", "dense_twin", "moe"]
  # ... and it is what --config.model.dense_twin=active gives on the default config.
  twin = experiment_from_dict(dict(helpers.config_file("default").to_dict(),
                                   model=dict(helpers.config_file("default").model.to_dict(),
                                              dense_twin="active")))
  assert twin == dense
  from moejax.topology import accounting
  a, b = accounting.budget(twin.model, 128), accounting.budget(dense.model, 128)
  assert (a.total, a.active, a.flops_per_token) == (b.total, b.active, b.flops_per_token)


@pytest.mark.parametrize("tree, field, hint", [
    ({"train": {"stepz": 3}}, "train.stepz", "did you mean 'steps'"),
    ({"model": {"moe": {"routing": {"top_kk": 2}}}}, "model.moe.routing.top_kk", "top_k"),
    ({"model": {"moe": {"router": {"top_k": 2}}}}, "model.moe.router", "model.moe.routing"),
    ({"train": {"warmup_steps": 10, "steps": 10}}, "train.warmup_steps", "warmup"),
    ({"train": {"learning_rate": 0.0}}, "train.learning_rate", "> 0"),
    ({"train": {"b2": 1.0}}, "train.b2", "[0, 1)"),
    ({"train": {"eval_batches": 0}}, "train.eval_batches", ">= 1"),
    ({"model": {"vocab_size": 512}}, "model.vocab_size", "vocab_size=256"),
    ({"model": {"attention": "mqa"}}, "model.attention", "no attention kind of that name"),
    ({"train": {"learning_rate": float("inf")}}, "train.learning_rate", "finite"),
    ({"train": {"weight_decay": float("nan")}}, "train.weight_decay", "finite"),
    ({"train": {"microbatches": 3}}, "train.microbatches", "does not divide"),
    ({"data": {"seq_len": 0}}, "data.seq_len", "positive"),
])
def test_bad_values_name_field_value_and_fix(tree, field, hint):
  with pytest.raises(ConfigError) as err:
    experiment_from_dict(tree)
  assert err.value.field == field and hint in str(err.value)


def test_train_config_defaults_are_valid():
  TrainConfig()
  with pytest.raises(ConfigError, match="train.steps"):
    TrainConfig(steps=0)


def _parse(*overrides):
  argv = ["prog", f"--config={os.path.join(helpers.ROOT, 'configs', 'tiny.py')}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


def test_command_line_overrides_reach_every_field_and_typos_fail():
  cfg = experiment_from_dict(_parse("--config.train.steps=7", "--config.data.data_dir=/x",
                                    "--config.model.moe.routing.top_k=1",
                                    "--config.train.eval_batches=3"))
  assert cfg.train.steps == 7 and cfg.data.data_dir == "/x"
  assert cfg.model.moe.routing.top_k == 1 and cfg.train.eval_batches == 3
  with pytest.raises(Exception, match="stepz"):
    _parse("--config.train.stepz=7")
  with pytest.raises(Exception, match="num_expertz"):
    _parse("--config.model.moe.topology.num_expertz=7")


def test_binary_refuses_a_bad_config_before_creating_the_workdir(tmp_path):
  workdir = str(tmp_path / "run")
  base = [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}"]
  bad_value = subprocess.run(base + ["--config.train.warmup_steps=400"], cwd=helpers.ROOT,
                             capture_output=True, text=True, timeout=300)
  assert bad_value.returncode == 1
  assert "train.warmup_steps=400" in bad_value.stderr and "Fix:" in bad_value.stderr
  typo = subprocess.run(base + ["--config.train.stepz=3"], cwd=helpers.ROOT,
                        capture_output=True, text=True, timeout=300)
  assert typo.returncode != 0 and "stepz" in typo.stderr
  assert not os.path.exists(workdir)
