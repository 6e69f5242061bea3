"""Perturbations that need more devices than this process has, measured in a child process.

Legend: N rows, S tokens per row.

JAX fixes its device count when it starts, so a process with one CPU device
(a suite's trainer) cannot build the 2- or 8-device meshes of the
expert-parallel perturbations (``ep2``, ``ep8``). On CPU the devices can be
simulated (``JAX_NUM_CPU_DEVICES``) in a fresh process: :func:`measure`
starts ``python -m moejax.serve.consistency_child`` with enough of them,
which restores the same run's checkpoint, measures the named perturbations
on the same tokens with :func:`moejax.serve.routing_consistency.measure` and
hands the rows back as JSON. The child's reference forward is its own, on
its first device, so each row compares two forwards of one process, as in
the parent.

A child that fails turns into ``n/a`` rows that say why (its last line of
stderr), so one perturbation that cannot run costs the measurement nothing
else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

CHILD_TIMEOUT_S = 1800  # a suite arm's whole measurement; its compiles dominate


def needs_child(names: Sequence[str], visible: int, backend: str) -> tuple[str, ...]:
  """The perturbations of ``names`` that need more than ``visible`` devices, where a child
  can simulate them (``backend == 'cpu'``); elsewhere they stay ``n/a`` in this process."""
  from moejax.serve.perturbation import PERTURBATIONS  # pylint: disable=g-import-not-at-top
  if backend != "cpu":
    return ()
  return tuple(n for n in names if PERTURBATIONS[n].devices > visible)


def measure(run_path: str, step: int, tokens, names: Sequence[str]) -> dict:
  """``{name: row}`` of :func:`moejax.serve.routing_consistency.measure` for ``names`` on
  ``tokens`` int[N, S], measured on the checkpoint ``step`` of the run ``run_path`` in a
  child with as many simulated CPU devices as the most demanding of ``names`` needs."""
  from moejax.serve.perturbation import PERTURBATIONS  # pylint: disable=g-import-not-at-top
  devices = max(PERTURBATIONS[n].devices for n in names)
  with tempfile.TemporaryDirectory(prefix="moejax_consistency_") as tmp:
    tokens_path, out_path = os.path.join(tmp, "tokens.npy"), os.path.join(tmp, "rows.json")
    np.save(tokens_path, np.asarray(tokens, np.int32))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    cmd = [sys.executable, "-m", "moejax.serve.consistency_child", run_path, str(step),
           tokens_path, out_path, ",".join(names)]
    try:
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      return _failed(names, f"its child process on {devices} simulated devices ran past "
                     f"{CHILD_TIMEOUT_S} s")
    if proc.returncode != 0 or not os.path.exists(out_path):
      lines = (proc.stderr or "").strip().splitlines() or [f"exit status {proc.returncode}"]
      return _failed(names, f"its child process on {devices} simulated devices failed: "
                     f"{lines[-1]}")
    with open(out_path, encoding="utf-8") as fh:
      return json.load(fh)


def columns(run_path: str, step: int, tokens, names: Sequence[str]) -> dict:
  """:func:`measure` as a suite's columns: ``flip_rate_<name>`` / ``token_flip_share_<name>``
  of those that ran, ``consistency_na`` ({name: why}) of the others."""
  from moejax.serve import consistency_report  # pylint: disable=g-import-not-at-top
  rows = measure(run_path, step, tokens, names)
  report = consistency_report.ConsistencyReport(tokens=int(np.asarray(tokens).size),
                                                perturbations=rows, margins={})
  out = consistency_report.columns(report)
  out["consistency_na"] = {n: r["n/a"] for n, r in rows.items() if "n/a" in r}
  return out


def _failed(names: Sequence[str], why: str) -> dict:
  return {n: {"n/a": why} for n in names}


def main(argv: Sequence[str]) -> int:
  """``RUN STEP TOKENS.npy OUT.json NAME[,NAME...]``: the child's side of :func:`measure`."""
  if len(argv) != 6:
    print("usage: python -m moejax.serve.consistency_child RUN STEP TOKENS.npy OUT.json NAMES",
          file=sys.stderr)
    return 2
  run_path, step, tokens_path, out_path, names = argv[1:]
  # pylint: disable=g-import-not-at-top
  from moejax.serve import routing_consistency as rc
  from moejax.serve.generate import load_run
  _, model, _ = load_run(run_path, int(step))
  rows = rc.measure(model, np.load(tokens_path), tuple(names.split(",")))
  with open(out_path, "w", encoding="utf-8") as fh:
    json.dump(rows, fh)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
