"""Preemption: SIGTERM / SIGINT end a run at a step boundary, with a checkpoint.

::

    with Preemption(say) as stop:        # handlers installed; the previous ones restored on exit
      while step < steps:
        state = train_step(state)
        step += 1
        if stop.should_stop(step):       # every process of the run answers alike at a step
          save the checkpoint of `step`; break
    if stop.signum:
      raise stop.preempted(step, where)  # Preempted: the line to print, the exit status

What a cluster sends before it takes a job's nodes (SLURM's ``--signal`` /
preemption, a TPU maintenance event, ``scancel``) is SIGTERM, and a person
at a terminal sends SIGINT (Ctrl-C). Both, while a run trains, only set a
flag: the step in progress finishes, the loop writes a checkpoint of that
step (the whole resume state: params, optimizer, router state, the data
iterator's position and the metric rows not yet logged), and the caller
raises :class:`Preempted`; the binaries print its one line and exit with
:data:`EXIT_STATUS` (128 + the signal number, the shell's convention for a
process ended by that signal: 143 for SIGTERM, 130 for SIGINT), so a job
script and SLURM see a run that was stopped, not one that finished.

A second signal while the run is stopping is answered with one line on
stderr and otherwise ignored: the checkpoint being written completes, and
the previous complete one stays as it was (orbax writes a checkpoint into a
temporary directory and renames it when complete, so even SIGKILL at any
moment leaves the previous checkpoint intact; the next start removes the
temporary directory).

Several processes (a multi-host run): each process's handler sets only its
own flag, and a cluster signals its hosts at slightly different moments;
a host that stopped on its own flag would leave the others waiting in the
next step's collectives. :meth:`Preemption.should_stop` therefore combines
the flags of all processes with ``jax.experimental.multihost_utils.
process_allgather`` every :data:`SYNC_EVERY` steps (the same steps on every
process, so every process reaches the collective) and every process stops
at the first such step after any of them was signalled. Chosen over
JAX's preemption sync manager (``multihost_utils.reached_preemption_sync_point``)
because that one exists only after ``jax.distributed.initialize`` with its
service enabled, reacts to SIGTERM only (not SIGINT), and takes over the
process's SIGTERM handler in C++; the allgather works with any launcher and
costs one scalar collective every :data:`SYNC_EVERY` steps. One process
stops at the next step, without a collective.

Handlers can only be installed from the main thread; elsewhere (a run in a
worker thread) the object still works through :meth:`Preemption.request`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exit status of a preempted binary: 128 + signal number (the shell's convention).
EXIT_STATUS = {int(s): 128 + int(s) for s in SIGNALS}


def exit_status(signum: int) -> int:
  return EXIT_STATUS.get(signum, 128 + signum)
# Steps between the combinations of the processes' flags in a multi-process run.
SYNC_EVERY = 10


class Preempted(Exception):
  """A run stopped by a signal after writing the checkpoint of its last step.

  ``str(e)`` is the one line a binary prints; ``exit_status`` what it exits with.
  """

  def __init__(self, message: str, signum: int, step: int):
    super().__init__(message)
    self.signum, self.step = signum, step
    self.exit_status = exit_status(signum)


def signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


def _allgather_max(value: int) -> int:
  """The largest ``value`` over all processes (a collective: every process must call it)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


class Preemption:
  """SIGTERM / SIGINT handlers for one run (see the module docstring); a context manager.

  Attributes:
    signum: the signal this run stops for, once :meth:`should_stop` said so
      (in a multi-process run, the largest signal number of the processes
      that received one); 0 before.
  """

  def __init__(self, say: Callable[[str], None] = print, process_count: Optional[int] = None,
               sync_every: int = SYNC_EVERY, allgather: Callable[[int], int] = _allgather_max):
    self.say = say
    if process_count is None:
      import jax  # pylint: disable=g-import-not-at-top
      process_count = jax.process_count()
    self.process_count, self.sync_every, self._allgather = process_count, sync_every, allgather
    self.received = 0   # the signal this process received (0: none)
    self.signum = 0     # the signal the run stops for (set by should_stop)
    self._previous: dict = {}

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.received:
      # os.write, not print: a handler runs between two bytecodes of the main thread,
      # which may be inside a print of its own (a re-entrant buffered write raises).
      os.write(2, (f"{signal_name(signum)} received again: still stopping (the step in "
                   f"progress, then its checkpoint); the previous checkpoint stays intact. "
                   f"kill -9 {os.getpid()} ends the process at once\n").encode())
      return
    self.request(signum)

  def request(self, signum: int = int(signal.SIGTERM)) -> None:
    """What the handler does: ask the run to stop after its step (any thread may call it)."""
    self.received = int(signum)

  def should_stop(self, step: int) -> bool:
    """Whether the run stops after ``step`` (which every process has just finished).

    One process: as soon as it received a signal. Several: at the first step
    divisible by ``sync_every`` after any process received one, identically on
    every process (each of them must call this at every step).
    """
    if self.signum:
      return True
    if self.process_count == 1:
      found = self.received
    elif step % self.sync_every == 0:
      found = self._allgather(self.received)
    else:
      return False
    if found:
      self.signum = found
      self.say(f"{signal_name(found)} received: stopping after step {step}, writing its "
               "checkpoint")
    return bool(found)

  def preempted(self, step: int, checkpoint_dir: str) -> Preempted:
    name = signal_name(self.signum)
    return Preempted(
        f"preempted by {name} at step {step}: its checkpoint is in {checkpoint_dir}; run the "
        f"same command again to resume from step {step} (exit status "
        f"{exit_status(self.signum)})", self.signum, step)
