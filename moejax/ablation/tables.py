"""Markdown tables of a summary dict (:mod:`moejax.ablation.summary`).

One renderer for every place a suite's numbers appear: the suite's
``summary.md``, ``experiments.compare`` and the generated blocks of
RESULTS.md (``experiments.report``). The output depends on the summary
dict alone, so RESULTS.md's tables can be regenerated from the committed
``results/*.json`` and compared byte for byte.

Cells: ``mean ± h`` where h is the half-width of the 95% Student t interval
over the arm's seeds (just the mean with one seed); differences are
arm - baseline with their 95% intervals over paired seeds and, for the
validation loss, over documents (bootstrap). A number with an interval is
rounded to what the interval supports: the decimal place of the
half-width's second significant digit (:func:`places`), so a difference of
-0.002926 in [-0.009414, +0.003562] reads -0.0029 [-0.0094, +0.0036]; a
number without one keeps 4 significant digits. The JSON keeps full
precision.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from moejax.ablation.columns import (ARM_COLUMNS, BUDGET_KEYS, METRICS, NOTE_KEYS,
                                     SPEEDUP_COLUMNS, VERDICT_METRICS, balance_loss_keys,
                                     metric_info, present, skip_constant_zero)
from moejax.ablation import power
from moejax.ablation import realised
from moejax.ablation.scale import get_scale
from moejax.topology.accounting import human

_HUMAN = ("total", "active", "flops_per_token", "tokens", "a2a_bytes_per_token")


def fmt(v: Optional[float], key: str = "") -> str:
  if v is None:
    return "n/a"
  if key in _HUMAN:
    return human(v)
  return f"{v:.4g}" if abs(v) < 1e4 else human(v)


# Digits a rounded number keeps at most, however narrow its interval.
MAX_SIGNIFICANT = 6


def places(half_width: Optional[float], value: float) -> Optional[int]:
  """Decimal places that show ``half_width`` to two significant digits (None: no interval,
  or a zero-width one), so that ``value`` is not printed more precisely than it is known;
  at most :data:`MAX_SIGNIFICANT` significant digits of ``value``."""
  if not half_width or not math.isfinite(half_width):
    return None
  p = 1 - math.floor(math.log10(abs(half_width)))
  if value:
    p = min(p, MAX_SIGNIFICANT - 1 - math.floor(math.log10(abs(value))))
  return max(p, 0)


def _signed(v: float, p: Optional[int] = None) -> str:
  return f"{v:+.4g}" if p is None else f"{v:+.{p}f}"


def _half(iv: Optional[Mapping]) -> Optional[float]:
  return None if not iv or iv.get("lo") is None else (iv["hi"] - iv["lo"]) / 2


def _interval(iv: Optional[Mapping]) -> str:
  if not iv or iv.get("lo") is None:
    return "n/a"
  p = places(_half(iv), max(abs(iv["lo"]), abs(iv["hi"])))
  return f"[{_signed(iv['lo'], p)}, {_signed(iv['hi'], p)}]"


def _cell(metric: Optional[Mapping], key: str) -> str:
  if metric is None:
    return "n/a"
  iv = metric["interval"]
  half = _half(iv)
  p = None if key in _HUMAN or abs(iv["mean"] or 0) >= 1e4 else places(half, iv["mean"] or 0)
  s = fmt(iv["mean"], key) if p is None or iv["mean"] is None else f"{iv['mean']:.{p}f}"
  if half is not None:
    s += f" ± {half:.2g}"
  return s


def _has_trainable(summary: Mapping) -> bool:
  """Whether some arm trains fewer parameters than it has (fine-tuning: the trainable column)."""
  return any(a["budget"].get("trainable") not in (None, a["budget"].get("total"))
             for a in summary["arms"].values())


def _has_source_compute(summary: Mapping) -> bool:
  """Whether some arm is charged its source's training (moejax.ablation.budget)."""
  return any(a["budget"].get("compute") is not None for a in summary["arms"].values())


def arms_table(summary: Mapping) -> str:
  base = summary.get("baseline")
  cols = skip_constant_zero(summary, present(summary, ARM_COLUMNS))
  trainable = _has_trainable(summary)
  sourced = _has_source_compute(summary)
  head = (["arm", "seeds", "total params"] + (["trainable"] if trainable else [])
          + ["active/token"] + (["tokens incl. source", "train FLOPs incl. source"]
                                if sourced else []) + [METRICS[k][0] for k in cols])
  lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
  for name, a in summary["arms"].items():
    label = f"{name} (baseline)" if name == base else name
    cells = [label, str(len(a["seeds"])), fmt(a["budget"].get("total"), "total")]
    if trainable:
      cells.append(fmt(a["budget"].get("trainable"), "total"))
    cells += [fmt(a["budget"].get("active"), "active")]
    if sourced:
      b = a["budget"]
      cells += [human(float(b.get("total_tokens", b.get("tokens")) or 0)),
                human(float(b.get("compute", 3.0 * b["flops_per_token"] * b["tokens"])))]
    cells += [_cell(a["metrics"].get(k), k) for k in cols]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def balance_loss_table(summary: Mapping) -> str:
  """Each balance loss in the arms' objectives (empty when no run logged one)."""
  cols = balance_loss_keys(k for a in summary["arms"].values() for k in a["metrics"])
  if not cols:
    return ""
  head = ["arm"] + [f"`{metric_info(k)[0]}`" for k in cols]
  lines = ["Balance losses (coefficient x loss, summed over MoE layers; mean over the second "
           "half of training):", "", "| " + " | ".join(head) + " |",
           "|---|" + "---:|" * len(cols)]
  for name, a in summary["arms"].items():
    lines.append("| " + " | ".join([name] + [_cell(a["metrics"].get(k), k) for k in cols]) + " |")
  return "\n".join(lines)


def speedup_table(summary: Mapping) -> str:
  """Steps and time to the reference's loss, speed-ups and tokens/s (empty without them)."""
  if not present(summary, ("speedup_steps", "steps_to_reference")):
    return ""
  cols = present(summary, SPEEDUP_COLUMNS)
  head = ["arm", "seeds"] + [METRICS[k][0] for k in cols]
  lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
  for name, a in summary["arms"].items():
    lines.append("| " + " | ".join([name, str(len(a["seeds"]))] +
                                   [_cell(a["metrics"].get(k), k) for k in cols]) + " |")
  return "\n".join(lines)


def comparison_table(summary: Mapping) -> str:
  comps = summary.get("comparisons") or {}
  if not comps:
    return ""
  paired = bool(summary.get("compare_to"))   # arms compared with arms other than the baseline
  if paired:
    lines = ["| arm | vs | metric | {d} | 95% over seeds (n) | 95% over documents | verdict "
             "| why unresolved |".format(d=chr(916)), "|---|---|---|---:|---|---|---|---|"]
  else:
    lines = [f"| arm | metric | {chr(916)} vs {summary['baseline']} | 95% over seeds (n) "
             "| 95% over documents | verdict | why unresolved |",
             "|---|---|---:|---|---|---|---|"]
  for name, comp in comps.items():
    for key in VERDICT_METRICS:
      if key not in comp:
        continue
      e = comp[key]
      d = e["diff"]
      seeds = _interval(d) + f" ({d['n']}{'' if e['pairing'] == 'paired' else ', unpaired'})"
      docs = _interval(e.get("documents")) if key == "val_loss" else ""
      verdict = power.verdict_text(e)
      verdict = verdict if verdict.startswith("unresolved") else f"**{verdict}**"
      vs = f" {e.get('baseline', summary['baseline'])} |" if paired else ""
      p = places(_half(d), d["mean"])
      lines.append(f"| {name} |{vs} {METRICS[key][0]} | {_signed(d['mean'], p)} | {seeds} | {docs} "
                   f"| {verdict} | {e.get('reason', '')} |")
  return "\n".join(lines)


def mdd_line(summary: Mapping) -> str:
  mdd = summary.get("mdd") or {}
  if not mdd:
    return ""
  parts = [f"{METRICS[k][0]} {fmt(v['value']) if v['value'] is not None else 'n/a (one seed)'}"
           for k, v in mdd.items()]
  n = next(iter(mdd.values()))["seeds"]
  return (f"Minimal detectable difference at {n} seed(s) (half-width of the pooled paired "
          f"95% interval; smaller true differences stay unresolved): " + ", ".join(parts) + ".")


def provenance_lines(summary: Mapping) -> list[str]:
  p = summary.get("provenance") or {}
  join = lambda xs: ", ".join(f"`{x}`" for x in xs) if xs else "unknown"
  dates = p.get("dates") or []
  when = "unknown" if not dates else (dates[0] if dates[0] == dates[-1]
                                      else f"{dates[0]} .. {dates[-1]}")
  corpus = summary.get("corpus") or {}
  lines = [f"- command: {join(p.get('commands'))}",
           f"- commit {join(p.get('commits'))}; date {when}; machine "
           f"{', '.join(p.get('machines') or ['unknown'])}; jax "
           f"{', '.join(p.get('jax_versions') or ['unknown'])}; Python "
           f"{', '.join(p.get('python_versions') or ['unknown'])}",
           f"- corpus: {join(corpus.get('ids'))}"]
  if summary.get("scale"):  # summaries written before the scale ladder have none
    lines.append(f"- scale: {summary['scale']} ({get_scale(summary['scale']).describe()}; "
                 "moejax.ablation.scale)")
  if p.get("runs_without_provenance"):
    lines.append(f"- {p['runs_without_provenance']} of {p['runs']} runs recorded no provenance")
  for rec in p.get("plugins") or ():  # ideas registered from outside moejax
    ideas = ", ".join(f"{i['registry']} `{i['name']}`" for i in rec.get("ideas", ()))
    lines.append(f"- plugin `{rec['module']}` ({ideas}): sha256 "
                 f"`{(rec.get('sha256') or 'unknown')[:12]}`, {rec.get('file') or 'no file'}")
  lines += [f"- ! {line}" for line in p.get("plugin_flags") or ()]
  return lines


def notes(summary: Mapping) -> list[str]:
  out = []
  for key, note in NOTE_KEYS:
    by_text: dict[str, list[str]] = {}
    for name, a in summary["arms"].items():
      text = a.get("notes", {}).get(note)
      if text:
        by_text.setdefault(text, []).append(name)
    title = METRICS.get(key, (key,))[0]
    out += [f"- {title} ({', '.join(arms)}): {text}" for text, arms in by_text.items()]
  counts = summary.get("seed_counts") or {}
  if len(set(counts.values())) > 1:
    out.append("- seed counts differ (" + ", ".join(f"{k}: {v}" for k, v in counts.items()) +
               "): each interval uses its own seeds; differences pair the common seeds, or "
               "are unpaired (Welch) where fewer than two are common")
  out += [f"- ! {line}" for line in (summary.get("corpus") or {}).get("flags", [])]
  out += [f"- ! budget: {line}" for line in summary.get("budget_flags", [])]
  for arm, qs in (summary.get("exempt") or {}).items():
    out.append(f"- budget: {arm} is a reference arm, exempt from the fixed "
               f"{', '.join(qs)} (not held equal)")
  opts = {a["budget"].get("optimizer") for a in summary["arms"].values()}
  if len(opts) == 1 and None not in opts:
    out.append(f"- optimizer: {opts.pop()}")
  return out


def section_markdown(summary: Mapping) -> str:
  """The generated part of one RESULTS.md section (and of summary.md)."""
  parts = ["\n".join(provenance_lines(summary)), arms_table(summary)]
  for extra in (realised.markdown(summary), balance_loss_table(summary), speedup_table(summary),
                comparison_table(summary), mdd_line(summary)):
    if extra:
      parts.append(extra)
  n = notes(summary)
  if n:
    parts.append("Notes:\n\n" + "\n".join(n))
  return "\n\n".join(parts) + "\n"


def suite_markdown(summary: Mapping) -> str:
  title = f"# suite {summary.get('suite', '')}".rstrip()
  head = [title, ""]
  if summary.get("description"):
    head += [summary["description"], ""]
  head.append("Cells: mean ± half-width of the 95% interval over seeds; "
              f"{chr(916)}: arm - baseline (paired over seeds). Statistics: docs/ablations.md.")
  return "\n".join(head) + "\n\n" + section_markdown(summary)


def budget_table(summary: Mapping) -> str:
  """total / active / FLOPs / tokens per label (compare's first table)."""
  lines = ["| " + " | ".join(["label"] + [t for _, t in BUDGET_KEYS]) + " |",
           "|---|" + "---:|" * len(BUDGET_KEYS)]
  for name, a in summary["arms"].items():
    lines.append("| " + " | ".join([name] + [fmt(a["budget"].get(k), k)
                                             for k, _ in BUDGET_KEYS]) + " |")
  return "\n".join(lines)
