"""The budget of every arm and the check that refuses a suite whose arms are not comparable.

Per arm (from :func:`moejax.topology.accounting.budget` at the run's
``data.seq_len``, so attention FLOPs are those of the trained sequences):

- ``total``: trainable parameters; ``active``: expected parameters per token
  (matmul convention: LM head in, input embedding out; top-p counts its
  maximum k, see the accounting module); ``flops_per_token``: forward FLOPs;
- ``tokens``: training target positions, steps x batch x seq_len;
- ``train_flops`` (a property, not checked): 3 x FLOPs/token x tokens, the
  training compute (backward ~ 2 forwards), the column that compares rungs
  of the scale ladder;
- ``optimizer``: a canonical string of every optimisation setting (peak LR,
  schedule, AdamW moments, weight decay, clipping, steps), compared exactly;
- ``trainable``: the parameters the optimizer updates (``total`` unless
  something is frozen: a fine-tuning run's frozen components, a frozen
  router; LoRA adapters count in both), from
  :mod:`moejax.finetune.accounting`;
- ``source_tokens`` / ``source_flops``: what the source of a fine-tuning
  arm cost to train (its tokens and 3 x FLOPs/token x tokens, its own
  source's included: :func:`moejax.finetune.accounting.source_compute`;
  None for a run from scratch or a Hugging Face source), so that an
  upcycled or continued model is charged for its pre-training;
  ``total_tokens`` and ``compute`` (properties) add them to the arm's own
  ``tokens`` and ``train_flops``: the quantities an equal-compute suite
  holds fixed (a suite comparing upcycling with an MoE from scratch).

A suite may exempt reference arms from fixed quantities (``suite.exempt``:
a dense model with the MoE's total parameters has more active FLOPs by
construction); the check leaves them out of that quantity's spread and
says so. The data configs must be equal except ``data.loss_domains`` (the
data mixture a fine-tuning suite varies: same corpus, same order, other
targets scored), which is reported.

Every number above is the analytic accounting's; before it is used, each
arm is audited (:func:`moejax.train.audit.audit`): its model is initialised
abstractly (``jax.eval_shape``) and every component's initialised parameters
must equal the accounting's count, else :class:`BudgetAuditError` names the
arm and the component. So a component the accounting does not know (a router
with an extra parameter) cannot pass the check below by being invisible to it.

:func:`check` compares the arms on the quantities a suite holds fixed: the
relative spread (max - min) / max of a number must be <= its tolerance, the
optimizer strings must be equal, and the data config must always be equal
(same corpus, same order). A violation raises :class:`BudgetError` naming the
quantity, the arms at both ends and the tolerance.

:func:`corpus_check` compares corpus fingerprints
(:mod:`moejax.data.fingerprint`): runs of one suite, or result directories
side by side, measured on different corpora (another Python's standard
library, another tokenizer) are flagged: their numbers are not comparable.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Mapping, Optional, Sequence

from moejax.topology.accounting import budget as model_budget
from moejax.topology.accounting import human
from moejax.train import audit as audit_lib
from moejax.train.config import ExperimentConfig

NUMERIC = ("total", "active", "flops_per_token", "tokens", "total_tokens", "compute")


class BudgetError(ValueError):
  """The arms differ beyond the suite's tolerance on what it holds fixed."""


class BudgetAuditError(BudgetError, audit_lib.AuditError):
  """An arm's initialised parameters differ from the accounting its budget comes from."""


@dataclasses.dataclass(frozen=True)
class ArmBudget:
  total: int
  active: float
  active_max: float
  flops_per_token: float
  tokens: int
  optimizer: str

  @property
  def train_flops(self) -> float:
    return 3.0 * self.flops_per_token * self.tokens

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    if self.source_tokens is not None:
      out.update(total_tokens=self.total_tokens, compute=self.compute)
    return out

  # Declared last, with a default: the field list above is what older budget.json files hold.
  trainable: Optional[int] = None
  source_tokens: Optional[int] = None
  source_flops: Optional[float] = None
  # What the router declares (RouterSpec.slots: expected and maximal FFN experts per token,
  # per MoE layer) and the routed experts' share of active / flops_per_token, which the
  # budget of what ran scales by realised / declared (moejax.ablation.realised). None for a
  # model without routed experts (dense, Soft MoE, PEER).
  slots: Optional[float] = None
  slots_max: Optional[float] = None
  routed_active: Optional[float] = None
  routed_flops: Optional[float] = None

  @property
  def total_tokens(self) -> int:
    """This arm's tokens plus its source's."""
    return self.tokens + (self.source_tokens or 0)

  @property
  def compute(self) -> float:
    """This arm's training FLOPs plus its source's."""
    return self.train_flops + (self.source_flops or 0.0)


def optimizer_string(exp: ExperimentConfig) -> str:
  """The optimizer with its options (``muon(momentum=0.95, ...)``; AdamW has none) and the
  shared schedule and AdamW settings."""
  t = exp.train
  return (f"{t.optimizer_spec.describe(t)} lr={t.learning_rate:g} warmup={t.warmup_steps} "
          f"cosine->x{t.min_lr_ratio:g} b1={t.b1:g} b2={t.b2:g} eps={t.eps:g} wd={t.weight_decay:g} clip={t.grad_clip:g} "
          f"steps={t.steps}")


def arm_budget(exp: ExperimentConfig, label: str = "this run",
               source: Optional[ExperimentConfig] = None) -> ArmBudget:
  """The budget of one arm (``label``, e.g. ``"arm 'aux'"``, names it in errors).

  ``source``: the config of the arm's source when it is not trained yet (a
  suite's ``source``); otherwise the source's config.json is read.

  Raises BudgetAuditError when the parameters its model initialises differ
  from the accounting (:func:`moejax.train.audit.audit`, abstract: no compute).
  """
  params = audit_lib.abstract_params(exp)
  try:
    audit_lib.audit(exp, params, label)
  except audit_lib.AuditError as e:
    raise BudgetAuditError(str(e)) from e
  b = model_budget(exp.model, exp.data.seq_len)
  tokens = exp.train.steps * exp.data.batch_size * exp.data.seq_len
  total, trainable = int(b.total), int(b.total)
  src = None
  if exp.finetune.enabled:
    from moejax.finetune.accounting import source_compute  # pylint: disable=g-import-not-at-top
    src = source_compute(exp, source)
  if exp.finetune.enabled or (exp.model.moe is not None and exp.model.moe.routing.freeze):
    # Imported here: the accounting builds the model's shapes (jax), the rest needs no model.
    from moejax.finetune import accounting  # pylint: disable=g-import-not-at-top
    from moejax.finetune.adapters import lora_param_count  # pylint: disable=g-import-not-at-top
    from moejax.train.optim import make_optimizer  # pylint: disable=g-import-not-at-top
    tx = make_optimizer(exp.train, exp.model, exp.finetune)
    acc = accounting.accounting(exp, params, tx)
    ft = exp.finetune
    total += lora_param_count(exp.model, ft.lora, ft.lora_rank) if ft.lora else 0
    trainable = acc.trainable
  return ArmBudget(total=total, active=float(b.active), active_max=float(b.active_max),
                   flops_per_token=float(b.flops_per_token), tokens=int(tokens),
                   optimizer=optimizer_string(exp), trainable=trainable,
                   source_tokens=None if src is None else int(src.tokens),
                   source_flops=None if src is None else float(src.flops),
                   **_declared_slots(exp, b))


def _declared_slots(exp: ExperimentConfig, b) -> dict:
  """The ArmBudget fields of what the router declares (empty without routed experts)."""
  moe = exp.model.moe
  routed = b.breakdown.get("routed_experts")
  if moe is None or routed is None or not moe.layer.routed:
    return {}
  slots, slots_max = moe.router.slots(moe)
  return dict(slots=float(slots), slots_max=float(slots_max),
              routed_active=float(routed.active), routed_flops=float(routed.flops))


def spread(values: Sequence[float]) -> float:
  """(max - min) / max, 0 for all-zero values."""
  hi, lo = max(values), min(values)
  return 0.0 if hi == 0 else (hi - lo) / abs(hi)


def check(budgets: Mapping[str, ArmBudget], fixed: Mapping[str, float],
          experiments: Mapping[str, ExperimentConfig] | None = None,
          exempt: Mapping[str, Sequence[str]] | None = None) -> list[str]:
  """Raises BudgetError listing every violation; returns the lines of what was checked.

  ``exempt``: ``{arm: quantities}`` left out of those quantities' check (reported).
  """
  errors, notes = [], []
  exempt = {a: tuple(qs) for a, qs in (exempt or {}).items()}
  held = [q for q in fixed]
  sourced = any(b.source_tokens is not None for b in budgets.values())
  quantities = ("total", "active", "flops_per_token", "tokens", "trainable", "optimizer") + (
      ("total_tokens", "compute") if sourced else ())
  notes.append("held equal: " + (", ".join(held) if held else "nothing") +
               "; not held: " + (", ".join(q for q in quantities if q not in fixed)
                                 or "nothing"))
  for q, tol in fixed.items():
    names = [n for n in budgets if q not in exempt.get(n, ())]
    out = [n for n in budgets if q in exempt.get(n, ())]
    if out and q != "optimizer":
      notes.append(f"{q}: exempt (reference arm{'s' if len(out) > 1 else ''}, not held equal): "
                   + ", ".join(f"{n} {human(float(getattr(budgets[n], q) or 0))}" for n in out))
    if len(names) < 2:
      continue
    if q == "optimizer":
      distinct = {budgets[n].optimizer for n in names}
      if len(distinct) > 1:
        errors.append("optimizer settings differ: " + "; ".join(
            f"{n}: {budgets[n].optimizer}" for n in names))
      else:
        notes.append("optimizer: identical")
      continue
    if any(getattr(budgets[n], q) is None for n in names):
      errors.append(f"{q}: not known for every arm")
      continue
    vals = {n: float(getattr(budgets[n], q)) for n in names}
    s = spread(list(vals.values()))
    lo = min(vals, key=vals.get)
    hi = max(vals, key=vals.get)
    line = (f"{q}: spread {100 * s:.2f}% (tolerance {100 * tol:.2f}%; min {lo} "
            f"{human(vals[lo])}, max {hi} {human(vals[hi])})")
    (errors if s > tol + 1e-12 else notes).append(line)
  if "trainable" not in fixed and any(b.trainable is not None and b.trainable != b.total
                                      for b in budgets.values()):
    notes.append("trainable (not held equal): " + ", ".join(
        f"{n} {human(float(b.trainable if b.trainable is not None else b.total))}"
        for n, b in budgets.items()))
  if experiments is not None:
    names = list(budgets)
    strip = lambda d: dataclasses.replace(d, loss_domains=())
    datas = {n: experiments[n].data for n in names}
    first = names[0]
    for n in names[1:]:
      if strip(datas[n]) != strip(datas[first]):
        errors.append(f"data differs between arms {first} and {n} (the data order must be "
                      "the same in every arm): set data.* in the base only")
    mixes = {n: datas[n].loss_domains for n in names}
    if len(set(mixes.values())) > 1:
      notes.append("data: same corpus and order; the scored domains (data.loss_domains) "
                   "differ: " + "; ".join(f"{n}: {', '.join(m) or 'all'}"
                                          for n, m in mixes.items()))
    else:
      notes.append("data: identical (same corpus and order)")
  if errors:
    raise BudgetError(
        "the arms are not at an equal budget; nothing was trained:\n  " + "\n  ".join(errors) +
        "\nFix: change the arms so that they match on what the suite holds fixed, or (if the "
        "difference is the point) widen suite.fixed.<quantity> / drop it and say why in the "
        "suite's description")
  return notes


def corpus_check(fingerprints: Mapping[str, Mapping | None]) -> list[str]:
  """Lines flagging labelled runs whose corpus fingerprints differ (none: one corpus)."""
  from moejax.data.fingerprint import mismatches  # pylint: disable=g-import-not-at-top
  return mismatches(fingerprints)


# The widest line the budget table prints (a terminal, a log viewer, a pasted issue).
TABLE_WIDTH = 100


def table(budgets: Mapping[str, ArmBudget], fixed: Mapping[str, float] = (),
          width: int = TABLE_WIDTH) -> str:
  """The budget table as aligned text, no line wider than ``width``; fixed quantities are
  marked with '*'.

  The optimizer string (about 90 characters) is written under the table, once
  when every arm has the same (the usual case, the check requires it when it is
  held fixed), else as a letter per arm and a line per letter. Numeric columns
  that do not fit beside each other continue in a second block below, the arm
  column repeated.
  """
  mark = lambda q: q + ("*" if q in fixed else "")
  sourced = any(b.source_tokens is not None for b in budgets.values())
  extra = ["source_tokens", mark("total_tokens"), mark("compute")] if sourced else []
  optimizers = list(dict.fromkeys(b.optimizer for b in budgets.values()))
  keys = {o: chr(ord("A") + i) for i, o in enumerate(optimizers)}
  declared = any(b.slots is not None for b in budgets.values())
  head = (["arm", mark("total"), mark("active"), "active_max", mark("flops_per_token"),
           mark("tokens"), "train_FLOPs"] + (["slots"] if declared else []) + extra
          + ([mark("optimizer")] if len(optimizers) > 1 else []))
  rows = [head]
  for n, b in budgets.items():
    more = ([human(b.source_tokens or 0), human(b.total_tokens), human(b.compute)]
            if sourced else [])
    rows.append([n, human(b.total), human(b.active), human(b.active_max),
                 human(b.flops_per_token), human(b.tokens), human(b.train_flops)]
                + ([slots_cell(b)] if declared else []) + more
                + ([keys[b.optimizer]] if len(optimizers) > 1 else []))
  lines = text_table(rows, width)
  if len(optimizers) == 1:
    lines += wrapped(f"{mark('optimizer')} (every arm): {optimizers[0]}", width)
  else:
    for o in optimizers:
      lines += wrapped(f"{mark('optimizer')} {keys[o]}: {o}", width)
  if declared:
    lines += wrapped("slots: FFN experts per token per MoE layer as the routers declare "
                     "them (RouterSpec.slots), expected/max; active counts the expected (top-p "
                     "its maximum k, expert choice its capacity, a plugin its own word); what "
                     "ran is compared after training", width)
  return "\n".join(lines)


def slots_cell(b: ArmBudget) -> str:
  """'expected/max' declared slots ('2/2'; '-' without routed experts)."""
  if b.slots is None:
    return "-"
  return f"{b.slots:.3g}/{b.slots_max:.3g}"


def from_dict(d: Mapping) -> ArmBudget:
  """The ArmBudget of a budget.json / result.json entry (derived keys dropped, older
  files' missing fields at their defaults)."""
  names = {f.name for f in dataclasses.fields(ArmBudget)}
  return ArmBudget(**{k: v for k, v in d.items() if k in names})


def text_table(rows: list[list[str]], width: int = TABLE_WIDTH) -> list[str]:
  """Aligned lines of ``rows`` (the first is the header), in blocks of whole columns that
  fit ``width``, each block led by the first column."""
  lines: list[str] = []
  for block in _column_blocks(rows, width):
    lines += ([""] if lines else []) + _aligned(block)
  return lines


def _column_blocks(rows: list[list[str]], width: int) -> list[list[list[str]]]:
  """``rows`` cut into blocks of whole columns that fit ``width``, each led by column 0."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  blocks, current = [], [0]
  for i in range(1, len(widths)):
    if current != [0] and sum(widths[j] + 2 for j in current) + widths[i] > width:
      blocks.append(current)
      current = [0]
    current.append(i)
  blocks.append(current)
  return [[[r[i] for i in cols] for r in rows] for cols in blocks]


def _aligned(rows: list[list[str]]) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  return lines


def wrapped(text: str, width: int) -> list[str]:
  return textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False)
