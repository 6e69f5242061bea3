"""What a run records in its workdir beside the checkpoints, and what it reports at the end.

- :func:`record_start`: on every start, damaged checkpoints moved aside
  (``damaged/``, said so), config.json written and the ``start`` /
  ``resume`` / ``extend`` line of history.jsonl appended;
- :func:`history`: one history.jsonl line per event of the run (process 0);
- :func:`final_summary` and :func:`report`: the headline numbers, read back from
  metrics.jsonl and history.jsonl, and every output path of the run.
"""

from __future__ import annotations

import os

import jax

from moejax.train import checkpoint as ckpt_lib
from moejax.train import metrics_log
from moejax.train import profiling


def record_start(workdir, cfg, plan, restored, say) -> None:
  """Moves damaged checkpoints aside, writes config.json and the history line of this start.

  Files are written by process 0 only; every process says what happens.
  """
  lead = jax.process_index() == 0
  if restored is not None and restored.skipped:
    skipped = [s for s, _ in restored.skipped]
    moved = (ckpt_lib.move_aside(workdir, skipped) if lead else
             [os.path.join(workdir, ckpt_lib.DAMAGED_DIR, str(s)) for s in skipped])
    for (s, why), dst in zip(restored.skipped, moved):
      say(f"{workdir}: checkpoint {s} is {why}; moved to {dst}")
    say(f"{workdir}: falling back to checkpoint {restored.step}, the newest that restores, is "
        "finite and matches its checksums (if it has any)")
  if restored is None:
    if plan.saved is not None and plan.changes:
      say(f"{workdir}: no checkpoint was written before it stopped; starting the run again "
          f"with this config")
    if lead:
      ckpt_lib.write_config(workdir, cfg)
    history(workdir, "start", step=0, steps=cfg.train.steps)
    return
  for change in plan.changes:
    say(f"resuming with a changed execution / logging setting: {change}")
  if plan.extend_from is not None:
    say(f"{workdir}: extending the run from train.steps={plan.extend_from} to "
        f"{cfg.train.steps} (from step {restored.step}; the learning-rate schedule now decays "
        f"over {cfg.train.steps} steps)")
  if lead and (plan.changes or plan.extend_from is not None):
    ckpt_lib.write_config(workdir, cfg)  # not a finished run: it trains on under this config
  fields = {"step": restored.step, "changes": list(plan.changes)}
  if restored.skipped:
    fields["skipped"] = [f"{s}: {why}" for s, why in restored.skipped]
  if plan.extend_from is not None:
    history(workdir, "extend", step=restored.step, steps=[plan.extend_from, cfg.train.steps])
  history(workdir, "resume", **fields)


def history(workdir: str, event: str, **fields) -> None:
  """Appends one line to history.jsonl (start, resume, extend, end, stopped, preempted)."""
  if jax.process_index() == 0:  # one line per event, not one per process
    ckpt_lib.append_history(workdir, event, **fields)


def final_summary(workdir: str) -> dict:
  """The run's last logged numbers; train_seconds sums every segment (history.jsonl)."""
  out = {"step": None, "train_loss": None, "val_loss": None, "unigram_baseline": None}
  out.update(metrics_log.final_values(workdir))
  out["train_seconds"] = sum(float(h.get("train_seconds", 0.0))
                             for h in ckpt_lib.read_history(workdir)
                             if h.get("event") in ("end", "stopped", "preempted"))
  return out


def _fmt(v, digits: int = 4) -> str:
  return "n/a" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def report(workdir: str, summary: dict, say) -> dict:
  """Prints the headline numbers and every output path of the run; returns ``summary``."""
  line = (f"done: step {summary.get('step')} | train loss {_fmt(summary.get('train_loss'))} | "
          f"val loss {_fmt(summary.get('val_loss'))} (unigram "
          f"{_fmt(summary.get('unigram_baseline'), 3)})")
  if summary.get("max_vio_global") is not None:
    line += f" | MaxVio_global {_fmt(summary['max_vio_global'], 3)}"
  say(line)
  steps = ckpt_lib.checkpoint_steps(workdir)
  for name, path, note in (
      ("config", ckpt_lib.CONFIG_FILE, ""),
      ("metrics", metrics_log.METRICS_FILE, ""),
      ("tensorboard", metrics_log.TENSORBOARD_DIR,
       f"tensorboard --logdir {os.path.join(workdir, metrics_log.TENSORBOARD_DIR)}"),
      ("checkpoints", ckpt_lib.CHECKPOINT_DIR, f"steps {', '.join(map(str, steps))}"),
      ("profile", profiling.PROFILE_DIR, "jax.profiler trace: tensorboard --logdir "
       f"{os.path.join(workdir, profiling.PROFILE_DIR)}"),
      ("history", ckpt_lib.HISTORY_FILE, ""),
      ("damaged", ckpt_lib.DAMAGED_DIR, "checkpoints that did not restore")):
    full = os.path.join(workdir, path)
    if os.path.exists(full):
      say(f"  {name:<12} {full}{f'  ({note})' if note else ''}")
  return summary
