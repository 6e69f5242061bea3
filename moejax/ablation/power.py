"""Resolve or bound: the effect a comparison tests, the seeds that would settle it.

Legend: n paired seeds, s_d the standard deviation of the per-seed differences
d_s = x_s(arm) - x_s(baseline), X the effect size a suite tests (the published
difference, or the smallest that would matter), h the half-width of the
paired interval, t_{q, df} Student t quantiles.

**Bounded** (:func:`bound`): a comparison that does not resolve is still a
finding when its interval lies inside (-X, X): *no effect larger than X*.
For the validation loss both the seed and the document intervals must lie
inside, as both must exclude zero for a resolved verdict
(moejax.ablation.stats).

**Seeds for 80% power** (:func:`seeds_needed`): with a true difference of X,
the paired t statistic T = mean(d) / (s_d / sqrt(n)) follows a noncentral t
with n - 1 degrees of freedom and noncentrality X sqrt(n) / s_d; the
interval excludes zero when |T| > t_{0.975, n-1}, with probability

    power(n) = P(T > t_{0.975, n-1}) + P(T < -t_{0.975, n-1}).

The seeds needed are the least n >= 2 with power(n) >= 0.8 (at large n,
X of about 2.8 s_d / sqrt(n), i.e. 1.4 h). Each arm is planned from its own
pilot s_d, because its own paired interval decides its verdict; a pooled
spread (the MDD of moejax.ablation.stats) would understate what an arm with
a wider spread needs.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import scipy.stats

from moejax.ablation import stats

POWER = 0.8
MAX_SEEDS = 1000


def power(n: int, sd: float, effect: float, level: float = stats.LEVEL) -> float:
  """Probability that the paired interval of ``n`` seeds excludes zero when the true
  difference is ``effect`` and the per-seed differences spread by ``sd``."""
  if n < 2:
    return 0.0
  if sd <= 0:
    return 1.0
  df = n - 1
  crit = stats.t_quantile(df, level)
  ncp = abs(effect) * math.sqrt(n) / sd
  dist = scipy.stats.nct(df, ncp)
  p = float(dist.sf(crit) + dist.cdf(-crit))
  if not math.isfinite(p):  # scipy's nct fails far in the tail, where the answer is certain
    p = 1.0 if ncp > crit else 0.0
  return p


def seeds_needed(sd: Optional[float], effect: float, target: float = POWER,
                 level: float = stats.LEVEL) -> Optional[int]:
  """The least seed count whose paired interval resolves a true ``effect`` with probability
  ``target`` (see the module doc); None without a spread to plan from."""
  if sd is None or not math.isfinite(sd) or effect <= 0:
    return None
  n = 2
  while n <= MAX_SEEDS and power(n, sd, effect, level) < target:
    n += 1
  return n if n <= MAX_SEEDS else None


def inside(iv: Optional[stats.Interval], effect: float) -> bool:
  """The interval lies strictly inside (-effect, effect)."""
  return iv is not None and iv.lo is not None and -effect < iv.lo and iv.hi < effect


def bound(effect: float, *intervals: Optional[stats.Interval]) -> bool:
  """Every given interval (the seed one, and the document one for the validation loss)
  lies inside (-effect, effect): no effect larger than ``effect`` (module doc)."""
  given = [iv for iv in intervals if iv is not None]
  return bool(given) and all(inside(iv, effect) for iv in given)


def bound_words(effect: float) -> str:
  return f"no effect larger than {effect:.3g}"


def annotate(summary: dict, effects: Mapping[str, Mapping]) -> dict:
  """Adds to every comparison of ``summary`` on a metric of ``effects`` the effect size it
  is judged against (``effect``), whether an unresolved one is bounded by it
  (``bounded``) and the seeds its own spread needs to resolve it (``seeds_needed``: None
  without a spread); ``summary["effects"]`` keeps the sizes and their sources. Returns it."""
  if not effects:
    return summary
  summary["effects"] = {k: dict(v) for k, v in effects.items()}
  for comp in (summary.get("comparisons") or {}).values():
    for metric, entry in comp.items():
      if metric not in effects:
        continue
      size = float(effects[metric]["size"])
      seed_iv = stats.Interval.from_dict(entry["diff"])
      docs = entry.get("documents")
      doc_iv = stats.Interval.from_dict(docs) if docs else None
      entry["effect"] = size
      entry["bounded"] = (entry["verdict"] == stats.UNRESOLVED
                          and bound(size, seed_iv, doc_iv))
      entry["seeds_needed"] = (seeds_needed(seed_iv.sd, size)
                               if entry["pairing"] == "paired" else None)
  return summary


def verdict_text(entry: Mapping) -> str:
  """A comparison's verdict in words: resolved, bounded, or unresolved with the seeds that
  would resolve an effect of the suite's size."""
  word = entry["verdict"]
  if word != stats.UNRESOLVED or "effect" not in entry:
    return word
  if entry.get("bounded"):
    return bound_words(entry["effect"])
  need = entry.get("seeds_needed")
  if need is None:
    return f"unresolved (no spread to plan {entry['effect']:.3g} from)"
  return f"unresolved ({need} seeds resolve {entry['effect']:.3g})"


def pilot_id(suite) -> str:
  """The committed summary a suite plans from: ``results/NAME.json`` (``NAME@m`` at m)."""
  from moejax.ablation import scale as scale_lib  # pylint: disable=g-import-not-at-top
  return suite.name if suite.scale == scale_lib.DEFAULT_SCALE else f"{suite.name}@{suite.scale}"


def plan(suite, pilot: Mapping) -> tuple[list[dict], tuple[Optional[float], str]]:
  """Per (arm, metric with an effect): the pilot's spread, the seeds that resolve the effect
  with 80% power by that arm's own paired interval, and the suite's seeds now; plus
  (seconds one run costs, what that figure counts): the pilot's measured wall time per run,
  else its training alone at its tokens/s (summaries before wall times were kept)."""
  rows = []
  for arm, comp in (pilot.get("comparisons") or {}).items():
    for metric, spec in suite.effects.items():
      entry = comp.get(metric)
      sd = entry["diff"].get("sd") if entry and entry.get("pairing") == "paired" else None
      rows.append({"arm": arm, "metric": metric, "effect": spec["size"], "sd": sd,
                   "pilot_seeds": entry["diff"]["n"] if entry else 0,
                   "needed": seeds_needed(sd, spec["size"]),
                   "power_now": (power(len(suite.seeds), sd, spec["size"])
                                 if sd is not None else None)})
  walls = [a["run_seconds"] for a in (pilot.get("arms") or {}).values() if "run_seconds" in a]
  if walls:
    return rows, (sum(walls) / len(walls), "wall time per run as the pilot measured it")
  speeds = [a["metrics"]["tokens_per_s"]["interval"]["mean"]
            for a in (pilot.get("arms") or {}).values() if "tokens_per_s" in a["metrics"]]
  exp = suite.arms[0].experiment
  tokens = exp.train.steps * exp.data.batch_size * exp.data.seq_len
  seconds = tokens / (sum(speeds) / len(speeds)) if speeds else None
  return rows, (seconds, "training alone at the pilot's tokens/s; compilation, evaluation "
                "and analysis not counted" if seconds else "")


def plan_table(suite, rows: list[dict], cost: tuple[Optional[float], str]) -> str:
  """The ``--plan`` printout: one line per arm and metric, then the cost of the largest need."""
  from moejax.train.metrics_log import format_duration  # pylint: disable=g-import-not-at-top
  out = [f"{'arm':<18} {'metric':<15} {'effect':>7} {'pilot sd':>9} {'power now':>9} "
         f"{'seeds':>6}"]
  for r in rows:
    sd = "n/a" if r["sd"] is None else f"{r['sd']:.3g}"
    pw = "n/a" if r["power_now"] is None else f"{r['power_now']:.0%}"
    need = "n/a" if r["needed"] is None else str(r["needed"])
    out.append(f"{r['arm']:<18} {r['metric']:<15} {r['effect']:>7.3g} {sd:>9} {pw:>9} "
               f"{need:>6}")
  needs = [r["needed"] for r in rows if r["needed"] is not None]
  if needs:
    worst = max(needs)
    runs = worst * len(suite.arms)
    seconds, counts = cost
    cost = (f"about {format_duration(runs * seconds)} ({counts})" if seconds
            else "no time per run in the pilot")
    out.append(f"{worst} seeds resolve every effect with 80% power: {runs} runs, {cost}; "
               f"the suite has {len(suite.seeds)}. Run the extra seeds as separate processes "
               "(--config.seeds='(3,)' ...) and merge them with --import_runs")
  return "\n".join(out)
