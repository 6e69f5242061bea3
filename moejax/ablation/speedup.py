"""Speed-up to a reference's quality: steps and wall time to reach its final validation loss.

Switch Transformer's headline (Fedus et al. 2101.03961, Fig. 1 and Table 1):
at equal FLOPs per token, a sparse model reaches the dense model's quality
in fewer steps. For each run of an arm and the reference arm's run of the
same seed (paired, as every difference of the summary):

- the target L* is the reference run's final validation loss (the last
  point of its validation curve);
- ``steps_to_reference`` s*: the first step at which the arm's validation
  curve reaches L*, linearly interpolated between the two evaluations that
  bracket it (:func:`crossing`); not reached: None, and the run's note
  says so;
- ``speedup_steps`` = S_ref / s*, S_ref the reference run's steps;
- ``time_to_reference``: the arm's training time at s* (:func:`time_at`:
  the cumulative time of its logged train windows, steps / tokens per second
  of each window, compilation and evaluation excluded), and
  ``speedup_time`` = the reference's training time at its last step / it;
- ``tokens_per_s``: the arm's training throughput, second half of training
  (both arms measured in the same suite run on the same machine).

The validation curve is the trainer's evaluations (``metrics.jsonl``, split
``eval``). Points measured on a different number of tokens than the final
one (the periodic ``train.eval_batches`` subset against the final whole
split) are a different measurement of the loss; only points with the final
point's token count are used, and a curve left with fewer than two points
gets no crossing (suites that report speed-ups set ``train.eval_batches``
to None so that every evaluation reads the whole split). If the curve is
already below L* at its first point, s* is that point's step (an upper
bound: the curve says nothing earlier) and the note says so.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

from moejax.train import metrics_log

KEYS = ("steps_to_reference", "speedup_steps", "time_to_reference", "speedup_time")


def crossing(steps: Sequence[float], losses: Sequence[float],
             target: float) -> tuple[Optional[float], str]:
  """(first step where the curve reaches ``target``, note); see the module doc.

  ``steps`` ascending. Between the bracketing points (s0, l0) with l0 > target
  and (s1, l1) with l1 <= target: s0 + (l0 - target) / (l0 - l1) (s1 - s0).
  """
  if len(steps) != len(losses):
    raise ValueError(f"crossing: {len(steps)} steps for {len(losses)} losses")
  if not steps:
    return None, "no validation point"
  if losses[0] <= target:
    return float(steps[0]), f"below the target at its first evaluation (step {steps[0]}): an " \
                            "upper bound"
  for (s0, l0), (s1, l1) in zip(zip(steps, losses), zip(steps[1:], losses[1:])):
    if l1 <= target:
      return float(s0 + (l0 - target) / (l0 - l1) * (s1 - s0)), ""
  return None, f"never reached {target:.4f} (best {min(losses):.4f})"


def time_at(rows: Sequence[Mapping], tokens_per_step: float, step: float) -> Optional[float]:
  """Training seconds to ``step``: each train row's window (steps since the previous row) at
  the row's tokens/s, cumulated and linearly interpolated inside the window."""
  t, prev = 0.0, 0
  for r in rows:
    s, tps = int(r["step"]), float(r.get("tokens_per_s") or 0.0)
    if tps <= 0:
      prev = s
      continue
    window = (s - prev) * tokens_per_step / tps
    if step <= s:
      return t + window * (step - prev) / max(s - prev, 1)
    t, prev = t + window, s
  return None


def curve(run_path: str) -> tuple[list[int], list[float]]:
  """(steps, validation losses) of the run's evaluations with the final point's token count."""
  rows = metrics_log.read_metrics(run_path, "eval")
  if not rows:
    return [], []
  tokens = rows[-1].get("tokens")
  same = [r for r in rows if r.get("tokens") == tokens]
  return [int(r["step"]) for r in same], [float(r["loss"]) for r in same]


def run_speedup(run_path: str, ref_path: str, tokens_per_step: float) -> dict:
  """The :data:`KEYS` of the run in ``run_path`` against the reference run in ``ref_path``."""
  ref_steps, ref_losses = curve(ref_path)
  steps, losses = curve(run_path)
  out: dict = {}
  if not ref_steps or not steps:
    out["speedup_note"] = "no validation curve"
    return out
  target = ref_losses[-1]
  s_star, note = crossing(steps, losses, target)
  out["reference_loss"] = target
  if note:
    out["speedup_note"] = note
  if s_star is None:
    return out
  out["steps_to_reference"] = s_star
  out["speedup_steps"] = ref_steps[-1] / s_star
  t_arm = time_at(metrics_log.read_metrics(run_path, "train"), tokens_per_step, s_star)
  t_ref = time_at(metrics_log.read_metrics(ref_path, "train"), tokens_per_step, ref_steps[-1])
  if t_arm and t_ref:
    out["time_to_reference"] = t_arm
    out["speedup_time"] = t_ref / t_arm
  return out


def add_speedups(results: Sequence[dict], reference: str) -> None:
  """Adds :func:`run_speedup`'s keys to every result (``_path`` set) with a reference run of
  its seed; in place."""
  refs = {r.get("seed", 0): r for r in results if r.get("arm") == reference and r.get("_path")}
  for r in results:
    ref = refs.get(r.get("seed", 0))
    if ref is None or not r.get("_path"):
      continue
    exp = r.get("experiment") or {}
    data = exp.get("data", {})
    tokens_per_step = float(data.get("batch_size", 1) * data.get("seq_len", 1))
    if not os.path.exists(os.path.join(r["_path"], metrics_log.METRICS_FILE)):
      continue
    r.update(run_speedup(r["_path"], ref["_path"], tokens_per_step))
