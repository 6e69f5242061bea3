"""Runs a suite: budget check, every arm and seed, per-run analysis, the summary.

Layout of a suite directory ``DIR``::

    DIR/suite.json             the suite (name, fixed, seeds, arms' overrides)
    DIR/budget.json            the budget of every arm (see moejax.ablation.budget)
    DIR/<arm>[/seed_<s>]/      a moejax.train run (config.json, checkpoints, metrics.jsonl)
        result.json            written last: budget + final metrics + analysis, corpus
                               fingerprint and provenance (command, commit, machine)
        per_doc_loss.npz       per validation document: CE sum and target count
        routing.json           per-layer loads over training, domain counts, co-activation
    DIR/summary.md, summary.csv, plots/*.png

A run whose ``result.json`` exists (for the same experiment config) is
finished and is not retrained; a run killed mid-training resumes from its own
last checkpoint through :func:`moejax.train.loop.train`. Runs use the same
data config (same order) and the suite's ``train.seed`` values.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional, TextIO

import numpy as np

from moejax.ablation import analysis as analysis_lib
from moejax.ablation import budget as budget_lib
from moejax.ablation import final_eval
from moejax.ablation import provenance
from moejax.ablation.suite import Suite
from moejax.train import checkpoint as ckpt_lib
from moejax.train import metrics_log
from moejax.train.config import ExperimentConfig, experiment_to_json

RESULT_FILE = "result.json"
ROUTING_FILE = "routing.json"


def budgets(suite: Suite) -> dict[str, budget_lib.ArmBudget]:
  return {a.name: budget_lib.arm_budget(a.experiment) for a in suite.arms}


def check_suite(suite: Suite, out: TextIO = sys.stdout) -> dict[str, budget_lib.ArmBudget]:
  """Prints the budget table and checks it; BudgetError before anything is written."""
  b = budgets(suite)
  print(f"suite {suite.name}: {len(suite.arms)} arms x {len(suite.seeds)} seed(s); budget "
        "(* = held fixed):", file=out)
  print(budget_lib.table(b, suite.fixed), file=out)
  notes = budget_lib.check(b, suite.fixed, {a.name: a.experiment for a in suite.arms})
  for line in notes:
    print(f"  ok  {line}", file=out)
  return b


def _seeded(exp: ExperimentConfig, seed: int) -> ExperimentConfig:
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, seed=seed))


def is_finished(run_path: str, exp: ExperimentConfig) -> bool:
  path = os.path.join(run_path, RESULT_FILE)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    res = json.load(f)
  return res.get("experiment") == json.loads(experiment_to_json(exp))


def train_metrics(run_path: str) -> dict:
  """Final eval metrics and training-window means from ``metrics.jsonl``."""
  ev = metrics_log.read_metrics(run_path, "eval")
  tr = metrics_log.read_metrics(run_path, "train")
  out: dict = {}
  if ev:
    last = ev[-1]
    for k in ("loss", "max_vio_global", "specialisation_mi", "specialisation_mi_norm"):
      if k in last:
        out["val_loss" if k == "loss" else k] = last[k]
  if tr:
    out["train_loss"] = tr[-1]["loss"]
    # The second half of training: the routing after the early transient.
    late = tr[len(tr) // 2:]
    for k in ("max_vio_batch", "drop_rate", "active_experts_mean", "active_experts_var",
              "load_entropy", "tokens_per_s"):
      vals = [r[k] for r in late if isinstance(r.get(k), (int, float))]
      if vals:
        out[k] = float(np.mean(vals))
  return out


def analyse(exp: ExperimentConfig, run_path: str, options: dict, say) -> tuple[dict, dict]:
  """(scalar analysis metrics, routing.json content) of a finished run."""
  res: dict = {}
  routing: dict = {"steps": [], "layers": {}}
  moe = exp.model.moe
  n_batches = options.get("routing_batches")
  batches, domains, sample = final_eval.routing_sample(
      exp, None if n_batches is None else int(n_batches))
  routing["domains"] = domains
  routing["sample"] = sample
  if moe is None:
    res["a2a_note"] = "n/a: dense model, no expert parallelism"
    return res, routing
  final = None
  for step in ckpt_lib.checkpoint_steps(run_path):
    model, _ = analysis_lib.load_model(exp, run_path, step)
    rp = analysis_lib.routing_pass(model, exp, batches, len(domains))
    routing["steps"].append(step)
    for name, acc in rp.items():
      layer = routing["layers"].setdefault(name, {"load_over_training": []})
      layer["load_over_training"].append(acc["load"].tolist())
    final = (model, rp)
  if final is None:
    raise FileNotFoundError(f"{run_path}: no checkpoint to analyse")
  model, rp = final
  for name, acc in rp.items():
    routing["layers"][name]["joint"] = acc["joint"].tolist()
    routing["layers"][name]["coact"] = acc["coact"].tolist()
  routing["num_experts"] = moe.num_experts
  routing["num_routed"] = moe.num_routed
  if not rp:
    res["a2a_note"] = "n/a: the layer has no token -> expert decision (soft / PEER)"
  else:
    wanted = int(options.get("comm_devices", 8))
    p = analysis_lib.ep_devices(moe.num_experts, wanted)
    row_bytes = exp.model.d_model * (2 if exp.model.compute_dtype == "bfloat16" else 4)
    tot = {"copies": 0.0, "min_device": 0.0}
    for name, acc in rp.items():
      b = analysis_lib.a2a_bytes(acc["ids"], moe.num_experts, p, row_bytes)
      for k in tot:
        tot[k] += b[k]
    res["a2a_bytes_per_token"] = tot["copies"]
    res["a2a_min_bytes_per_token"] = tot["min_device"]
    res["a2a_devices"] = p
    res["a2a_note"] = (f"analytic: realised validation routing, {p} EP devices, experts "
                       f"placed contiguously, dispatch+combine forward, all MoE layers")
  res["exposed_comm"] = None
  res["exposed_comm_note"] = (
      "n/a: exposed (non-overlapped) communication needs a timed multi-device step; the "
      "simulated CPU devices of this machine share its cores, so overlap is not measurable "
      "here" + ("; ScMoE removes the data dependency that serialises the all-to-all"
                if exp.model.moe_schedule == "scmoe" else ""))
  if options.get("latency", True):
    say("measuring MoE layer latency")
    res.update(analysis_lib.moe_latency(exp, reps=int(options.get("latency_reps", 30))))
  if options.get("causal_probe"):
    s = exp.data.seq_len
    positions = sorted({s // 8, s // 4, s // 2, s - 1})
    say(f"causal-leak probe at positions {positions}")
    res.update(analysis_lib.causal_probe(model, batches[:2], positions))
  return res, routing


def run_suite(suite: Suite, workdir: str, *, out: TextIO = sys.stdout,
              train_fn: Optional[Callable] = None, analyse_runs: bool = True) -> dict:
  """Checks, trains (or resumes) and summarises the suite; returns {run: result}."""
  from moejax.ablation import summary as summary_lib  # pylint: disable=g-import-not-at-top
  if train_fn is None:
    from moejax.train import loop  # pylint: disable=g-import-not-at-top
    train_fn = loop.train
  say = lambda text: print(text, file=out, flush=True)
  b = check_suite(suite, out)  # raises before anything is written
  from moejax.data import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top
  corpus = fingerprint_lib.corpus_fingerprint(suite.arms[0].experiment.data)
  say(f"corpus: {corpus['id']} (Python {corpus['python_version']})")
  prov = provenance.run_provenance()
  os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, "suite.json"), {
      "name": suite.name, "description": suite.description, "fixed": dict(suite.fixed),
      "seeds": list(suite.seeds), "analysis": dict(suite.analysis),
      "baseline": suite.baseline, "reproduction": suite.reproduction,
      "arms": {a.name: a.overrides for a in suite.arms},
      "arm_order": [a.name for a in suite.arms]})
  _write_json(os.path.join(workdir, "budget.json"), {n: v.as_dict() for n, v in b.items()})
  results = {}
  runs = list(suite.runs())
  for i, (arm, seed, rel) in enumerate(runs):
    exp = _seeded(arm.experiment, seed)
    path = os.path.join(workdir, rel)
    tag = f"[{i + 1}/{len(runs)}] {rel}"
    if is_finished(path, exp):
      say(f"{tag}: finished earlier, not retrained")
      with open(os.path.join(path, RESULT_FILE), encoding="utf-8") as f:
        results[rel] = json.load(f)
      for line in budget_lib.corpus_check({"this run": corpus, rel: results[rel].get("corpus")}):
        say(f"  ! {rel}: {line}; its numbers are not comparable with runs on this corpus: "
            "move the suite directory aside to retrain it here")
      continue
    say(f"{tag}: training ({arm.name}, seed {seed})")
    t0 = time.perf_counter()
    summary = train_fn(exp, path, out=out)
    res = {"suite": suite.name, "arm": arm.name, "seed": seed, "run": rel,
           "budget": b[arm.name].as_dict(), "train_summary": summary,
           **train_metrics(path)}
    ev = final_eval.final_evaluation(exp, path)
    res.update(_final_metrics(ev, path))
    res["corpus"], res["provenance"] = corpus, prov
    if analyse_runs:
      extra, routing = analyse(exp, path, dict(suite.analysis), say)
      res.update(extra)
      for name, layer in routing["layers"].items():  # the summary's counts, whole split
        if name not in ev.joints:
          continue
        layer["joint"] = ev.joints[name].tolist()
        layer["final_load"] = ev.loads[name].tolist()
      routing["joint_source"] = "final whole-split evaluation (moejax.ablation.final_eval)"
      _write_json(os.path.join(path, ROUTING_FILE), routing, indent=None)
    res["wall_seconds"] = time.perf_counter() - t0
    res["experiment"] = json.loads(experiment_to_json(exp))
    _write_json(os.path.join(path, RESULT_FILE), res)  # last: marks the run finished
    results[rel] = res
    say(f"{tag}: done in {res['wall_seconds']:.0f}s, val loss {res.get('val_loss')}")
  summary_lib.write_summary(workdir, suite_name=suite.name)
  say(f"summary: {os.path.join(workdir, 'summary.md')}")
  return results


def _final_metrics(ev: final_eval.FinalEval, path: str) -> dict:
  """The run's final numbers from the whole-split evaluation, and its per-document file."""
  out = {"val_loss": ev.metrics["loss"], "val_tokens": ev.metrics["tokens"],
         "per_doc": {"file": os.path.basename(final_eval.write_per_doc(path, ev)),
                     "documents": int(ev.doc_count.size), "step": ev.step}}
  for k in ("max_vio_global", "specialisation_mi", "specialisation_mi_norm"):
    if k in ev.metrics:
      out[k] = ev.metrics[k]
  out["layers"] = {k: v for k, v in ev.metrics.items() if "/" in k}
  return out


def _write_json(path: str, obj, indent: Optional[int] = 1) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=indent, sort_keys=True, default=_default)
  os.replace(tmp, path)


def _default(o):
  if isinstance(o, (np.floating, np.integer)):
    return o.item()
  if isinstance(o, np.ndarray):
    return o.tolist()
  if isinstance(o, tuple):
    return list(o)
  raise TypeError(f"not JSON serialisable: {type(o)}")
