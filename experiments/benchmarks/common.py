"""Flags that several suites read (each suite's own flags live in its module)."""

from __future__ import annotations

import os

from absl import flags

from experiments import common_flags

REPEATS = common_flags.repeats()
DEFAULT_REPEATS = 5


def repeats() -> int:
  """--repeats, or the benchmarks' default of 5."""
  return REPEATS.value if REPEATS.value is not None else DEFAULT_REPEATS



SLOW_S = flags.DEFINE_float("slow_s", 20.0, "a first run slower than this is 'slow' "
                            "(--suite=scaling: its first timed run, 6 s unless given)")
SLOW_REPEATS = flags.DEFINE_integer("slow_repeats", 1, "timed runs for slow variants "
                                    "(--suite=scaling: 2 unless given)")
SEED = common_flags.seed()
TORCH_THREADS = flags.DEFINE_integer("torch_threads", os.cpu_count(),
                                     "torch.set_num_threads for the torch variants")
FAIL_VARIANTS = flags.DEFINE_list("fail_variants", [], "test hook: these variants (layer or "
                                  "gmm names) raise instead of running, to check the failure "
                                  "path")


def forced_failures(fns: dict) -> dict:
  """``fns`` with the --fail_variants ones (by variant name) raising instead."""
  def fail(name):
    def fn():
      raise RuntimeError(f"{name} forced to fail by --fail_variants")
    return fn
  return {n: fail(n) if n.split("/")[0] in FAIL_VARIANTS.value else fn
          for n, fn in fns.items()}
