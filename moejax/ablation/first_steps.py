"""What a suite run records for the re-check of its block: its first steps and environment.

Legend: N probed steps of a run.

A suite run reads back the first N training steps of the first seed of every
arm (and of the suite's source) one by one (:class:`moejax.train.context.Probe`)
and writes them beside the run (``first_steps.json``): per step the
full-precision values of a fixed set of keys (:func:`recorded_keys`: loss,
MaxVio, the per-layer loads; keys added later do not count), the environment
that computed them, the machine kind included (:func:`environment`: CPU model
and the instruction-set features XLA's CPU code generator targets, XLA flags,
JAX and jaxlib versions, devices), and the hashes of the code those steps
cannot reach (:data:`UNREACHED`). The results tool (moejax.results.recheck)
keeps them as a block's record and re-trains them to judge it.
"""

from __future__ import annotations

import hashlib
import os
import platform
from typing import Mapping, Sequence

from moejax.ablation import freshness as files_lib

FIRST_STEPS_FILE = "first_steps.json"
# Enough steps for the bias controller and Adam's moments to act on the routing;
# few enough that re-checking every block fits a slow test.
STEPS = 8
_KEYS = ("loss", "max_vio_batch")
_LOAD_PREFIX = "load/"
# Code that the first steps do not run: a change here is judged by the file rule.
# Run time: its results are in each result.json.
RUN_UNREACHED = ("moejax/evaluate/", "moejax/ablation/final_eval.py",
                 "moejax/ablation/analysis.py", "moejax/ablation/budget.py",
                 "moejax/ablation/merge.py")
# Summary time: the statistics, recomputed when `experiments.report ID=DIR` summarises.
SUMMARY_CODE = ("moejax/ablation/stats.py", "moejax/ablation/summary.py",
                "moejax/ablation/speedup.py", "moejax/ablation/columns.py",
                "moejax/ablation/power.py")
UNREACHED = RUN_UNREACHED + SUMMARY_CODE
FINETUNE_CODE = ("moejax/finetune/",)
# The x86 features that select XLA:CPU's vector code (lower targets: fewer of them).
_ISA = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
        "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
        "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def recorded_keys(row: Mapping[str, float]) -> dict[str, float]:
  """The keys a record keeps of a step's row: loss, MaxVio and the per-layer loads."""
  return {k: v for k, v in row.items()
          if k in _KEYS or k.startswith("max_vio_batch/") or k.startswith(_LOAD_PREFIX)}


def _cpu() -> tuple[str, list[str]]:
  model, feats = platform.processor() or platform.machine(), set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, val = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and model in ("", platform.machine(),
                                                                  platform.processor()):
          model = val.strip()
        elif key in ("flags", "Features"):
          feats |= set(val.split())
  except OSError:
    pass
  return model, sorted(f for f in feats if f in _ISA)


def environment() -> dict:
  """What made a record's numbers; ``kind`` is what must match for a bit-for-bit verdict."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  model, isa = _cpu()
  dev = jax.devices()[0]
  kind = {"platform": dev.platform, "device_kind": dev.device_kind,
          "devices": jax.device_count(), "cpu": model, "isa": isa,
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__}
  return {"kind": kind, "python": platform.python_version(), "cpus": os.cpu_count()}
_REPO = files_lib._ROOT  # pylint: disable=protected-access


def file_hashes(scope: Sequence[str], root: str = _REPO) -> dict[str, str]:
  """``{path: sha256}`` of the Python sources under ``scope`` that can move a number."""
  out = {}
  for path in files_lib._walk(root):  # pylint: disable=protected-access
    full = os.path.join(root, path)
    if any(path.startswith(s) for s in scope) and files_lib.in_scope(path) and os.path.isfile(full):
      with open(full, "rb") as f:
        out[path] = hashlib.sha256(f.read()).hexdigest()
  return out


def first_steps_payload(rows: Sequence[Mapping[str, float]]) -> dict:
  """What a run writes beside itself once its first steps are read back (with the
  environment that computed them)."""
  return {"steps": len(rows), "rows": [recorded_keys(r) for r in rows],
          "environment": environment(), "unreached_files": file_hashes(UNREACHED + FINETUNE_CODE)}


def first_steps_probe(path: str):
  """The probe of a suite run whose first steps its record keeps: they are written beside
  the run (``first_steps.json``) as soon as they are in, so a run killed later keeps them."""
  from moejax.train import processes  # pylint: disable=g-import-not-at-top
  from moejax.train.context import Probe  # pylint: disable=g-import-not-at-top

  def write(rows):
    if processes.is_lead():
      write_record(first_steps_payload(rows), os.path.join(path, FIRST_STEPS_FILE))
  return Probe(STEPS, on_full=write)


def write_record(record: Mapping, path: str) -> str:
  from moejax.ablation.summary import write_json  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return write_json(record, path)
