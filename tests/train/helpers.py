"""Shared helpers of the training tests: config files, tiny runs, workdir snapshots."""

from __future__ import annotations

import hashlib
import importlib.util
import os

from moejax.config import apply_overrides
from moejax.train.config import ExperimentConfig, experiment_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file(name: str):
  """The ConfigDict of configs/<name>.py."""
  path = os.path.join(ROOT, "configs", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def experiment(name: str = "tiny", data_dir: str | None = None, **overrides) -> ExperimentConfig:
  """configs/<name>.py with ``train__steps=10`` style overrides (``__`` for dots)."""
  cfg = experiment_from_dict(config_file(name))
  pairs = {k.replace("__", "."): v for k, v in overrides.items()}
  if data_dir is not None:
    pairs["data.data_dir"] = data_dir
  progress = pairs.pop("train.progress", False)
  pairs["train.progress"] = progress
  return apply_overrides(cfg, pairs)


def initial_run(workdir: str, data_dir: str, name: str = "tiny") -> str:
  """``workdir`` made a run of configs/``name``.py: its config and its initial state saved as
  checkpoint 1. Made by hand rather than trained: tests that load a run need no train step."""
  # pylint: disable=g-import-not-at-top
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import step as step_lib
  from moejax.train.optim import make_optimizer
  cfg = experiment(name, data_dir)
  os.makedirs(workdir)
  ckpt_lib.write_config(workdir, cfg)
  _, state = step_lib.init_state(cfg, make_optimizer(cfg.train, cfg.model, cfg.finetune))
  ckpt = ckpt_lib.Checkpointer(workdir, 1)
  ckpt.save(1, state.checkpoint_tree(), {})
  ckpt.wait()
  ckpt.close()
  return workdir


def snapshot(directory: str) -> dict[str, str]:
  """{relative path: sha256 of the bytes} of every file under ``directory`` (with mtimes)."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(path, directory)] = f"{digest}@{os.stat(path).st_mtime_ns}"
  return out


def rows_by_step(workdir: str, split: str) -> dict[int, dict]:
  """``{step: row}`` of a run's metrics.jsonl ``split`` rows."""
  from moejax.train import metrics_log  # pylint: disable=g-import-not-at-top
  return {r["step"]: r for r in metrics_log.read_metrics(workdir, split)}


def signal_when(proc, ready, signum: int) -> list[str]:
  """Reads ``proc``'s stdout lines until ``ready(line)``, then sends it ``signum``.

  Returns the lines read (the last one is the line that triggered the signal,
  if any did); the caller waits for the process and closes its pipes.
  """
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if ready(line):
      proc.send_signal(signum)
      break
  return seen


def _flip(path: str, offset: int) -> None:
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ 0x01]))


def _restores_finite(workdir: str, step: int, abstract) -> bool:
  """Checkpoint ``step`` restored without its checksums: does it restore, and finite?"""
  # pylint: disable=g-import-not-at-top
  import shutil
  import tempfile
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import guard, integrity
  with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "checkpoints", str(step))
    shutil.copytree(os.path.join(workdir, "checkpoints", str(step)), copy)
    os.remove(os.path.join(copy, integrity.FILE))
    try:
      got = ckpt_lib.restore_latest(tmp, [step], abstract)
    except Exception:  # pylint: disable=broad-except
      return False
    return got is not None and got.step == step and not guard.nonfinite_leaves(got.tree)


def flip_one_byte(workdir: str, step: int, abstract=None) -> str:
  """Flips the lowest bit of one byte near the middle of the largest array data file of
  checkpoint ``step`` (a finite, wrong value only the checksums see); returns the path.

  With ``abstract`` (the state's abstract checkpoint tree), a flip is kept only where the
  checkpoint, restored without its checksums, still restores finite: a flip that lands in
  compressed or index bytes can decode to a NaN, which the NaN guard, not the checksums,
  reports (that made this test flaky); the next candidate byte is tried instead.
  """
  root = os.path.join(workdir, "checkpoints", str(step), "state")
  files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
           if os.sep + "d" + os.sep in os.path.join(d, f)]
  path = max(files, key=os.path.getsize)
  size = os.path.getsize(path)
  for i in range(16):
    offset = (size // 2 + 4099 * i) % size
    _flip(path, offset)
    if abstract is None or _restores_finite(workdir, step, abstract):
      return path
    _flip(path, offset)  # undo: the flip made a non-finite or unreadable value
  raise AssertionError(f"no byte of {path} flips to a finite value in 16 tries")
