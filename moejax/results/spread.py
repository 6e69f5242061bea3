"""How far a change of machine moves a suite's numbers, next to how far its seeds do.

A suite run again on another machine kind has its own summary,
``results/SUITE@VARIANT.json`` (``lossfree@avx2``: XLA's CPU code limited to
AVX2), beside the suite's ``results/SUITE.json``. Where the two share seeds,
the same seed is the same computation up to the machine's last digits
(XLA:CPU picks other vector instructions, so sums round differently), and
those digits grow over training. Whether a finding survives the machine is
then a question of sizes: how far the machine moves a seed's difference to
the baseline (the number a verdict rests on), against how far the seeds
spread it.

Per arm and verdict metric, over the shared seeds S:

- *machine*: the largest ``|d_S(suite) - d_S(variant)|``, where ``d_S`` is
  one seed's arm minus baseline (for the baseline itself: its own value),
  and the signed mean of ``d_S(suite) - d_S(variant)`` (near zero next to
  the largest: the machine acts like one more seed; as large and of one
  sign: it shifts the finding);
- *seeds*: the SD over the suite's own seeds of ``d`` (of the value for the
  baseline), and the half-width of the 95% interval its verdict uses;
- *ratio*: largest change / seed SD. Far below 1, the machine does not
  matter next to the seeds; near 1 with a mean change near zero, the machine
  acts like one more seed (a run whose path a last digit can switch, such
  as the loss-free bias's sign updates), which the seeds already sample.

In RESULTS.md the block ``<!-- moejax:generated spread.SUITE@VARIANT -->``
renders this table (moejax.results.report); it depends on the summaries and
the machine kinds of their re-check records alone.
"""

from __future__ import annotations

from typing import Mapping, Optional

from moejax.ablation.columns import METRICS
from moejax.ablation.tables import fmt

PREFIX = "spread."
SPREAD_METRICS = ("val_loss", "max_vio_global")


def pair_ids(variant: str) -> tuple[str, str]:
  """``(suite id, variant id)`` of a block ``spread.VARIANT``: ``lossfree@avx2`` pairs with
  ``lossfree``."""
  if "@" not in variant:
    raise ValueError(f"spread block {PREFIX}{variant}: name a variant such as lossfree@avx2 "
                     "(the suite's summary run on another machine)")
  return variant.split("@", 1)[0], variant


def _per_seed(summary: Mapping, arm: str, metric: str) -> dict[str, float]:
  m = summary["arms"].get(arm, {}).get("metrics", {}).get(metric)
  return {} if m is None else {s: v for s, v in m["values"].items() if v is not None}


def _paired(summary: Mapping, arm: str, metric: str) -> dict[str, float]:
  """``{seed: arm - baseline}`` (the baseline: its own values)."""
  own = _per_seed(summary, arm, metric)
  base = summary.get("baseline")
  if arm == base:
    return own
  ref = _per_seed(summary, base, metric)
  return {s: v - ref[s] for s, v in own.items() if s in ref}


def _seed_spread(summary: Mapping, arm: str,
                 metric: str) -> tuple[Optional[float], Optional[float]]:
  """(SD over seeds, half-width of the 95% interval) of the arm's difference (the
  baseline: of its value), as the summary computed them."""
  if arm == summary.get("baseline"):
    iv = summary["arms"][arm]["metrics"][metric]["interval"]
  else:
    comp = (summary.get("comparisons") or {}).get(arm, {}).get(metric)
    if comp is None:
      return None, None
    iv = comp["diff"]
  half = None if iv.get("lo") is None else (iv["hi"] - iv["lo"]) / 2
  return iv.get("sd"), half


def rows(suite: Mapping, variant: Mapping) -> list[dict]:
  """One row per arm and metric both summaries have: shared seeds, machine shift (largest and
  signed mean), seed SD, interval half-width (module doc). Arms in the suite's order,
  baseline first."""
  base = suite.get("baseline")
  arms = [base] + [a for a in suite["arms"] if a != base and a in variant["arms"]]
  out = []
  for arm in arms:
    for metric in SPREAD_METRICS:
      here, there = _paired(suite, arm, metric), _paired(variant, arm, metric)
      shared = sorted(set(here) & set(there), key=int)
      if not shared:
        continue
      sd, half = _seed_spread(suite, arm, metric)
      changes = [here[s] - there[s] for s in shared]
      shift = max(abs(c) for c in changes)
      out.append({"arm": arm, "metric": metric, "seeds": shared, "machine": shift,
                  "mean": sum(changes) / len(changes), "sd": sd,
                  "half": half, "ratio": None if not sd else shift / sd})
  return out


def _num(x: Optional[float]) -> str:
  return "n/a" if x is None else f"{x:.2g}"


def spread_markdown(variant_id: str, summaries: Mapping[str, Mapping],
                    kinds: Optional[Mapping[str, Optional[str]]] = None) -> str:
  """The spread table of ``variant_id`` (``SUITE@VARIANT``) against its suite; ``kinds``:
  ``{results id: machine kind in words, or None where unknown}`` (from the re-check
  records)."""
  suite_id, _ = pair_ids(variant_id)
  missing = [i for i in (suite_id, variant_id) if i not in summaries]
  if missing:
    return (f"*No machine spread yet: no summary {', '.join(missing)}.*\n")
  suite, variant = summaries[suite_id], summaries[variant_id]
  if suite.get("baseline") != variant.get("baseline"):
    raise ValueError(f"{suite_id} and {variant_id} name different baselines "
                     f"({suite.get('baseline')!r}, {variant.get('baseline')!r})")
  table = rows(suite, variant)
  if not table:
    return f"*No machine spread: {suite_id} and {variant_id} share no seed.*\n"
  kinds = kinds or {}
  where = "; ".join(f"`{i}` on {kinds[i]}" for i in (suite_id, variant_id) if kinds.get(i))
  seeds = table[0]["seeds"]
  n = sorted(set((suite.get("seed_counts") or {}).values()))
  base = suite.get("baseline")
  counts = "/".join(map(str, n))
  plural = "" if n == [1] else "s"
  lines = [f"Seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)} ran on both machine kinds"
           + (f" ({where})" if where else "")
           + f". Per arm: the largest and the mean change of one seed's difference to `{base}` "
           f"between the two kinds (`{suite_id}` minus `{variant_id}`), next to that "
           f"difference's SD over {counts} seed{plural} of `{suite_id}` and the half-width of "
           f"its 95% interval (for `{base}`: its own value; moejax.results.spread).", "",
           "| arm | metric | machine: largest change | machine: mean change | seeds: SD "
           "| interval half-width | largest change / seed SD |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in table:
    lines.append(f"| {r['arm']} | {METRICS[r['metric']][0]} | {fmt(r['machine'], r['metric'])} "
                 f"| {r['mean']:+.2g} | {_num(r['sd'])} | {_num(r['half'])} | {_num(r['ratio'])} |")
  worst = max((r for r in table if r["ratio"] is not None and r["arm"] != base),
              key=lambda r: r["ratio"], default=None)
  if worst is not None:
    lines += ["", f"Largest ratio of a difference: {worst['ratio']:.2g} ({worst['arm']}, "
              f"{METRICS[worst['metric']][0]})."]
  return "\n".join(lines) + "\n"
