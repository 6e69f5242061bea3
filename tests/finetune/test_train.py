"""Fine-tuning runs: frozen parts bit-exact, the bias controller frozen or on, the start equals
the source, resume mid-fine-tune, refusals before any write."""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest
from flax import nnx

import moejax
from moejax import data as data_lib
from moejax.config import ConfigError
from moejax.finetune import source as source_lib
from moejax.finetune.start import finetune_start
from moejax.nn import lora as lora_lib
from moejax.train import loop, metrics_log
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.finetune.conftest import finetune_experiment


def _state(workdir):
  model, cfg = moejax.load(workdir)
  _, params, router_state, _ = nnx.split(model, nnx.Param, nnx.Variable, ...)
  return nnx.to_pure_dict(params), nnx.to_pure_dict(router_state), cfg


def _leaves(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, prefix + (str(k),))
  else:
    yield prefix, np.asarray(tree)


def test_frozen_router_experts_and_adapted_base_stay_bit_exact(source_run, ft_run):
  _, source = source_run
  cfg, workdir, out = ft_run
  src_params, src_router, _ = _state(source)
  params, router, _ = _state(workdir)
  base, adapters = lora_lib.split_tree(params)
  src = dict(_leaves(src_params))
  changed = set()
  for path, value in _leaves(base):
    frozen = ("router" in path or "experts" in path or "attn" in path)
    if frozen:
      np.testing.assert_array_equal(value, src[path], err_msg="/".join(path))
    elif not np.array_equal(value, src[path]):
      changed.add(path[0])
  assert {"embed", "lm_head", "blocks"} <= changed  # what is not frozen trained
  for path, value in _leaves(router):   # the bias and its step counter: untouched
    np.testing.assert_array_equal(value, dict(_leaves(src_router))[path])
  # Adapters trained (B starts at 0): on attention (nnx.LoRALinear) and on the experts.
  assert any(np.any(v) for p, v in _leaves(adapters) if p[-1] == "lora_b")
  assert any(np.any(v) for p, v in _leaves(adapters) if p[-1] == "b" and "experts" in p)
  assert "accounting before training" in out and "initialised from checkpoint 12" in out
  assert "LoRA rank 4 (x1) on attention, experts" in out
  assert ("; the loss covers only the comment, docstring targets (data.loss_domains; the "
          "code, string tokens are context, not scored)\n") in out


@pytest.mark.slow  # the default run checks the start through the bit-exact frozen parts
def test_the_fine_tune_starts_from_the_source_logits(source_run, ft_data_dir):
  _, source = source_run
  cfg = finetune_experiment(ft_data_dir, source, finetune__lora=("attention", "experts"),
                            finetune__lora_rank=2, finetune__freeze=("all",))
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, state = step_lib.init_state(cfg, tx)
  state = source_lib.open_source(cfg).apply(state, tx)
  tokens = next(data_lib.make_batches(cfg.data, "validation"))["inputs"]
  got, _ = nnx.merge(graphdef, state.params, state.router_state, state.other)(tokens)
  src_model, _ = moejax.load(source)
  want, _ = src_model(tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow  # the default run checks the resolution (test_config.py); this trains
@pytest.mark.parametrize("controller, bias_moves", [("frozen", False), ("on", True)])
def test_bias_controller_frozen_or_on_while_the_router_trains(source_run, ft_data_dir,
                                                               controller, bias_moves):
  _, source = source_run
  cfg = finetune_experiment(ft_data_dir, source, finetune__controller=controller)
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, state = step_lib.init_state(cfg, tx)
  start = source_lib.open_source(cfg).apply(state, tx)
  step = step_lib.make_train_step(graphdef, cfg, tx)
  it = data_lib.make_batches(cfg.data, cfg.data.train_split)
  state = start
  for _ in range(2):
    state, _ = step(state, next(it))
  bias0 = start.router_state["blocks"][0]["ffn"]["router_state"]["bias"]
  bias2 = state.router_state["blocks"][0]["ffn"]["router_state"]["bias"]
  assert np.array_equal(bias0, bias2) != bias_moves
  w0 = start.params["blocks"][0]["ffn"]["params"]["router"]["w"]
  assert not np.array_equal(w0, state.params["blocks"][0]["ffn"]["params"]["router"]["w"])


def test_resume_mid_fine_tune_repeats_the_same_steps_without_the_source(ft_run, tmp_path,
                                                                        monkeypatch):
  cfg, workdir, _ = ft_run
  copy = str(tmp_path / "resumed")
  shutil.copytree(workdir, copy)
  shutil.rmtree(os.path.join(copy, "checkpoints", "6"))
  # A resumed run restores its own checkpoint: the source is never read again.
  monkeypatch.setattr(source_lib, "open_source",
                      lambda cfg: pytest.fail("a resumed fine-tune opened its source"))
  out = io.StringIO()
  loop.train(cfg, copy, out=out, start=finetune_start)
  assert "resumed from checkpoint at step 3" in out.getvalue()
  want = {r["step"]: r for r in metrics_log.read_metrics(workdir, "train")}
  got = {r["step"]: r for r in metrics_log.read_metrics(copy, "train")}
  assert sorted(got) == sorted(want) == [3, 6]
  for key in ("loss", "ce", "grad_norm"):
    assert got[6][key] == want[6][key], key
  a, _, _ = _state(workdir)
  b, _, _ = _state(copy)
  for (path, x), (_, y) in zip(_leaves(a), _leaves(b)):
    np.testing.assert_array_equal(x, y, err_msg="/".join(path))


def test_a_source_of_another_model_shape_is_refused_before_any_write(source_run, ft_data_dir,
                                                                     tmp_path):
  _, source = source_run
  cfg = finetune_experiment(ft_data_dir, source, model__d_model=64)
  workdir = str(tmp_path / "never")
  with pytest.raises(ConfigError, match=r"^finetune\.source='.*': its model has other parameter "
                                        r"shapes than this run's \(params .*: source \(.*\), "
                                        r"here \(.*\); model\.d_model: source 32, here 64\)") as e:
    loop.train(cfg, workdir, out=io.StringIO(), start=finetune_start)
  assert "\n" not in str(e.value)
  assert not os.path.exists(workdir)


@pytest.mark.parametrize("make, match", [
    (lambda tmp: str(tmp / "absent"), "does not exist"),
    (lambda tmp: str(tmp), "is not a moejax run directory"),
])
def test_a_source_that_is_not_a_run_is_refused(ft_data_dir, tmp_path, make, match):
  cfg = finetune_experiment(ft_data_dir, make(tmp_path))
  with pytest.raises(ConfigError, match=match):
    loop.train(cfg, str(tmp_path / "ft"), out=io.StringIO(), start=finetune_start)
  assert not os.path.exists(tmp_path / "ft")


def test_source_step_must_be_a_kept_checkpoint(source_run, ft_data_dir):
  _, source = source_run
  cfg = finetune_experiment(ft_data_dir, source, finetune__source_step=5)
  with pytest.raises(ConfigError, match=r"finetune\.source_step=5: .* no checkpoint there\. "
                                        r"Fix: pick one of \[12\]"):
    source_lib.open_source(cfg)


def test_the_trainer_refuses_a_fine_tune_without_its_start_hook(source_run, ft_data_dir,
                                                                tmp_path):
  """moejax.train imports nothing of moejax.finetune: a fine-tuning config given to the trainer
  without the hook that loads its source is refused, not trained from scratch."""
  _, source = source_run
  cfg = finetune_experiment(ft_data_dir, source)
  workdir = str(tmp_path / "never")
  with pytest.raises(ConfigError, match=r"^finetune\.source='.*': names a run to fine-tune, but "
                                        r"the trainer was given no start hook"):
    loop.train(cfg, workdir, out=io.StringIO())
  assert not os.path.exists(workdir)
