"""A suite summary as text for a terminal, no line wider than 100 columns.

What ``experiments.compare`` prints by default and ``experiments.ablate``
prints at the end of a suite. The markdown tables (:mod:`moejax.ablation.tables`:
``summary.md``, RESULTS.md, ``compare --markdown``) put every metric of an
arm on one row and every comparison with its intervals, verdict and reason
on another, which runs to 150-250 columns; here each arm is a header line
(seeds and budget) and one line per metric (here at 92 columns)::

    bias: 3 seeds; 1.00M params, 100.00K active, 220.00K FLOPs/token, 300.00K tokens
      val loss       2.080 ± 0.025  Δ -0.020  seeds [-0.045, +0.005] (3)  docs [-0.030, -0.010]
                                    unresolved
          why unresolved: the seed interval includes 0
      MaxVio global  0.150 ± 0.083  Δ -0.26  seeds [-0.41, -0.11] (3)  better

the value is mean ± half-width over seeds, Δ the difference to the
baseline with its interval over paired seeds (n) and, for the validation
loss, over documents, then the verdict; pieces that do not fit continue
under Δ, and the reason of an unresolved verdict, the notes and the
provenance are wrapped. The numbers are the markdown's strings (the same
helpers round them), so both read alike.
"""

from __future__ import annotations

import textwrap
from typing import Mapping

from moejax.ablation import budget as budget_lib
from moejax.ablation import power, realised, tables
from moejax.ablation.columns import (ARM_COLUMNS, METRICS, SPEEDUP_COLUMNS, VERDICT_METRICS,
                                     balance_loss_keys, metric_info, present,
                                     skip_constant_zero)
from moejax.topology.accounting import human

WIDTH = budget_lib.TABLE_WIDTH
# The markdown tables' number formatting: a number reads the same in both.
# pylint: disable=protected-access
_cell, _half, _interval, _signed = tables._cell, tables._half, tables._interval, tables._signed
# pylint: enable=protected-access
# Widest metric name and value the columns are sized to; a longer one pushes its line.
NAME_MAX, VALUE_MAX = 26, 18
LEGEND = ("values: mean ± half-width of the 95% interval over seeds; Δ: arm - baseline, "
          "seeds: its 95% interval over paired seeds (n), docs: over documents (validation "
          "loss); active: parameters per token. Statistics: docs/ablations.md.")
BALANCE_LEGEND = ("balance <loss>: coefficient x loss, summed over MoE layers; mean over the "
                  "second half of training.")


def wrap(text: str, width: int = WIDTH, indent: str = "", subsequent: str = "    ") -> list[str]:
  """``text`` in lines of at most ``width`` columns (an empty text: one empty line)."""
  return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=subsequent,
                       break_on_hyphens=False) or [indent.rstrip()]


def pack(head: str, pieces: list[str], indent: int, width: int = WIDTH) -> list[str]:
  """``head`` followed by ``pieces`` two spaces apart, a piece that would pass ``width``
  starting a line of its own, ``indent`` columns in (a piece wider than a line is wrapped)."""
  lines, line = [], head
  for piece in pieces:
    joined = f"{line}  {piece}" if line.strip() else line + piece
    if len(joined) <= width:
      line = joined
      continue
    lines.append(line.rstrip())
    line = " " * indent + piece
    if len(line) > width:
      *done, line = wrap(piece, width, " " * indent, " " * indent)
      lines += done
  return lines + [line.rstrip()]


def metric_keys(summary: Mapping) -> list[str]:
  """The metrics shown per arm: the arms table's columns, the speed-up columns, the
  balance losses, then any other compared metric."""
  keys = skip_constant_zero(summary, present(summary, ARM_COLUMNS))
  if present(summary, ("speedup_steps", "steps_to_reference")):
    keys += [k for k in present(summary, SPEEDUP_COLUMNS) if k not in keys]
  keys += balance_loss_keys(k for a in summary["arms"].values() for k in a["metrics"])
  compared = {k for comp in (summary.get("comparisons") or {}).values() for k in comp}
  return keys + [k for k in VERDICT_METRICS if k in compared and k not in keys]


def title(key: str) -> str:
  name = metric_info(key)[0]
  return name if key in METRICS else f"balance {name}"


def arm_header(summary: Mapping, name: str, width: int = WIDTH) -> list[str]:
  """'<arm>[ (baseline) | (Δ vs <other arm>)]: <n> seed(s); <budget>', wrapped."""
  a = summary["arms"][name]
  b = a.get("budget") or {}
  n = len(a["seeds"])
  parts = [f"{tables.fmt(b[k], 'total')} {what}"
           for k, what in (("total", "params"), ("trainable", "trainable"),
                           ("active", "active"), ("flops_per_token", "FLOPs/token"),
                           ("tokens", "tokens"))
           if b.get(k) is not None and not (k == "trainable" and b[k] == b.get("total"))]
  if b.get("compute") is not None:  # charged its source's training (tables.arms_table)
    parts.append(f"incl. source: {human(float(b.get('total_tokens', b.get('tokens')) or 0))} "
                 f"tokens, {human(float(b['compute']))} train FLOPs")
  others = {e["baseline"] for e in ((summary.get("comparisons") or {}).get(name) or {}).values()
            if e.get("baseline")}
  label = (f"{name} (baseline)" if name == summary.get("baseline")
           else f"{name} (Δ vs {', '.join(sorted(others))})" if others else name)
  text = f"{label}: {n} seed{'' if n == 1 else 's'}" + ("; " + ", ".join(parts) if parts else "")
  return wrap(text, width)


def comparison_pieces(key: str, e: Mapping) -> list[str]:
  """Δ, its interval over seeds (n), over documents for the validation loss, the verdict."""
  d = e["diff"]
  p = tables.places(_half(d), d["mean"])
  pieces = [f"Δ {_signed(d['mean'], p)}",
            f"seeds {_interval(d)} ({d['n']}{'' if e['pairing'] == 'paired' else ', unpaired'})"]
  if key == "val_loss":
    pieces.append(f"docs {_interval(e.get('documents'))}")
  return pieces + [power.verdict_text(e)]


def metric_lines(summary: Mapping, name: str, key: str, cols: tuple[int, int],
                 width: int = WIDTH) -> list[str]:
  """One metric of one arm: name, value, comparison pieces; the reason of an unresolved
  verdict under it ([] when the arm has neither the metric nor a comparison of it)."""
  metric = summary["arms"][name]["metrics"].get(key)
  entry = ((summary.get("comparisons") or {}).get(name) or {}).get(key)
  if metric is None and entry is None:
    return []
  head = f"  {title(key):<{cols[0]}}  {_cell(metric, key):<{cols[1]}}"
  if entry is None:
    return [head.rstrip()]
  lines = pack(head, comparison_pieces(key, entry), 2 + cols[0] + 2 + cols[1] + 2, width)
  if entry.get("reason"):
    lines += wrap(f"why unresolved: {entry['reason']}", width, " " * 6, " " * 8)
  return lines


def _columns(summary: Mapping, keys: list[str]) -> tuple[int, int]:
  names = [len(title(k)) for k in keys]
  values = [len(_cell(a["metrics"][k], k))
            for a in summary["arms"].values() for k in keys if k in a["metrics"]]
  return min(max(names, default=0), NAME_MAX), min(max(values, default=3), VALUE_MAX)


def arm_lines(summary: Mapping, width: int = WIDTH) -> list[str]:
  """Every arm: its header and a line per metric."""
  keys = metric_keys(summary)
  cols = _columns(summary, keys)
  lines = []
  for name in summary["arms"]:
    lines += arm_header(summary, name, width)
    for key in keys:
      lines += metric_lines(summary, name, key, cols, width)
  return lines


def realised_lines(summary: Mapping, width: int = WIDTH) -> list[str]:
  """The budget of what ran (moejax.ablation.realised) as text; [] when not recorded."""
  if not realised.markdown(summary):
    return []
  budgets = {}
  for n, a in summary["arms"].items():
    try:
      budgets[n] = budget_lib.from_dict(a.get("budget") or {})
    except TypeError:
      continue
  return (["budget of what ran (realised FFN experts per token, mean over seeds):"]
          + realised.table(budgets, realised.from_summary(summary), width).splitlines())


def body_lines(summary: Mapping, width: int = WIDTH) -> list[str]:
  """The legend, the arms, the minimal detectable difference and the notes."""
  lines = wrap(LEGEND, width)
  if balance_loss_keys(k for a in summary["arms"].values() for k in a["metrics"]):
    lines += wrap(BALANCE_LEGEND, width)
  lines += [""] + arm_lines(summary, width)
  mdd = tables.mdd_line(summary)
  if mdd:
    lines += [""] + wrap(mdd, width)
  notes = tables.notes(summary)
  if notes:
    lines += ["", "notes:"] + [w for n in notes for w in wrap(n, width, subsequent="    ")]
  return lines


def suite_lines(summary: Mapping, width: int = WIDTH) -> list[str]:
  """A suite's summary: title, description, provenance, the budget of what ran and
  :func:`body_lines` (``summary.md`` as text; the plots are listed by the runner)."""
  lines = [f"suite {summary.get('suite', '')}".rstrip()]
  if summary.get("description"):
    lines += wrap(summary["description"], width)
  lines += [w for p in tables.provenance_lines(summary) for w in wrap(p, width)]
  real = realised_lines(summary, width)
  return lines + ([""] + real if real else []) + [""] + body_lines(summary, width)


def render(summary: Mapping, width: int = WIDTH, whole: bool = True) -> str:
  """:func:`suite_lines` (``whole``) or :func:`body_lines` joined."""
  return "\n".join(suite_lines(summary, width) if whole else body_lines(summary, width))


def flag_lines(text: str, width: int = WIDTH, lead: str = "  ! ") -> list[str]:
  """A flag line (budget or corpus mismatch) wrapped under its ``lead``."""
  return wrap(text, width, lead, " " * (len(lead) + 2))
