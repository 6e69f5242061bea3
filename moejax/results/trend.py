"""How a suite's differences move up the scale ladder (s -> m -> l).

A suite run at several rungs (``moejax.ablation.scale``) has one summary per
rung: ``results/SUITE.json`` (scale s) and ``results/SUITE@m.json``,
``SUITE@l.json``. The trend table puts each arm's difference to the baseline
side by side across the rungs, each with its 95% interval over seeds and
its verdict, and names the movement in words computed from the verdicts:

- ``holds``: resolved at both rungs, same direction;
- ``reverses``: resolved at both rungs, opposite directions;
- ``emerges``: unresolved at the smaller rung, resolved at the larger;
- ``fades``: resolved at the smaller rung, unresolved at the larger;
- ``unresolved``: unresolved at both (``same sign`` / ``sign flips`` says
  whether the point estimates at least agree; neither is evidence).

With more than two rungs the words compare the smallest and the largest.

A speed-up suite (``analysis.speedup_reference``, moejax.ablation.speedup)
adds a row per arm for its speed-up in steps to the reference's final loss:
the mean (95% interval over the seeds that reached it), how many seeds
reached it, and the verdict of the paired comparison with 1x; an arm that
never reached the loss says so. Its trend word is :func:`movement` where
both rungs have a comparison, otherwise the count of seeds that reached
the loss at each rung.
In RESULTS.md the block ``<!-- moejax:generated trend.SUITE -->`` renders
this table (moejax.results.report); it depends on the summaries alone.
"""

from __future__ import annotations

from typing import Mapping

from moejax.ablation.columns import METRICS
from moejax.ablation.tables import fmt

PREFIX = "trend."
RUNGS = ("s", "m", "l")
# The ladder compares what the suites are about; latency and volume are not verdict metrics.
TREND_METRICS = ("val_loss", "max_vio_global", "drop_rate", "specialisation_mi_norm",
                 "probe_leak_gap")
SPEEDUP = "speedup_steps"  # a speed-up suite's row (module doc)


def rung_ids(suite: str) -> dict[str, str]:
  """``{rung: results id}``: ``suite`` is rung s, ``suite@m`` / ``suite@l`` the others."""
  return {r: suite if r == "s" else f"{suite}@{r}" for r in RUNGS}


def movement(small: Mapping, large: Mapping) -> str:
  """The word for one metric's comparison at a smaller and a larger rung (module doc)."""
  vs, vl = small["verdict"], large["verdict"]
  ds, dl = small["diff"]["mean"], large["diff"]["mean"]
  if vs != "unresolved" and vl != "unresolved":
    return "holds" if (ds > 0) == (dl > 0) else "reverses"
  if vl != "unresolved":
    return "emerges"
  if vs != "unresolved":
    return "fades"
  return "unresolved, " + ("same sign" if (ds > 0) == (dl > 0) else "sign flips")


def _diff_cell(comp: Mapping | None) -> str:
  if comp is None:
    return "n/a"
  d = comp["diff"]
  iv = ("n/a" if d.get("lo") is None else f"[{d['lo']:+.3g}, {d['hi']:+.3g}]")
  verdict = comp["verdict"] if comp["verdict"] == "unresolved" else f"**{comp['verdict']}**"
  return f"{d['mean']:+.4g} {iv} ({d['n']}) {verdict}"


def _speedup_reach(summary: Mapping, arm: str) -> tuple[int, int, Mapping | None]:
  """(seeds that reached the reference loss, seeds, the speed-up metric or None) of ``arm``."""
  m = summary["arms"].get(arm, {}).get("metrics", {}).get(SPEEDUP)
  seeds = summary.get("seed_counts", {}).get(arm, 0)
  return (0 if m is None else m["interval"]["n"]), seeds, m


def _speedup_cell(summary: Mapping, arm: str) -> str:
  reached, seeds, m = _speedup_reach(summary, arm)
  if m is None:
    return f"never reached (0/{seeds} seeds)"
  iv = m["interval"]
  cell = f"{iv['mean']:.3g}x" + ("" if iv.get("lo") is None else f" [{iv['lo']:.3g}, {iv['hi']:.3g}]")
  comp = summary.get("comparisons", {}).get(arm, {}).get(SPEEDUP)
  verdict = "" if comp is None else (
      " " + (comp["verdict"] if comp["verdict"] == "unresolved" else f"**{comp['verdict']}**"))
  return f"{cell} ({reached}/{seeds} seeds reached){verdict}"


def _speedup_row(have: Mapping, rungs: list, arm: str) -> str:
  comps = [have[r].get("comparisons", {}).get(arm, {}).get(SPEEDUP) for r in rungs]
  if comps[0] is not None and comps[-1] is not None:
    word = movement(comps[0], comps[-1])
  else:
    word = "reached by " + " -> ".join(
        "{}/{}".format(*_speedup_reach(have[r], arm)[:2]) for r in (rungs[0], rungs[-1])) + " seeds"
  cells = " | ".join(_speedup_cell(have[r], arm) for r in rungs)
  return f"| {arm} | speed-up, steps | {cells} | {word} |"


def trend_markdown(suite: str, summaries: Mapping[str, Mapping]) -> str:
  """The trend table of ``suite`` from ``summaries`` (``{results id: summary}``).

  Rungs whose summary is missing are left out; with fewer than two rungs the
  table is a line saying which rung is missing, with the command that makes it.
  """
  ids = rung_ids(suite)
  have = {r: summaries[i] for r, i in ids.items() if i in summaries}
  for r, s in have.items():
    if s.get("scale", "s") != r:
      raise ValueError(f"results id {ids[r]!r} holds a run at scale "
                       f"{s.get('scale')!r}, not {r!r}")
  if len(have) < 2:
    missing = [r for r in RUNGS[:2] if r not in have]
    return (f"*No trend yet: {suite} has no summary at scale {', '.join(missing)}. Run "
            f"`python -m experiments.ablate --config=configs/ablations/{suite}.py "
            f"--config.scale=m --workdir=DIR` and `python -m experiments.report "
            f"{suite}@m=DIR --out RESULTS.md`.*\n")
  rungs = list(have)
  base = {have[r].get("baseline") for r in rungs}
  if len(base) != 1:
    raise ValueError(f"{suite}: the rungs name different baselines {sorted(base)}")
  base = base.pop()
  lines = [f"Differences to `{base}` (Δ, 95% interval over seeds (n), verdict) at each rung; "
           f"the last column compares {rungs[0]} with {rungs[-1]} (moejax.results.trend).", "",
           "| arm | metric | " + " | ".join(f"{r}: Δ vs {base}" for r in rungs) + " | trend |",
           "|---|---|" + "---|" * len(rungs) + "---|"]
  # The baseline's own level first: a difference means more next to what it differs from.
  for key in ("val_loss", "max_vio_global"):
    cells = []
    for r in rungs:
      m = have[r]["arms"].get(base, {}).get("metrics", {}).get(key)
      cells.append("n/a" if m is None else fmt(m["interval"]["mean"], key))
    if any(c != "n/a" for c in cells):
      lines.append(f"| {base} (level) | {METRICS[key][0]} | " + " | ".join(cells) + " | |")
  arms = [a for a in have[rungs[-1]].get("comparisons", {})
          if all(a in (have[r].get("comparisons") or {}) for r in rungs)]
  speedup = any(SPEEDUP in a.get("metrics", {}) or "speedup_note" in (a.get("notes") or {})
                for r in rungs for a in have[r]["arms"].values())
  for arm in arms:
    for key in TREND_METRICS:
      comps = [have[r]["comparisons"][arm].get(key) for r in rungs]
      if all(c is None for c in comps):
        continue
      word = (movement(comps[0], comps[-1]) if comps[0] is not None and comps[-1] is not None
              else "n/a")
      lines.append(f"| {arm} | {METRICS[key][0]} | " + " | ".join(map(_diff_cell, comps)) +
                   f" | {word} |")
    if speedup:
      lines.append(_speedup_row(have, rungs, arm))
  mdd = []
  for r in rungs:
    v = (have[r].get("mdd") or {}).get("val_loss")
    if v and v.get("value") is not None:
      mdd.append(f"{r} {fmt(v['value'])} ({v['seeds']} seeds)")
  if mdd:
    lines += ["", "Minimal detectable val-loss difference: " + ", ".join(mdd) + "."]
  dropped = [a for a in have[rungs[-1]].get("comparisons", {}) if a not in arms]
  if dropped:
    lines.append(f"Arms not at every rung (left out): {', '.join(dropped)}.")
  return "\n".join(lines) + "\n"
