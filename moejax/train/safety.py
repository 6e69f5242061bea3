"""A run's safety machinery behind the few calls the training loop makes.

::

    safety = RunSafety(workdir, say, take_over_lock)
    safety.check()                        # read-only: another live run's lock refuses at once
    ...                                   # the loop's other read-only checks
    with safety.hold(plan.steps):         # the lock (heartbeats), SIGTERM / SIGINT handlers
      with safety.guarding(ckpt, writer, progress):
        ...                               # the steps; per step:
        stop = safety.after_step(step, steps)  # a signal: this step is the last
        safety.check_rows(rows, step)     #   NaN / inf in the rows read back
        safety.before_checkpoint(tree, step)   # NaN / inf anywhere in the state
      safety.end(step, progress.train_seconds)
    safety.raise_if_preempted(step)

What each part guarantees, and where it is built:

- one run per workdir (:mod:`moejax.train.lock`): process 0 holds
  ``run.lock`` with a heartbeat for every process of the run; a workdir
  whose checkpoints changed between the read-only checks and the lock is
  refused;
- preemption (:mod:`moejax.train.preempt`): a signal ends the run after the
  step in progress, with its checkpoint; every process stops at the same
  step; :meth:`RunSafety.raise_if_preempted` raises
  :class:`~moejax.train.preempt.Preempted` once the lock is released;
- NaN / inf (:mod:`moejax.train.guard`): every step's loss and gradient
  norm when rows are read back, the whole state before every checkpoint;
  :class:`~moejax.train.guard.NonFiniteError` names the newest checkpoint on
  disk (:func:`last_good`), which passed the same check, or says the resume
  checkpoint itself may be at fault (:mod:`moejax.train.integrity`);
- checkpoint integrity (:mod:`moejax.train.integrity`): the checksums of a
  checkpoint orbax has committed are written when rows are read back;
- write failures (:mod:`moejax.train.write_failure`): a full disk or an
  unwritable file ends the run with one
  :class:`~moejax.train.write_failure.WriteFailed` naming the path and the
  resume point, with no thread left waiting.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator, Optional

import jax

from moejax.train import checkpoint as ckpt_lib
from moejax.train import guard
from moejax.train import integrity
from moejax.train import lock as lock_lib
from moejax.train import preempt as preempt_lib
from moejax.train import profiling
from moejax.train import records
from moejax.train import write_failure

NAN_FIX = ("Fix: lower train.learning_rate, raise train.warmup_steps or set train.grad_clip, "
           "and run in a new --workdir (this one's config.json describes its checkpoints)")


class RunSafety:
  """The lock, signals, NaN guard, checkpoint integrity and write failures of one run."""

  def __init__(self, workdir: str, say: Callable[[str], None], take_over_lock: bool = False):
    self.workdir, self.say, self.take_over_lock = workdir, say, take_over_lock
    self.lead = jax.process_index() == 0  # holds the lock for every process of the run
    self.stop: Optional[preempt_lib.Preemption] = None
    self.ckpt = None

  def check(self) -> None:
    """Read-only: WorkdirLockedError when another live run holds the workdir."""
    if self.lead:  # the other processes run under the lock process 0 takes
      lock_lib.check_unlocked(self.workdir, self.take_over_lock)

  @contextlib.contextmanager
  def hold(self, checked_steps) -> Iterator["RunSafety"]:
    """The workdir's lock and the signal handlers, held while the run writes and computes.

    ``checked_steps``: the checkpoints the read-only checks saw; a workdir
    that changed since is refused before anything is written.
    """
    locked = (lock_lib.WorkdirLock(self.workdir, self.say, self.take_over_lock) if self.lead
              else contextlib.nullcontext())
    with locked, preempt_lib.Preemption(self.say) as self.stop:
      now = ckpt_lib.checkpoint_steps(self.workdir)
      if now != list(checked_steps):
        raise ckpt_lib.WorkdirError(
            f"{self.workdir} changed while this run was checking it (checkpoints "
            f"{list(checked_steps)} -> {now}). Fix: run the same command again")
      yield self

  @contextlib.contextmanager
  def guarding(self, ckpt: ckpt_lib.Checkpointer, writer, progress) -> Iterator[None]:
    """The steps' errors as the run reports them; the checkpointer and writer closed after.

    A NaN stop is recorded in history.jsonl; a failed write becomes one
    WriteFailed (temporaries removed); a save in flight is waited for, and on
    an error its own failure does not replace the one being raised.
    """
    self.ckpt, failing = ckpt, True
    try:
      yield
      failing = False
    except guard.NonFiniteError as e:
      records.history(self.workdir, "stopped", reason=str(e).split(":")[0],
                      train_seconds=progress.train_seconds)
      raise
    except Exception as e:  # a full disk, an unwritable file: one error, no thread left waiting
      failed = write_failure.stopped(e, self.workdir, ckpt)
      if failed is None:
        raise
      raise failed from e
    finally:
      profiling.stop()  # a trace cut short by an error
      write_failure.finish(ckpt, writer, failing=failing)

  def after_step(self, step: int, run_steps: int) -> bool:
    """Whether a signal makes ``step`` the run's last (checkpointed) step; every process
    answers alike."""
    return self.stop is not None and step < run_steps and self.stop.should_stop(step)

  def check_rows(self, rows: list[dict], step: int) -> None:
    """NonFiniteError at the first non-finite loss or gradient norm of the rows read back up
    to ``step``; then the checksums of any checkpoint committed since are written."""
    bad = guard.first_nonfinite_row(rows, step - len(rows) + 1)
    if bad is not None:
      at, key, row = bad
      raise guard.NonFiniteError(
          f"{'loss' if key == 'loss' else 'gradient norm'} is {row[key]} at step {at} (loss "
          f"{row.get('loss')}, cross-entropy {row.get('ce')}, aux {row.get('aux_loss')}, grad "
          f"norm {row.get('grad_norm')}): stopping; nothing was saved after it, "
          f"{last_good(self.ckpt, self.workdir, at)}")
    self.ckpt.poll()

  def before_checkpoint(self, tree, step: int) -> float:
    """NonFiniteError when the state to be saved has a non-finite leaf; else the seconds the
    check took (it reads every array)."""
    t0, bad = time.perf_counter(), guard.nonfinite_leaves(tree)
    if not bad:
      return time.perf_counter() - t0
    raise guard.NonFiniteError(
        f"the train state after step {step} is not finite ({guard.describe(bad)}), though every "
        f"loss and gradient norm up to it was: stopping without saving it; "
        + last_good(self.ckpt, self.workdir, step, fix=(
            "Fix: a router_state leaf points at the bias controller "
            "(model.moe.balance.bias_rate), params / opt_state at the optimizer: "
            + NAN_FIX.split(": ", 1)[1])))

  def end(self, step: int, train_seconds: float) -> None:
    """The history.jsonl line of a run that ended at ``step``: preempted or at its end."""
    records.history(self.workdir, "preempted" if self.stop.signum else "end", step=step,
                    train_seconds=train_seconds)

  def raise_if_preempted(self, step: int) -> None:
    """Preempted (the lock released, the checkpoint of ``step`` complete) after a signal."""
    if self.stop is not None and self.stop.signum:
      raise self.stop.preempted(step, os.path.join(self.workdir, ckpt_lib.CHECKPOINT_DIR))


def last_good(ckpt, workdir: str, at: int, fix: str = NAN_FIX) -> str:
  """Where the run stands after a NaN at step ``at``, and ``fix``; or, when no checkpoint was
  saved since the run resumed, that the resume checkpoint may be at fault (its own fix)."""
  ckpt.wait()
  last = ckpt.latest_step()
  resumed = ckpt.resumed
  suspect = integrity.resume_suspect(
      resumed.step if resumed else None, bool(resumed and resumed.verified), last, at,
      ckpt_lib.checkpoint_steps(workdir), os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR),
      os.path.join(workdir, ckpt_lib.DAMAGED_DIR), fix)
  if suspect:
    return suspect
  if last is None:
    return f"no checkpoint was written before it. {fix}"
  return (f"the last good checkpoint (checked finite before it was saved) is step {last} in "
          f"{os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)}. {fix}")
