"""Upcycling a trained dense moejax run: the fine-tune starts from the dense logits, trains, and
its budget charges the dense pre-training; the budget check refuses unequal compute."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from flax import nnx

import moejax
from moejax import data as data_lib
from moejax.ablation import budget as budget_lib
from moejax.config import ConfigError, to_dict
from moejax.finetune import source as source_lib
from moejax.finetune import upcycle as up_lib
from moejax.finetune.start import finetune_start
from moejax.train import loop
from moejax.train import step as step_lib
from moejax.train.config import experiment_from_dict
from moejax.train.optim import make_optimizer
from tests.finetune.conftest import finetune_experiment, source_experiment

_MOE = {"topology": {"num_experts": 4, "expert_width": 32, "activation": "swiglu"},
        "routing": {"kind": "topk", "top_k": 2, "score_fn": "softmax", "gating": "normalized"},
        "execution": {"backend": "reference"}}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, ft_data_dir):
  """(cfg, workdir) of configs/tiny.py's dense twin (F = 64) trained 12 steps."""
  workdir = str(tmp_path_factory.mktemp("up_source") / "dense")
  cfg = source_experiment(ft_data_dir, model__dense_twin="active")
  assert cfg.model.moe is None and cfg.model.dense_ff_width == 64
  loop.train(cfg, workdir, out=io.StringIO())
  return cfg, workdir


def _upcycle_experiment(data_dir, source, **upcycle):
  base = finetune_experiment(data_dir, source, train__steps=2, train__checkpoint_every=2)
  tree = to_dict(base)
  tree["model"] = to_dict(up_lib.upcycled_model(source_lib.source_model(source), {"moe": _MOE}))
  tree["finetune"].update(source_format="upcycle", upcycle={"split": 2, **upcycle})
  return experiment_from_dict(tree)


# Trains (~30 s); the default run checks the first forward (test_upcycle.py), the opening of a
# dense run (below) and the budget check on compute.
@pytest.mark.slow
def test_an_upcycled_run_starts_from_the_dense_logits_trains_and_is_charged_the_source(
    dense_run, ft_data_dir, tmp_path):
  src_cfg, source = dense_run
  cfg = _upcycle_experiment(ft_data_dir, source, router_init="uniform")
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, state = step_lib.init_state(cfg, tx)
  src = source_lib.open_source(cfg)
  assert src.describe() == f"checkpoint 12 of dense source, upcycled: {source}"
  state = src.apply(state, tx)
  tokens = next(data_lib.make_batches(cfg.data, "validation"))["inputs"]
  got, aux = nnx.merge(graphdef, state.params, state.router_state, state.other)(tokens)
  dense_model, _ = moejax.load(source)
  np.testing.assert_allclose(np.asarray(got), np.asarray(dense_model(tokens)[0]), atol=1e-4)
  assert set(aux["moe"]) == {"layer_0", "layer_1"}
  out = io.StringIO()
  loop.train(cfg, str(tmp_path / "up"), out=out, start=finetune_start)
  text = out.getvalue()
  assert "upcycled (split 2, noise 0, drop 0, renormalize True, router uniform)" in text
  assert "compute: source 3.07K tokens" in text   # 12 steps x 8 x 32 tokens
  b = budget_lib.arm_budget(cfg)
  assert b.source_tokens == 12 * 8 * 32 and b.total_tokens == b.tokens + 12 * 8 * 32
  own_src = budget_lib.arm_budget(src_cfg)
  assert b.source_flops == pytest.approx(own_src.train_flops)
  assert b.compute == pytest.approx(b.train_flops + own_src.train_flops)
  assert b.as_dict()["compute"] == b.compute


def test_a_dense_source_whose_width_does_not_split_is_refused(dense_run, ft_data_dir):
  _, source = dense_run
  cfg = _upcycle_experiment(ft_data_dir, source)
  cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(
      cfg.finetune, upcycle=dataclasses.replace(cfg.finetune.upcycle, split=1)))
  with pytest.raises(ConfigError, match="model.moe.topology.expert_width=32: times "
                     "finetune.upcycle.split=1 is not the source's dense width 64"):
    source_lib.open_source(cfg)


def test_the_budget_check_refuses_arms_whose_compute_with_the_source_differs():
  arm = lambda tokens, src: budget_lib.ArmBudget(
      total=10, active=5.0, active_max=5.0, flops_per_token=100.0, tokens=tokens,
      optimizer="adamw", source_tokens=src, source_flops=None if src is None else 300.0 * src)
  even = {"upcycled": arm(100, 200), "scratch": arm(300, None)}
  notes = budget_lib.check(even, {"compute": 0.0, "total_tokens": 0.0})
  assert any(n.startswith("compute: spread 0.00%") for n in notes)
  short = {"upcycled": arm(100, 100), "scratch": arm(300, None)}
  with pytest.raises(budget_lib.BudgetError, match=r"compute: spread 33\.33% \(tolerance "
                     r"2\.00%; min upcycled 60\.00K, max scratch 90\.00K\)"):
    budget_lib.check(short, {"compute": 0.02})
