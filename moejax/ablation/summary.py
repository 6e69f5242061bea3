"""Suite summaries: result.json files -> one summary dict (JSON) with intervals and verdicts.

Legend: n seeds of an arm, N validation documents.

:func:`summarise_results` groups runs by a label (the arm, or
``<suite>/<arm>`` across directories), and per label and metric keeps the
value of every seed with its mean and 95% interval over seeds; per label
other than the baseline and per metric of
:data:`~moejax.ablation.columns.VERDICT_METRICS` the paired difference with
the baseline, for the validation loss the document bootstrap of the
per-document losses, and the computed verdict; and per metric the suite's
minimal detectable difference. The statistics are those of
:mod:`moejax.ablation.stats` (formulas there and in docs/ablations.md).

:func:`write_summary` writes, for a suite directory, ``summary.json`` (that
dict, plus provenance, the corpus fingerprint and per arm the plotted data of
:mod:`moejax.ablation.curves`: downsampled training curves and the final
layer x expert load; what ``experiments.report`` turns into RESULTS.md and
its plots, and what ``results/`` keeps), ``summary.md``,
``summary.csv`` and the plots of :mod:`moejax.ablation.plots`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from moejax.ablation import curves, final_eval, legend, plots, power, stats, tables
from moejax.ablation import realised
from moejax.ablation.budget import corpus_check, spread
from moejax.ablation.columns import (BUDGET_KEYS, METRICS, NOTE_KEYS, VERDICT_METRICS,
                                     balance_loss_keys)
from moejax.topology.accounting import human

FORMAT = 1
SUMMARY_FILE = "summary.json"

def find_results(root: str) -> list[dict]:
  """Every ``result.json`` under ``root`` (a suite dir, an arm dir or a parent of several)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("checkpoints", "tensorboard", "plots",
                                                      "compile_cache"))
    if "result.json" in filenames:
      with open(os.path.join(dirpath, "result.json"), encoding="utf-8") as f:
        res = json.load(f)
      res["_path"] = dirpath
      found.append(res)
  return found


def _num(v) -> Optional[float]:
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  return float(v) if ok else None


def _seed_values(runs: Sequence[dict], key: str) -> dict[int, float]:
  out = {}
  for r in runs:
    v = _num(r.get(key))
    if v is not None:
      out[int(r.get("seed", 0))] = v
  return out


def _mean_per_doc(runs: Sequence[dict]):
  """(seed-mean CE sums f64[N], counts f64[N]) of runs with per-document files, else None."""
  got = [final_eval.read_per_doc(r["_path"]) for r in runs if r.get("_path")]
  got = [g for g in got if g is not None]
  if not got or len({g[0].shape for g in got}) > 1:
    return None
  return np.mean([g[0] for g in got], axis=0), got[0][1]


def _bootstrap(arm_runs, base_runs) -> tuple[Optional[dict], str]:
  a, b = _mean_per_doc(arm_runs), _mean_per_doc(base_runs)
  if a is None or b is None:
    return None, "no per-document losses (per_doc_loss.npz) for both"
  if a[0].shape != b[0].shape or not np.array_equal(a[1], b[1]):
    return None, "the runs scored different documents (another corpus or split)"
  return stats.document_bootstrap(a[0] - b[0], a[1]).as_dict(), ""


def summarise_results(results: Sequence[dict], *, label: Callable[[dict], str] = lambda r: r["arm"],
                      baseline: Optional[str] = None, order: Sequence[str] = (),
                      compare_to: Optional[Mapping[str, str]] = None) -> dict:
  """The summary dict of ``results`` grouped by ``label`` (see the module doc).

  ``baseline``: the label every other label is compared with (None: no comparisons).
  ``order``: labels in this order first (a suite's arm order), the rest after.
  ``compare_to``: ``{label: other label}`` compared with that label instead of
  ``baseline`` (``'-'``: not compared); each comparison records its ``baseline``.
  """
  compare_to = dict(compare_to or {})
  groups: dict[str, list[dict]] = {}
  for r in results:
    groups.setdefault(label(r), []).append(r)
  names = [n for n in order if n in groups] + sorted(n for n in groups if n not in order)
  if baseline is not None and baseline not in groups:
    raise ValueError(f"baseline {baseline!r} has no result; labels: {names}")
  arms = {}
  losses = balance_loss_keys(k for r in results for k in r)
  for name in names:
    runs = sorted(groups[name], key=lambda r: r.get("seed", 0))
    metrics = {}
    for key in (*METRICS, *losses):
      vals = _seed_values(runs, key)
      if vals:
        metrics[key] = {"values": {str(s): v for s, v in sorted(vals.items())},
                        "interval": stats.t_interval(list(vals.values())).as_dict()}
    arms[name] = {"suite": runs[0].get("suite", ""), "arm": runs[0].get("arm", name),
                  "seeds": sorted(int(r.get("seed", 0)) for r in runs),
                  "budget": dict(runs[0].get("budget", {})), "metrics": metrics,
                  "notes": {note: runs[0][note] for _, note in NOTE_KEYS if runs[0].get(note)}}
    walls = [r["wall_seconds"] for r in runs if _num(r.get("wall_seconds")) is not None]
    if walls:  # what a seed of this arm costs (experiments.ablate --plan)
      arms[name]["run_seconds"] = float(np.mean(walls))
  out = {"format": FORMAT, "labels": names, "baseline": baseline, "arms": arms,
         "comparisons": {}, "mdd": {}}
  corpora = {f"{name} seed {r.get('seed', 0)}": r.get("corpus")
             for name in names for r in groups[name]}
  ids = sorted({c["id"] for c in corpora.values() if c})
  out["corpus"] = {"ids": ids, "flags": corpus_check(corpora),
                   "fingerprint": next((c for c in corpora.values() if c), None)}
  seed_counts = {n: len(a["seeds"]) for n, a in arms.items()}
  out["seed_counts"] = seed_counts
  if baseline is None:
    return out
  diffs: dict[str, list[stats.Interval]] = {}
  for name in names:
    base = compare_to.get(name, baseline)
    if name == base or base not in groups:
      continue
    comp = {}
    for key in VERDICT_METRICS:
      a, b = _seed_values(groups[name], key), _seed_values(groups[base], key)
      if not a or not b or not any(list(a.values()) + list(b.values())):
        continue  # absent, or 0 in every run (no capacity: no drops): nothing to compare
      entry = _difference(a, b)
      if entry["pairing"] == "paired":
        diffs.setdefault(key, []).append(stats.Interval.from_dict(entry["diff"]))
      boot = None
      if base != baseline:
        entry["baseline"] = base
      if key == "val_loss":
        boot, why = _bootstrap(groups[name], groups[base])
        entry["documents"] = boot
        if why:
          entry["documents_note"] = why
      seed_iv = stats.Interval.from_dict(entry["diff"])
      boot_iv = stats.Interval.from_dict(boot) if boot else None
      direction = METRICS[key][2]
      entry["verdict"] = stats.verdict(seed_iv, boot_iv, direction=direction)
      entry["reason"] = (stats.reason(seed_iv, boot_iv)
                         if entry["verdict"] == stats.UNRESOLVED else "")
      comp[key] = entry
    out["comparisons"][name] = comp
  n = min(seed_counts.values())
  out["mdd"] = {key: {"value": stats.pooled_mdd(diffs.get(key, []), n), "seeds": n}
                for key in VERDICT_METRICS if any(key in c for c in out["comparisons"].values())}
  return out


def _difference(a: Mapping[int, float], b: Mapping[int, float]) -> dict:
  """Paired over common seeds when at least two are common (or the seed sets are equal),
  else unpaired (Welch) over each side's own seeds."""
  common = sorted(set(a) & set(b))
  if len(common) >= 2 or (common and set(a) == set(b)):
    iv, seeds = stats.paired(a, b)
    return {"diff": iv.as_dict(), "pairing": "paired", "seeds": seeds}
  iv = stats.welch(list(a.values()), list(b.values()))
  return {"diff": iv.as_dict(), "pairing": "unpaired (Welch): fewer than 2 common seeds",
          "seeds": sorted(set(a) | set(b))}


def _collect_provenance(results: Sequence[dict]) -> dict:
  provs = [r.get("provenance") or {} for r in results]
  pick = lambda key: sorted({p[key] for p in provs if p.get(key)})
  dates = pick("date")
  return {"commands": pick("command"), "commits": pick("commit"),
          "dates": [dates[0], dates[-1]] if dates else [], "machines": pick("machine"),
          "jax_versions": pick("jax_version"), "python_versions": pick("python_version"),
          "runs": len(results), "runs_without_provenance": sum(1 for p in provs if not p),
          # Every distinct code fingerprint the runs recorded (one, unless a suite was
          # resumed across commits; none when a run recorded none): RESULTS.md compares
          # them with the checkout's (moejax.ablation.freshness).
          "code": (list({p["code"]["fingerprint"]: p["code"] for p in provs}.values())
                   if all(p.get("code") for p in provs) else []),
          **_collect_plugins(results)}


def _collect_plugins(results: Sequence[dict]) -> dict:
  """``plugins``: one record per (module, sha256) the runs recorded, with the runs made with
  it; ``plugin_flags``: a module recorded in several versions, or whose file has changed
  since (a summary written again after the plugin was edited). Empty when no run used one."""
  from moejax.config import plugins as plugins_lib  # pylint: disable=g-import-not-at-top
  records: dict = {}
  for r in results:
    for rec in plugins_lib.normalise((r.get("provenance") or {}).get("plugins") or ()):
      entry = records.setdefault((rec["module"], rec["sha256"]), dict(rec, runs=[]))
      entry["ideas"] += [i for i in rec["ideas"] if i not in entry["ideas"]]
      entry["runs"].append(r.get("run") or f"{r.get('arm')}/seed_{r.get('seed', 0)}")
  if not records:
    return {}
  flags = []
  versions: dict = {}
  for (module, sha), rec in records.items():
    versions.setdefault(module, []).append(rec)
  for module, recs in versions.items():
    if len(recs) > 1:
      flags.append(f"plugin module {module!r} was recorded in {len(recs)} versions: " + "; ".join(
          f"sha256 {(r['sha256'] or '?')[:12]} ({', '.join(r['runs'])})" for r in recs))
    for rec in recs:
      flags += [f"{line}: runs {', '.join(rec['runs'])}"
                for line in plugins_lib.changes([rec])]
  return {"plugins": [dict(rec, runs=sorted(rec["runs"])) for rec in records.values()],
          "plugin_flags": flags}


def suite_summary(workdir: str) -> dict:
  """The summary dict of the suite directory ``workdir`` (its suite.json and result files)."""
  suite: dict = {}
  path = os.path.join(workdir, "suite.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      suite = json.load(f)
  results = find_results(workdir)
  order = list(suite.get("arm_order", []))
  if order:  # runs left over from arms the suite file no longer has are not summarised
    results = [r for r in results if r["arm"] in order]
  if not results:
    raise FileNotFoundError(f"no result.json under {workdir} (run experiments.ablate first)")
  names = {r["arm"] for r in results}
  baseline = suite.get("baseline") or (order[0] if order else None)
  if baseline not in names:
    baseline = None
  reference = (suite.get("analysis") or {}).get("speedup_reference")
  if reference:
    from moejax.ablation import speedup  # pylint: disable=g-import-not-at-top
    speedup.add_speedups(results, reference)
  out = summarise_results(results, baseline=baseline, order=order,
                          compare_to=suite.get("compare_to"))
  add_plot_data(out, results)
  power.annotate(out, suite.get("effects") or {})
  if suite.get("compare_to"):
    out["compare_to"] = dict(suite["compare_to"])
  if suite.get("exempt"):
    out["exempt"] = {a: list(q) for a, q in suite["exempt"].items()}
  out.update({"suite": suite.get("name") or results[0].get("suite", ""),
              "description": (suite.get("description") or "").strip().split("\n")[0],
              "reproduction": bool(suite.get("reproduction", False)),
              "scale": suite.get("scale", results[0].get("scale", "s")),
              "suite_seeds": suite.get("seeds", sorted({r.get("seed", 0) for r in results})),
              "provenance": _collect_provenance(results),
              "budget_flags": budget_mismatches(out, exempt=suite.get("exempt"),
                                                held=suite.get("fixed"))
              + realised.summary_flags(out, suite.get("fixed") or {}, suite.get("exempt"))})
  return out


def add_plot_data(summary: dict, results: Sequence[dict]) -> None:
  """Per arm the downsampled training curves (``curves``: {} when the runs logged none) and
  the final layer x expert load (``load``, where the runs recorded it); moejax.ablation.curves.

  An arm's ``curves`` key, even empty, marks a summary that has the plot data (summaries
  written before it have none: their RESULTS.md blocks say so).
  """
  for name, arm in summary["arms"].items():
    runs = [r for r in results if r["arm"] == name]
    arm["curves"] = curves.arm_curves(runs)
    load = curves.arm_load(runs)
    if load is not None:
      arm["load"] = load


def budget_mismatches(summary: Mapping, tolerance: float = 0.02,
                      exempt: Optional[Mapping[str, Sequence[str]]] = None,
                      held: Optional[Sequence[str]] = None) -> list[str]:
  """Lines naming every budget quantity on which the labels differ beyond ``tolerance``.

  ``exempt``: ``{label: quantities}`` (a suite's reference arms) left out of those quantities.
  ``held``: the quantities the suite holds equal (its ``fixed``), or None for runs of no
  suite. A suite that does not hold the optimizer equal studies it (the optimizer is its
  axis, as in ``recipe``), so differing optimizer settings are no flag there; the budget
  table still names each arm's optimizer.
  """
  arms = summary["arms"]
  exempt = exempt or {}
  out = []
  if len(arms) < 2:
    return out
  for key, title in BUDGET_KEYS:
    vals = {n: float(a["budget"][key]) for n, a in arms.items()
            if a["budget"].get(key) is not None and key not in exempt.get(n, ())}
    if len(vals) > 1 and spread(list(vals.values())) > tolerance:
      lo, hi = min(vals, key=vals.get), max(vals, key=vals.get)
      out.append(f"{title} differs by {100 * spread(list(vals.values())):.1f}% "
                 f"({lo} {human(vals[lo])} .. {hi} {human(vals[hi])})")
  opts = {a["budget"].get("optimizer") for n, a in arms.items()
          if "optimizer" not in exempt.get(n, ())}
  if len(opts) > 1 and (held is None or "optimizer" in held):
    out.append("optimizer settings differ: " + " | ".join(sorted(map(str, opts))))
  return out


def mean(summary: Mapping, label: str, key: str) -> Optional[float]:
  m = summary["arms"][label]["metrics"].get(key)
  return None if m is None else m["interval"]["mean"]


def write_csv(summary: Mapping, path: str) -> None:
  """One row per label: budget, then per metric mean, 95% lo / hi and seed count.

  Only the columns with a value in at least one row are written (in the
  order above): a suite reports a few of the many metrics :data:`METRICS`
  knows, and a column that is empty in every row says nothing.
  """
  keys = ["arm", "suite", "seeds"] + [k for k, _ in BUDGET_KEYS] + ["optimizer"]
  losses = balance_loss_keys(k for a in summary["arms"].values() for k in a["metrics"])
  for k in (*METRICS, *losses):
    keys += [k, f"{k}_lo", f"{k}_hi", f"{k}_n"]
  rows = [_csv_row(name, a) for name, a in summary["arms"].items()]
  keys = [k for k in keys if k == "arm" or any(r.get(k) not in (None, "") for r in rows)]
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    for row in rows:
      w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in keys})


def _csv_row(name: str, a: Mapping) -> dict:
  """The CSV cells of one arm (label) of the summary, by column name."""
  row = {"arm": name, "suite": a["suite"], "seeds": len(a["seeds"]),
         "optimizer": a["budget"].get("optimizer", "")}
  row.update({k: a["budget"].get(k, "") for k, _ in BUDGET_KEYS})
  for k, m in a["metrics"].items():
    iv = m["interval"]
    row.update({k: iv["mean"], f"{k}_lo": iv["lo"], f"{k}_hi": iv["hi"], f"{k}_n": iv["n"]})
  return row


def read_csv(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  for r in rows:
    for k, v in r.items():
      if k not in ("arm", "suite", "optimizer"):
        r[k] = float(v) if v not in ("", None) else None
  return rows


def write_json(obj, path: str) -> str:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
  return path


def write_summary(workdir: str, suite_name: str = "") -> dict:
  """summary.json, summary.md, summary.csv and plots/*.png of the suite directory."""
  summary = suite_summary(workdir)
  if suite_name:
    summary["suite"] = suite_name
  write_json(summary, os.path.join(workdir, SUMMARY_FILE))
  drawn = plots.write_plots(summary, os.path.join(workdir, "plots"))  # summary.md links them
  md = "\n\n".join(p.rstrip("\n") for p in (tables.suite_markdown(summary),
                                             legend.markdown(summary, drawn, workdir)) if p)
  with open(os.path.join(workdir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(md + "\n")
  write_csv(summary, os.path.join(workdir, "summary.csv"))
  return {"summary": summary, **drawn}


def metrics_present(summaries: Iterable[Mapping], keys: Iterable[str] = METRICS) -> list[str]:
  """The metric keys that at least one label of the summaries has."""
  summaries = list(summaries)
  return [k for k in keys if any(k in a["metrics"] for s in summaries for a in s["arms"].values())]
