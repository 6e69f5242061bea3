"""Seeds trained as separate processes, imported into one suite (moejax.ablation.merge).

The runs are hand-made: a ``result.json`` with the run's experiment is what
makes a run finished (moejax.ablation.runner.is_finished), so nothing trains.
"""

from __future__ import annotations

import io
import os

import pytest

from moejax.ablation import merge, runner, suite as suite_lib
from moejax.train import lock as lock_lib
from moejax.train.checkpoint import WorkdirError
from tests.ablation import helpers


def _suite(**changes):
  return suite_lib.suite_from_dict(helpers.tiny_suite(**changes))


def _finished(path, arm, seed, marker="ckpt"):
  """A finished run of ``arm`` at ``seed`` in ``path``, with one more file to see it copied."""
  helpers.write_finished_run(path, arm.experiment, seed, **{"metrics.jsonl": marker})


def test_one_seed_directories_become_the_suite_layout(tmp_path):
  suite = _suite()
  aux, bias = suite.arms
  src0, src1, dst = str(tmp_path / "s0"), str(tmp_path / "s1"), str(tmp_path / "suite")
  _finished(os.path.join(src0, "aux"), aux, 0, "aux0")    # one-seed layout: DIR/<arm>
  _finished(os.path.join(src0, "bias"), bias, 0, "bias0")
  _finished(os.path.join(src1, "aux", "seed_1"), aux, 1, "aux1")  # many-seed layout
  _finished(os.path.join(src1, "bias"), bias, 0, "wrong")  # seed 0's run in the seed-1 dir
  said = []
  assert merge.import_runs(suite, dst, [src0, src1], say=said.append) == 3
  assert said == [f"imported aux/seed_0 from {os.path.join(src0, 'aux')}",
                  f"imported aux/seed_1 from {os.path.join(src1, 'aux', 'seed_1')}",
                  f"imported bias/seed_0 from {os.path.join(src0, 'bias')}"]
  with open(os.path.join(dst, "aux", "seed_1", "metrics.jsonl"), encoding="utf-8") as f:
    assert f.read() == "aux1"
  assert os.path.exists(os.path.join(src0, "aux", "result.json"))  # copied, not moved
  plan = dict(runner.plan_suite(suite, dst))
  assert plan == {"aux/seed_0": "finished", "aux/seed_1": "finished",
                  "bias/seed_0": "finished", "bias/seed_1": "new"}
  # Imported runs are finished: a second import has nothing to do.
  assert merge.import_runs(suite, dst, [src0, src1], say=said.append) == 0


def test_a_run_with_files_in_the_target_is_not_overwritten(tmp_path):
  suite = _suite()
  aux = suite.arms[0]
  src, dst = str(tmp_path / "s0"), str(tmp_path / "suite")
  _finished(os.path.join(src, "aux"), aux, 0)
  os.makedirs(os.path.join(dst, "aux", "seed_0"))
  partial = os.path.join(dst, "aux", "seed_0", "config.json")
  with open(partial, "w", encoding="utf-8") as f:
    f.write("{}")
  with pytest.raises(WorkdirError, match=r"run aux/seed_0 of suite tiny already has files"):
    merge.import_runs(suite, dst, [src])
  assert os.listdir(os.path.join(dst, "aux", "seed_0")) == ["config.json"]


def test_bad_sources_are_refused_before_anything_is_copied(tmp_path):
  suite = _suite()
  src, dst = str(tmp_path / "s0"), str(tmp_path / "suite")
  _finished(os.path.join(src, "aux"), suite.arms[0], 0)
  with pytest.raises(WorkdirError, match="is not a directory"):
    merge.import_runs(suite, dst, [src, str(tmp_path / "missing")])
  with pytest.raises(WorkdirError, match="is the --workdir itself"):
    merge.import_runs(suite, src, [src])
  with lock_lib.WorkdirLock(src, lambda _: None):
    with pytest.raises(lock_lib.WorkdirLockedError):
      merge.import_runs(suite, dst, [src])
  assert not os.path.exists(dst)


def test_suites_with_source_runs_are_refused(tmp_path):
  ft = dict(finetune=dict(source=suite_lib.SUITE_SOURCE))
  suite = _suite(source=helpers.tiny_base(4), arms={"ft_a": ft, "ft_b": ft})
  with pytest.raises(WorkdirError, match="fine-tunes from source runs"):
    merge.plan_imports(suite, str(tmp_path / "suite"), [str(tmp_path)])


def test_run_suite_imports_after_the_budget_check_and_before_planning(tmp_path):
  suite = _suite()
  src, dst = str(tmp_path / "s0"), str(tmp_path / "suite")
  _finished(os.path.join(src, "aux"), suite.arms[0], 0)
  out, seen = io.StringIO(), []

  class Stop(Exception):
    pass

  def before_plan():
    seen.append(("budget printed", "budget (* = held fixed)" in out.getvalue()))
    seen.append(("imported", merge.import_runs(suite, dst, [src], say=lambda _: None)))
    raise Stop  # the import is what this test is about; nothing trains

  with pytest.raises(Stop):
    runner.run_suite(suite, dst, out=out, before_plan=before_plan)
  assert seen == [("budget printed", True), ("imported", 1)]
  assert os.listdir(dst) == ["aux"] and os.listdir(os.path.join(dst, "aux")) == ["seed_0"]
