"""The findings at a glance: every tested claim, our difference beside its size, at each rung.

A suite that states the effect it tests (``suite.effects``: the published
difference, or the smallest that would matter, with its source) contributes
one claim per compared arm and metric. RESULTS.md's block ``claims`` is the
table of them, one row per claim and one column per rung the suite was run
at (``s``, ``m``, ``bpe``, ...): the paired difference with its 95% interval
over seeds and the verdict (moejax.ablation.power: better / worse, *no
effect larger than X*, or unresolved with the seeds that would resolve it),
and the figure ``plots/claims/claims.png`` shows the same differences in
units of the tested size, so every claim reads on one axis: inside (-1, 1)
is smaller than the claim, beyond +-1 as large as it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from moejax.ablation import power
from moejax.ablation.columns import METRICS

CLAIMS = "claims"


def rows(summaries: Mapping[str, Mapping]) -> list[dict]:
  """One dict per (summary, arm, metric with an effect), in suite then rung order."""
  out = []
  for sid in sorted(summaries, key=lambda i: (i.partition("@")[0], i.partition("@")[2])):
    s = summaries[sid]
    effects = s.get("effects") or {}
    walls = [a["run_seconds"] for a in (s.get("arms") or {}).values() if "run_seconds" in a]
    # What one seed of the whole suite costs, at the wall time per run its machine measured.
    seed_s = len(s["arms"]) * sum(walls) / len(walls) if walls else None
    for arm, comp in (s.get("comparisons") or {}).items():
      for metric, spec in effects.items():
        e = comp.get(metric)
        if e is None:
          continue
        d, docs = e["diff"], e.get("documents") or {}
        out.append({"id": sid, "suite": s.get("suite") or sid.partition("@")[0],
                    "rung": sid.partition("@")[2] or "s", "arm": arm,
                    "baseline": e.get("baseline", s.get("baseline")), "metric": metric,
                    "diff": d["mean"], "lo": d.get("lo"), "hi": d.get("hi"),
                    "doc_lo": docs.get("lo"), "doc_hi": docs.get("hi"),
                    "effect": spec["size"], "source": spec["source"],
                    "verdict": power.verdict_text(e), "seeds": d.get("n"),
                    "cost_s": (e["seeds_needed"] * seed_s
                               if seed_s and e.get("seeds_needed") else None)})
  return out


def _duration(seconds: float) -> str:
  minutes = seconds / 60
  if minutes < 90:
    return f"~{max(5, round(minutes / 5) * 5):.0f} min"
  return f"~{minutes / 60:.0f} h" if minutes < 60 * 48 else f"~{minutes / 60 / 24:.0f} days"


def _short(verdict: str, cost_s: Optional[float] = None, seeds: Optional[int] = None) -> str:
  if verdict.startswith("no effect larger than"):
    return "no effect > " + verdict.rsplit(" ", 1)[1]
  if verdict.startswith("unresolved ("):
    need = verdict[len("unresolved ("):].split(" ", 1)[0]
    if seeds and need.isdigit() and int(need) <= seeds:
      # Seeds enough to resolve a true effect of the tested size, and yet unresolved: the
      # effect is likely smaller, and only more seeds would bound it.
      return f"unresolved at {seeds} seeds, which had 80% power for the tested size"
    cost = f" ({_duration(cost_s)})" if cost_s else ""
    return "unresolved, " + need + " seeds would do" + cost
  return verdict


def _cell(r: Optional[Mapping]) -> str:
  if r is None:
    return ""
  iv = "" if r["lo"] is None else f" [{r['lo']:+.2g}, {r['hi']:+.2g}]"
  word = _short(r["verdict"], r.get("cost_s"), r.get("seeds"))
  return f"{r['diff']:+.3g}{iv} {'**' + word + '**' if word in ('better', 'worse') else word}"


def markdown(summaries: Mapping[str, Mapping], states: Optional[Mapping[str, str]] = None) -> str:
  """The claims table (module doc); a line saying so when no summary states an effect.
  ``states``: ``{id: freshness state}`` (moejax.results.report.block_state); blocks that
  are not current are named under the table."""
  got = rows(summaries)
  if not got:
    return ("*No claims yet: no committed summary states the effect it tests (suite.effects; "
            "`python -m experiments.report --effects --out RESULTS.md --results_dir results`).*\n")
  rungs = sorted({r["rung"] for r in got}, key=lambda x: (x != "s", x))
  keyed: dict = {}
  for r in got:
    keyed.setdefault((r["suite"], r["arm"], r["baseline"], r["metric"]), {})[r["rung"]] = r
  lines = ["| suite: arm vs baseline | metric | tested size | "
           + " | ".join(f"at {x}" for x in rungs) + " |",
           "|---|---|---:|" + "---|" * len(rungs)]
  for (suite, arm, base, metric), by_rung in keyed.items():
    size = next(iter(by_rung.values()))["effect"]
    lines.append(f"| {suite}: {arm} vs {base} | {METRICS[metric][0]} | {size:.3g} | "
                 + " | ".join(_cell(by_rung.get(x)) for x in rungs) + " |")
  sources = {}
  for r in got:
    sources.setdefault((r["suite"], r["metric"]), r["source"])
  notes = [f"- {suite}, {METRICS[m][0]}: {src}" for (suite, m), src in sources.items()]
  old = sorted({f"{r['id']} ({states[r['id']]})" for r in got
                if states and states.get(r["id"], "current") != "current"})
  warn = (f"\n\n**Not current** (their numbers may not come out of the current code; see "
          f"their sections): {', '.join(old)}." if old else "")
  return ("\n".join(lines) + warn + "\n\nEach cell: arm - baseline, its 95% interval over "
          "seeds, and the verdict against the tested size; after the seeds that would resolve "
          "it, what the whole suite costs at that many seeds (its measured wall time per run, "
          "one run at a time). Where the sizes come from:\n\n"
          + "\n".join(notes) + "\n")


def pseudo_summary(summaries: Mapping[str, Mapping]) -> dict:
  """What the claims figure is drawn from (a summary-shaped dict for moejax.results.images)."""
  return {"arms": {}, "claims": [{k: r[k] for k in ("id", "arm", "metric", "diff", "lo", "hi",
                                                     "effect", "verdict")}
                                 for r in rows(summaries)]}


def plot_claims(data: Mapping):
  """Every claim's difference in units of its tested size, with its interval over seeds."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  claims = data["rows"]
  fig, ax = plt.subplots(figsize=(8, 0.28 * len(claims) + 1.4))
  for i, r in enumerate(claims):
    y = len(claims) - 1 - i
    x = r["diff"] / r["effect"]
    word = r["verdict"]
    color = {"better": "tab:green", "worse": "tab:red"}.get(
        word, "tab:blue" if word.startswith("no effect") else "0.45")
    if r["lo"] is not None:
      ax.plot([r["lo"] / r["effect"], r["hi"] / r["effect"]], [y, y], color=color, lw=1.5)
    ax.plot([x], [y], "o", color=color, ms=4)
  # Linear inside +-1 (the claims' own size), logarithmic beyond: drop rates 30x their
  # size and a bounded 0.003 share one readable axis.
  ax.set_xscale("symlog", linthresh=1.0)
  ax.axvline(0, color="black", lw=0.8)
  for v in (-1, 1):
    ax.axvline(v, color="0.6", lw=0.8, ls="--")
  ax.set_ylim(-0.7, len(claims) - 0.3)
  ax.set_yticks(range(len(claims)))
  ax.set_yticklabels([f"{r['id']}: {r['arm']}, {METRICS[r['metric']][0]}"
                      for r in reversed(claims)], fontsize=7)
  ax.set_xlabel("arm - baseline in units of the tested size (dashed: +-1; log beyond), "
                "95% over seeds")
  ax.set_title("Claims at a glance (green better, red worse, blue bounded, grey unresolved)",
               fontsize=9)
  fig.tight_layout()
  return fig


def claims_plot_data(summary: Mapping) -> Optional[dict]:
  """The figure's data from :func:`pseudo_summary` (None when there is no claim)."""
  return {"rows": summary["claims"]} if summary.get("claims") else None
