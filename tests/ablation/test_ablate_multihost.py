"""``experiments.ablate`` on several processes: the same suite, one set of files.

* slow (the real binary, launched as ``tests/train/launch.py`` launches the
  trainer: 8.5 min on 2 shared cores with a cold compilation cache): a tiny
  2-arm suite (8 experts, ``parallel.expert=8``: the all_to_all crosses the
  processes) run by 2 processes x 4 CPU devices gives the summary and run
  results of the 1-process run on 8 devices (losses within rtol 1e-6), and
  exactly its files (no second copy, no file of process 1, the lock
  released); the same command again finds every run finished on both
  processes; a config that would relabel the results is refused with the
  same ``error:`` line by both processes (process 0's decision, sent).
* default run: the rule that only process 0 writes, in-process: the runner
  with ``jax.process_index`` patched to 1 evaluates and analyses the runs a
  stand-in trainer provides, returns their results (the same numbers as
  process 0's), and writes nothing at all.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from moejax.ablation import runner, suite as suite_lib
from moejax.ablation import summary as summary_lib
from moejax.train import processes
from tests.ablation import helpers
from tests.train import helpers as train_helpers
from tests.train import launch

# What a runner writes itself (the trainer's files are the train_fn's here).
RUNNER_FILES = {"suite.json", "budget.json", "summary.json", "summary.md", "summary.csv",
                "run.lock", runner.RESULT_FILE, runner.ROUTING_FILE, "per_doc_loss.npz"}


def test_a_process_other_than_0_writes_nothing(tiny_suite_dir, tmp_path, monkeypatch):
  done, _, want = tiny_suite_dir
  tree = helpers.tiny_suite(analysis=dict(routing_batches=1, comm_devices=4, causal_probe=True,
                                          latency=False))
  suite = suite_lib.suite_from_dict(tree)
  trained = lambda rel: {n for n in os.listdir(os.path.join(done, rel))
                         if n not in RUNNER_FILES}

  def train_fn(exp, path, out):  # what the trainer left on disk for every process
    del exp, out
    rel = os.path.relpath(path, workdir)
    shutil.copytree(os.path.join(done, rel), path,
                    ignore=lambda d, names: [n for n in names if n in RUNNER_FILES])
    return want[rel]["train_summary"]

  workdir = str(tmp_path / "suite")
  os.makedirs(workdir)
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  assert not processes.is_lead()
  got = runner.run_suite(suite, workdir, train_fn=train_fn, out=open(os.devnull, "w"))
  runs = [rel for _, _, rel in suite.runs()]
  assert sorted(os.listdir(workdir)) == sorted({r.split(os.sep)[0] for r in runs})
  for rel in runs:  # the stand-in trainer's files, and nothing of the runner's
    assert set(os.listdir(os.path.join(workdir, rel))) == trained(rel)
    # Process 1 evaluated the same checkpoints to the numbers process 0 wrote.
    assert got[rel]["val_loss"] == want[rel]["val_loss"]
    assert got[rel]["layers"] == want[rel]["layers"]


STEPS = 4
# 8 experts on parallel.expert=8: the expert axis spans both processes of the 2-process launch.
BASE = {"train": dict(steps=STEPS, warmup_steps=1, log_every=1, eval_every=2, eval_batches=1,
                      checkpoint_every=2),
        "model": dict(moe=dict(topology=dict(num_experts=8, expert_width=16))),
        "parallel": dict(expert=8, data=1)}
RESULT_KEYS = ("val_loss", "train_loss", "max_vio_global", "specialisation_mi",
               "probe_teacher_forced_loss", "probe_prefix_loss")


def _suite_config(path: str, data_dir: str) -> str:
  """A suite file for ``--config``: the tiny suite, one seed, 8 experts, no latency timing."""
  tree = helpers.tiny_suite(steps=STEPS, seeds=[0],
                            analysis=dict(routing_batches=1, comm_devices=4, causal_probe=True,
                                          latency=False))
  for section, values in BASE.items():
    for key, value in values.items():
      node = tree["base"].setdefault(section, {})
      if isinstance(value, dict):
        _merge(node.setdefault(key, {}), value)
      else:
        node[key] = value
  tree["base"]["data"]["data_dir"] = data_dir
  with open(path, "w", encoding="utf-8") as f:
    f.write("import json\nfrom moejax.ablation.bases import suite_config\n\n"
            f"TREE = json.loads({json.dumps(json.dumps(tree))})\n\n\n"
            "def get_config():\n  return suite_config(**TREE)\n")
  return path


def _merge(node: dict, values: dict) -> None:
  for key, value in values.items():
    if isinstance(value, dict):
      _merge(node.setdefault(key, {}), value)
    else:
      node[key] = value


def _ablate(config: str, workdir: str, *flags: str) -> list[str]:
  return [sys.executable, "-m", "experiments.ablate", f"--config={config}",
          f"--workdir={workdir}", *flags]


def _files(workdir: str) -> set[str]:
  """Every file of a suite directory, aside from the compile cache, the TensorBoard event
  names and orbax's array files (``checkpoints/<step>/state``: each process writes its shards)."""
  out = set()
  for d, dirs, names in os.walk(workdir):
    rel = os.path.relpath(d, workdir)
    dirs[:] = [x for x in dirs if x != "compile_cache"
               and not (x == "state" and os.path.basename(os.path.dirname(d)) == "checkpoints")]
    out.update(os.path.join(rel, n) for n in names
               if not n.startswith("events.out.tfevents"))  # names carry host, pid, time
  return out


@pytest.mark.slow  # 8.5 min (cold cache, 2 shared cores); default run: the test above
def test_two_processes_of_ablate_equal_one_process(tmp_path, compilation_cache):
  data_dir = str(tmp_path / "tfds")
  config = _suite_config(str(tmp_path / "suite.py"), data_dir)
  one, two = str(tmp_path / "one"), str(tmp_path / "two")

  def run(name, workdir, processes, devices, *flags, status=0):
    logs = str(tmp_path / name)
    outs = launch.run(data_dir, workdir, {}, processes=processes, devices=devices,
                      env_extra=compilation_cache, log_dir=logs,
                      command=_ablate(config, workdir, *flags), status=status, timeout=900)
    errs = [launch.Launched([], [], [os.path.join(logs, f"process{i}.err")]).text(0, "err")
            for i in range(processes)]
    return outs, errs

  run("one_process", one, 1, 8)  # first: it prepares the dataset the two processes read
  outs, _ = run("two_processes", two, 2, 4)
  for i, out in enumerate(outs):
    assert f"process {i} of 2 (flags): 4 local of 8 devices (cpu)" in out, out[-3000:]
    assert "[2/2] bias: done in" in out, out[-3000:]
  # One set of files: exactly the 1-process run's (names; the contents are compared below).
  assert _files(two) == _files(one)
  assert not os.path.exists(os.path.join(two, "run.lock"))
  for rel in ("aux", "bias"):
    got, want = (_json(os.path.join(d, rel, runner.RESULT_FILE)) for d in (two, one))
    for key in RESULT_KEYS:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"{rel} {key}")
  got, want = (summary_lib.suite_summary(d) for d in (two, one))
  assert set(got["arms"]) == set(want["arms"]) == {"aux", "bias"}
  for arm in want["arms"]:
    for metric in ("val_loss", "train_loss"):
      np.testing.assert_allclose(got["arms"][arm]["metrics"][metric]["interval"]["mean"],
                                 want["arms"][arm]["metrics"][metric]["interval"]["mean"],
                                 rtol=1e-6, err_msg=f"{arm} {metric}")
  runs = lambda: {k: v for k, v in train_helpers.snapshot(two).items()
                  if k.startswith(("aux", "bias"))}
  before = runs()
  # Again: every run finished, on both processes (process 0's plan), nothing retrained.
  outs, _ = run("again", two, 2, 4)
  for out in outs:
    assert "[1/2] aux: finished earlier, not retrained" in out, out[-3000:]
    assert "[2/2] bias: finished earlier, not retrained" in out, out[-3000:]
  assert runs() == before
  # A config that would relabel the results: refused by process 0, the same line on both.
  _, errs = run("refused", two, 2, 4, "--config.base.train.steps=6", status=1)
  lines = [[x for x in e.splitlines() if x.startswith("error: ")] for e in errs]
  assert len(lines[0]) == 1 and lines[0] == lines[1], errs
  assert lines[0][0].startswith("error: WorkdirError: run aux of suite tiny: ") and \
      "train.steps" in lines[0][0], lines[0][0]
  assert runs() == before


def _json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)
