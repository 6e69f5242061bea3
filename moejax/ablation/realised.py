"""The budget of what ran: the declared slots beside the realised active experts per token.

The budget (:mod:`moejax.ablation.budget`) counts what each router declares
(``RouterSpec.slots``: the expected and the maximal FFN experts per token in
each MoE layer). What ran can differ: top-p counts its maximum k and uses
fewer, zero-computation experts take a varying share, capacity drops copies,
expert choice gives each token a varying count, and a plugin may declare a
target it does not keep. So every run also records what it computed
(result.json):

- ``active_experts_train``: FFN experts computed per token (kept copies, mean
  over MoE layers) over every training step: the logged rows are means over
  their window of steps, weighted here by the steps they cover. This is the
  number the run's compute followed.
- ``active_experts_val``: the same on the final whole-split validation pass
  (the experts of every valid target's token over the target count).
- ``active_experts_over_max``: the largest logged share of tokens whose router
  decision held more FFN experts than its declared maximum
  (``LayerMetrics.active_over_max``). A window mean of a non-negative share
  is positive when any of its steps was, so no step escapes it.

:func:`over_max_error` turns the last into the refusal of a run at its end
(the runner raises :class:`RealisedBudgetError` before result.json is
written): the accounting counted fewer experts than the router used, so the
run's budget is wrong, not merely loose.

Arms are compared on realised compute: :func:`realised_budget` scales the
routed experts' share of ``active`` and ``flops_per_token`` by realised /
declared slots (the rest of the model does not depend on the routing), and
:func:`check` compares those across arms with the suite's tolerances on
``active`` and ``flops_per_token``, naming every arm beyond them against the
baseline. :func:`table` is the text table experiments.ablate prints after
training (no line over :data:`moejax.ablation.budget.TABLE_WIDTH`), with the
convention under it.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from moejax.ablation import budget as budget_lib
from moejax.ablation.budget import ArmBudget, BudgetError, spread
from moejax.topology.accounting import human

TRAIN, VAL, OVER = "active_experts_train", "active_experts_val", "active_experts_over_max"
MEAN_LOG, OVER_LOG, VAR_LOG = ("active_experts_mean", "active_experts_over_max",
                               "active_experts_var")
# The budget quantities the realised compute is compared on, with their titles.
COMPARED = (("active", "active/token"), ("flops_per_token", "FLOPs/token"))
CONVENTION = (
    "slots: FFN experts per token per MoE layer as the router declares them "
    "(RouterSpec.slots), expected/max; train: realised, kept copies, mean over MoE layers, "
    "seeds and every training step (the run's compute); val: the same on the validation "
    "pass; k: fixed when every token got the declared count, variable otherwise (top-p, "
    "zero-computation experts, expert choice, capacity drops, a plugin). Arms are compared "
    "on realised compute: active and FLOPs/token with the routed experts' share scaled by "
    "train/slots.")


class RealisedBudgetError(BudgetError):
  """A router used more experts per token than it declares at most."""


@dataclasses.dataclass(frozen=True)
class Realised:
  """What an arm computed (means over its seeds); None where no run recorded it."""

  train: Optional[float] = None
  val: Optional[float] = None
  variable: bool = False


def _number(v) -> Optional[float]:
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  return float(v) if ok else None


def step_mean(rows: Sequence[Mapping], key: str) -> Optional[float]:
  """Mean over training steps of ``key`` from logged rows, each a mean over the steps since
  the row before it (the first: since step 0); None when no row has it."""
  total = weight = 0.0
  prev = 0
  for r in sorted(rows, key=lambda r: r["step"]):
    steps, v = int(r["step"]) - prev, _number(r.get(key))
    prev = int(r["step"])
    if v is not None and steps > 0:
      total, weight = total + steps * v, weight + steps
  return total / weight if weight else None


def val_active(loads: Mapping[str, np.ndarray], targets: float) -> Optional[float]:
  """FFN experts per token on a validation pass: per layer the kept copies (``loads``
  {layer: f[E]}) over the ``targets`` they were counted on, mean over layers."""
  if not loads or targets <= 0:
    return None
  return float(np.mean([float(np.sum(v)) / targets for v in loads.values()]))


def run_metrics(train_rows: Sequence[Mapping], loads: Mapping[str, np.ndarray],
                targets: float) -> dict:
  """The realised keys of one run's result.json (those it has data for)."""
  out = {TRAIN: step_mean(train_rows, MEAN_LOG), VAL: val_active(loads, targets)}
  over = [v for v in (_number(r.get(OVER_LOG)) for r in train_rows) if v is not None]
  if over:
    out[OVER] = max(over)
  return {k: v for k, v in out.items() if v is not None}


def over_max_error(router: str, declared_max: Optional[float], rows: Sequence[Mapping],
                   run: str) -> str:
  """The one-line refusal of a run whose router used more FFN experts per token than it
  declares at most ('' when it kept its word or there is nothing to check)."""
  if declared_max is None:
    return ""
  over = [(float(r[OVER_LOG]), int(r["step"])) for r in rows
          if (_number(r.get(OVER_LOG)) or 0.0) > 0]
  mean = step_mean(rows, MEAN_LOG)
  if not over and (mean is None or mean <= declared_max + 1e-6):
    return ""
  used = f"{mean:.3g} per token on average over training" if mean is not None else ""
  if over:
    share, step = max(over)
    used = (f"{100 * share:.3g}% of tokens over it in the steps logged at step {step}"
            + (f"; {used}" if used else ""))
  plural = "" if declared_max == 1 else "s"
  return (f"run {run}: router {router!r} declares at most {declared_max:g} FFN "
          f"expert{plural} per token (RouterSpec.slots) but used more ({used}), so its budget "
          "counted fewer experts than ran; no result.json was written. Fix: return from the "
          "router's slots() the most experts its route() can select per token (the second "
          "value), or cap route() at it, and rerun")


def realised_budget(b: ArmBudget, experts: Optional[float]) -> Optional[tuple[float, float]]:
  """(active params, forward FLOPs) per token at ``experts`` realised FFN experts per token:
  the routed experts' share scaled by realised / declared slots; None when not known."""
  if experts is None or not b.slots or b.routed_active is None or b.routed_flops is None:
    return None
  f = experts / b.slots - 1.0
  return b.active + b.routed_active * f, b.flops_per_token + b.routed_flops * f


def check(budgets: Mapping[str, ArmBudget], realised: Mapping[str, Realised],
          fixed: Mapping[str, float], exempt: Optional[Mapping[str, Sequence[str]]] = None,
          baseline: Optional[str] = None) -> tuple[list[str], list[str]]:
  """(notes, flags) of the arms' realised compute against the suite's tolerances on
  ``active`` / ``flops_per_token`` (a quantity not held fixed is not compared).

  Each flag names an arm whose realised compute differs from the baseline's (the arm of
  most compute when the baseline has none) beyond a tolerance.
  """
  exempt = exempt or {}
  compared = [(q, t) for q, t in COMPARED if q in fixed]
  vals: dict[str, dict[str, float]] = {}
  for q, _ in compared:
    idx = [k for k, _ in COMPARED].index(q)
    vals[q] = {n: rb[idx] for n, b in budgets.items() if q not in exempt.get(n, ())
               and (rb := realised_budget(b, realised.get(n, Realised()).train)) is not None}
  notes, flags = [], []
  by_arm: dict[str, list[str]] = {}
  ref_of: dict[str, str] = {}
  for q, title in compared:
    v, tol = vals[q], float(fixed[q])
    if len(v) < 2:
      continue
    s = spread(list(v.values()))
    if s <= tol + 1e-12:
      notes.append(f"realised {title}: spread {100 * s:.2f}% (tolerance {100 * tol:.2f}%)")
      continue
    ref = baseline if baseline in v else max(v, key=v.get)
    for n in v:
      if n != ref and spread([v[n], v[ref]]) > tol + 1e-12:
        ref_of[n] = ref
        by_arm.setdefault(n, []).append(f"{title} {100 * (v[n] / v[ref] - 1):+.1f}%")
  for n, parts in by_arm.items():
    ref = ref_of[n]
    a, r = realised[n].train, realised[ref].train
    word = "baseline " if ref == baseline else ""
    tols = ", ".join(f"{q} {100 * float(fixed[q]):.2g}%" for q, _ in compared)
    rel = f" ({100 * (a / r - 1):+.0f}%)" if r else ""
    flags.append(f"realised active experts differ: arm {n} {a:.3g} vs {word}{ref} {r:.3g} "
                 f"per token{rel}; realised {', '.join(parts)} (tolerance {tols})")
  return notes, flags


def table(budgets: Mapping[str, ArmBudget], realised: Mapping[str, Realised],
          width: int = budget_lib.TABLE_WIDTH) -> str:
  """Declared slots beside the realised experts per token and the realised compute, no
  line wider than ``width``, the convention under it."""
  rows = [["arm", "k", "slots", "train", "val", "train/slots", "active", "FLOPs/token"]]
  rows += [[n] + _cells(b, realised.get(n, Realised())) for n, b in budgets.items()]
  return "\n".join(budget_lib.text_table(rows, width) + budget_lib.wrapped(CONVENTION, width))


def _cells(b: ArmBudget, r: Realised) -> list[str]:
  """k, declared slots, realised train / val, train vs declared, realised active and FLOPs."""
  rb = realised_budget(b, r.train)
  fixed_k = b.slots is not None and b.slots == b.slots_max and not r.variable
  number = lambda v: "n/a" if v is None else f"{v:.3g}"
  return ["-" if b.slots is None else ("fixed" if fixed_k else "variable"),
          budget_lib.slots_cell(b), number(r.train), number(r.val),
          "n/a" if rb is None else f"{100 * (r.train / b.slots - 1):+.1f}%",
          "n/a" if rb is None else human(rb[0]), "n/a" if rb is None else human(rb[1])]


def from_results(results: Iterable[Mapping], label=lambda r: r["arm"]) -> dict[str, Realised]:
  """Per label the seed means of the runs' realised keys (result.json dicts)."""
  groups: dict[str, list[Mapping]] = {}
  for r in results:
    groups.setdefault(label(r), []).append(r)
  out = {}
  for n, runs in groups.items():
    mean = lambda key: (None if not (vs := [v for v in (_number(r.get(key)) for r in runs)
                                            if v is not None]) else float(np.mean(vs)))
    out[n] = Realised(train=mean(TRAIN), val=mean(VAL), variable=(mean(VAR_LOG) or 0.0) > 0)
  return out


def from_summary(summary: Mapping) -> dict[str, Realised]:
  """Per label of a summary dict the realised means (:mod:`moejax.ablation.summary`)."""
  def mean(a: Mapping, key: str) -> Optional[float]:
    m = a["metrics"].get(key)
    return None if m is None else _number(m["interval"]["mean"])
  return {n: Realised(train=mean(a, TRAIN), val=mean(a, VAL),
                      variable=(mean(a, VAR_LOG) or 0.0) > 0)
          for n, a in summary["arms"].items()}


def summary_flags(summary: Mapping, fixed: Mapping[str, float],
                  exempt: Optional[Mapping[str, Sequence[str]]] = None) -> list[str]:
  """The flags of :func:`check` on a summary dict (its arms' budgets and realised means)."""
  budgets = {}
  for n, a in summary["arms"].items():
    try:
      budgets[n] = budget_lib.from_dict(a.get("budget") or {})
    except TypeError:  # no budget recorded (hand-made or very old results): not compared
      continue
  return check(budgets, from_summary(summary), fixed, exempt, summary.get("baseline"))[1]


def check_run(exp, b: ArmBudget, run_path: str, run: str) -> None:
  """Raises RealisedBudgetError (one line) when the run's router used more FFN experts per
  token than it declares at most (:func:`over_max_error`), from its training log."""
  from moejax.train import metrics_log  # pylint: disable=g-import-not-at-top
  rows = metrics_log.read_metrics(run_path, "train")
  moe = exp.model.moe
  error = over_max_error(moe.routing.kind if moe is not None else "", b.slots_max, rows, run)
  if error:
    raise RealisedBudgetError(error)


def from_evaluation(rows: Sequence[Mapping], ev, model_cfg) -> dict:
  """:func:`run_metrics` of a run's training rows and its final evaluation
  (:class:`moejax.ablation.final_eval.FinalEval`): its loads were counted on every valid
  target with a domain label, which its per-domain counts add up to.

  The layers of mixture-of-depths blocks are left out of the validation count: only the
  tokens their block selected reach them, and the accounting already scales them by its
  capacity (their training count is per token they processed).
  """
  targets = (float(np.sum(ev.domain_count)) if ev.domain_count is not None
             else float(ev.metrics.get("tokens", 0.0)))
  def every_token(name: str) -> bool:  # layer_<i>
    i = name.rsplit("_", 1)[-1]
    return not (i.isdigit() and model_cfg.is_mod_layer(int(i)))
  loads = {n: v for n, v in ev.loads.items() if every_token(n)}
  return run_metrics(rows, loads, targets)


def report(budgets: Mapping[str, ArmBudget], results: Iterable[Mapping],
           fixed: Mapping[str, float], exempt: Optional[Mapping[str, Sequence[str]]] = None,
           baseline: Optional[str] = None) -> list[str]:
  """What experiments.ablate prints after training: the table and the check's lines
  (nothing for a suite without routed experts)."""
  if all(b.slots is None for b in budgets.values()):
    return []
  real = from_results(results)
  notes, flags = check(budgets, real, fixed, exempt, baseline)
  # As the budget check's lines are printed (moejax.ablation.runner.check_suite).
  wrap = lambda line, lead: textwrap.wrap(line, budget_lib.TABLE_WIDTH, initial_indent=lead,
                                          subsequent_indent=" " * 6, break_on_hyphens=False)
  return (["budget of what ran (realised FFN experts per token, mean over seeds):",
           table(budgets, real)] + [w for n in notes for w in wrap(n, "  ok  ")]
          + [w for f in flags for w in wrap(f, "  !   ")])


def markdown(summary: Mapping) -> str:
  """The budget of what ran as a markdown table with its convention (summary.md and
  RESULTS.md); '' when no arm recorded its realised experts."""
  real = from_summary(summary)
  if all(r.train is None and r.val is None for r in real.values()):
    return ""
  lines = ["Budget of what ran (FFN experts per token per MoE layer, mean over seeds):", "",
           "| arm | k | declared slots (expected/max) | realised, train | realised, val | "
           "train / declared | realised active/token | realised FLOPs/token |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for n, a in summary["arms"].items():
    try:
      b = budget_lib.from_dict(a.get("budget") or {})
    except TypeError:
      continue
    lines.append("| " + " | ".join([n] + _cells(b, real[n])) + " |")
  return "\n".join(lines + ["", CONVENTION])
