"""The XLA:CPU flags the test run compiles with, set by tests/conftest.py before JAX starts.

**LLVM at its lowest optimisation level.** The suite's programs are tiny and
run for milliseconds, but compiling one at the default level costs seconds
(the tiny config's train step: 7.0 CPU-s at the default level, 3.8 at level
0), and the suite compiles hundreds. The level changes instruction selection,
not the program: the golden-value and agreement tests hold at both.

**The loop emitters in place of the MLIR fusion emitters,** for the same
reason: they compile faster (tests/test_layer_golden.py's blocked, soft and
deepseek_v3 cases: 12.4 CPU-s with the fusion emitters, 8.0 without; ``-n 0``
under ``/usr/bin/time``, 2026-12-02), and the golden-value tests hold with either.

Binaries the tests launch inherit them through ``XLA_FLAGS``; a test that sets
its own ``XLA_FLAGS`` for a child uses :data:`XLA_FLAGS`.
"""

from __future__ import annotations

import os

FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
XLA_FLAGS = " ".join(FLAGS)


def without(flags: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) without this module's flags, whatever their values."""
  names = {f.split("=")[0] for f in FLAGS}
  return " ".join(f for f in flags.split() if f.split("=")[0] not in names)


def install() -> None:
  """Adds every flag of :data:`FLAGS` that ``XLA_FLAGS`` does not set already."""
  for flag in FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
