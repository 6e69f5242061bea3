"""A ``jax.profiler`` trace of a few train steps (``train.profile_steps=(a, b)``).

The trace runs from the end of step a to the end of step b (steps a+1 .. b;
a >= 1 keeps the compiling first step out), each end waiting for the device
so the window holds exactly those steps. It is written under
``WORKDIR/profile`` (``WORKDIR/profile/process_<i>`` for each process of a
multi-process run: on one host their files would share a name), as
``plugins/profile/<time>/<host>.xplane.pb`` plus a Perfetto
``<host>.trace.json.gz`` of the host side::

    tensorboard --logdir WORKDIR/profile        # with tensorboard-plugin-profile
    xprof --logdir WORKDIR/profile              # or the standalone xprof

The MoE layer's phases carry ``jax.named_scope`` names
(:data:`moejax.execution.scopes.PHASES`), so the trace viewer and the op
profile show routing, dispatch, the expert matmuls, the all-to-all and the
combine apart. Starting and stopping the trace (writing it) is kept out of
the train row's tokens/s and MFU, but the traced steps themselves run
slower than the others (the profiler records every op), which the row of
their window shows.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax

PROFILE_DIR = "profile"
_active: list = []   # the trace this module started and has not stopped (the profiler is global)


def profile_dir(workdir: str) -> str:
  """Where this process writes its trace."""
  base = os.path.join(workdir, PROFILE_DIR)
  return base if jax.process_count() == 1 else os.path.join(base, f"process_{jax.process_index()}")


class StepProfiler:
  """Starts the trace after step a, stops it after step b (:meth:`after_step`)."""

  def __init__(self, workdir: str, steps: Optional[tuple], start_step: int,
               say: Callable[[str], None]):
    self.steps, self.say, self.dir = steps, say, profile_dir(workdir)
    if steps is not None and start_step >= steps[0]:
      say(f"train.profile_steps={tuple(steps)}: this run starts at step {start_step}, after "
          f"step {steps[0]}; no trace (set later steps to take one)")
      self.steps = None

  def after_step(self, step: int, outputs) -> float:
    """Called after step ``step`` was dispatched with its ``outputs`` (waited on at the ends).

    Returns the seconds spent starting or stopping the profiler (writing the
    trace), which the loop keeps out of tokens/s and MFU like an evaluation.
    """
    if self.steps is None or step not in self.steps:
      return 0.0
    a, b = self.steps
    jax.block_until_ready(outputs)  # the steps' own time stays in the window
    t0 = time.perf_counter()
    if step == a:
      jax.profiler.start_trace(self.dir)
      _active.append(self.dir)
    elif _active:
      stop()
      self.say(f"profile of steps {a + 1}-{b} written under {self.dir} (tensorboard --logdir "
               f"{self.dir}, profile tab)")
    return time.perf_counter() - t0


def stop() -> None:
  """Stops the trace this module started, if any (the loop's exit path calls it too)."""
  if _active:
    _active.clear()
    jax.profiler.stop_trace()


def trace_files(workdir: str, suffix: str = ".xplane.pb") -> list[str]:
  """The trace files under ``WORKDIR/profile`` ending in ``suffix``, sorted."""
  out = []
  for root, _, files in os.walk(os.path.join(workdir, PROFILE_DIR)):
    out.extend(os.path.join(root, f) for f in files if f.endswith(suffix))
  return sorted(out)
