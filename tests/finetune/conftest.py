"""Fixtures of the fine-tuning tests: a prepared tiny corpus, a tiny source run, one fine-tune."""

from __future__ import annotations

import io

import pytest

from moejax.finetune.start import finetune_start
from moejax.train import loop
from tests import shared_dirs
from tests.train import helpers


@pytest.fixture(scope="session")
def ft_data_dir(request):
  """One corpus directory for the whole run (every xdist worker; datasets prepare under
  their own file lock)."""
  return str(shared_dirs.build_once(request, "tfds_ft", lambda path: None))


def source_experiment(data_dir, **overrides):
  """configs/tiny.py, 12 steps, one checkpoint at the end: the pre-training run."""
  kw = dict(train__steps=12, train__checkpoint_every=12, train__eval_every=0,
            train__log_every=4, train__warmup_steps=2)
  kw.update(overrides)
  return helpers.experiment("tiny", data_dir, **kw)


def finetune_experiment(data_dir, source, **overrides):
  """A 6-step fine-tune of ``source`` with checkpoints at 3 and 6."""
  kw = dict(train__steps=6, train__checkpoint_every=3, train__keep_checkpoints=3,
            train__eval_every=0, train__log_every=3, train__warmup_steps=1,
            finetune__source=source)
  kw.update(overrides)
  return helpers.experiment("tiny", data_dir, **kw)


@pytest.fixture(scope="session")
def source_run(request, ft_data_dir):
  """(cfg, workdir) of a finished 12-step tiny run (pre-training on code and strings), built
  once per test run (every xdist worker reads the same one); read only."""
  cfg = source_experiment(ft_data_dir, data__loss_domains=("code", "string"))
  path = shared_dirs.build_once(
      request, "ft_source", lambda path: loop.train(cfg, str(path / "source"), out=io.StringIO()))
  return cfg, str(path / "source")


@pytest.fixture(scope="session")
def ft_run(tmp_path_factory, ft_data_dir, source_run):
  """(cfg, workdir, output) of a 6-step fine-tune of the source on comments and docstrings:
  router and experts frozen, LoRA rank 4 on attention and on the experts."""
  _, source = source_run
  workdir = str(tmp_path_factory.mktemp("ft_run") / "ft")
  cfg = finetune_experiment(ft_data_dir, source, data__loss_domains=("comment", "docstring"),
                            finetune__freeze=("router", "experts"),
                            finetune__lora=("attention", "experts"),
                            finetune__lora_rank=4)
  out = io.StringIO()
  loop.train(cfg, workdir, out=out, start=finetune_start)
  return cfg, workdir, out.getvalue()
