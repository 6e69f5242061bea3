"""A suite's source runs (``suite.source``) and the fine-tuning metrics measured against them.

Legend: D domains, n_d / L_d the valid targets and their cross-entropy sum
in domain d over the whole validation split.

A fine-tuning suite trains its pre-training run first, once per seed, in
``DIR/source[/seed_<s>]`` (an ordinary moejax run: resumed, never
relabelled, like an arm's), evaluates it once over the whole validation
split and writes ``source_result.json`` there (per-domain loss sums,
MaxVio_global, specialisation). Arms whose ``finetune.source`` is
``'suite:source'`` then fine-tune from the source run of their seed, so
the seeds' intervals cover the pre-training's variation too, and a rerun
reuses the finished source runs.

Per fine-tuned run, against the source of its seed (all on the whole
validation split, every valid target, whatever ``data.loss_domains``
scores), with the loss of a set of domains S being sum_{d in S} L_d /
sum_{d in S} n_d:

- ``forgetting`` = loss(pre-training domains) after - before (nats/token;
  > 0: the fine-tune lost some of what pre-training learned). The
  pre-training domains are the source's ``data.loss_domains`` (all when
  empty);
- ``target_gain`` = loss(target domains) before - after (> 0: learned);
  the target domains are the run's ``data.loss_domains``;
- ``spec_change`` = I(expert; domain) / H(domain) after - before (the
  change in expert-domain specialisation; 0 for a router that did not move
  and experts that kept their inputs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from moejax.ablation import final_eval
from moejax.ablation import first_steps
from moejax.ablation.suite import SUITE_SOURCE, Suite
from moejax.train import checkpoint as ckpt_lib
from moejax.train import processes
from moejax.train.config import ExperimentConfig, experiment_to_json

SOURCE_RESULT = "source_result.json"
KEYS = ("forgetting", "target_gain", "spec_change")


def seeded(exp: ExperimentConfig, seed: int) -> ExperimentConfig:
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, seed=seed))


def source_dirs(suite: Suite, workdir: str) -> dict[int, str]:
  """{seed: absolute directory of that seed's source run}."""
  return {s: os.path.abspath(os.path.join(workdir, rel)) for s, rel in suite.source_runs()}


def resolve(suite: Suite, exp: ExperimentConfig, seed: int, workdir: str) -> ExperimentConfig:
  """The run of ``exp`` for ``seed``: its ``train.seed`` and, for ``'suite:source'``, the source
  run of that seed as ``finetune.source``."""
  exp = seeded(exp, seed)
  if exp.finetune.source != SUITE_SOURCE:
    return exp
  path = source_dirs(suite, workdir)[seed]
  return dataclasses.replace(exp, finetune=dataclasses.replace(exp.finetune, source=path)).resolved()


def _read(path: str) -> Optional[dict]:
  file = os.path.join(path, SOURCE_RESULT)
  if not os.path.exists(file):
    return None
  with open(file, encoding="utf-8") as f:
    return json.load(f)


def is_finished(path: str, exp: ExperimentConfig) -> bool:
  res = _read(path)
  if res is None or not isinstance(res.get("experiment"), dict):
    return False
  new = json.loads(experiment_to_json(exp))
  return not ckpt_lib.identity_changes(ckpt_lib.with_defaults(res["experiment"], new), new)


def train_sources(suite: Suite, workdir: str, train_fn, say, out, corpus) -> dict[int, dict]:
  """Trains (or reuses) every source run; returns {seed: its source_result.json content}."""
  results = {}
  for seed, rel in suite.source_runs():
    exp, path = seeded(suite.source, seed), os.path.join(workdir, rel)
    # Process 0's answer on every process (moejax.ablation.runner: several processes).
    if processes.decided_by_lead(lambda: is_finished(path, exp)):
      say(f"[source] {rel}: finished earlier, reused")
      results[seed] = _read(path)
      continue
    say(f"[source] {rel}: pre-training the suite's source (seed {seed})")
    # No suite ETA (the arms' runs are planned after the sources) and no final-evaluation
    # hook: the source's evaluation below reads its final checkpoint.
    summary = train_fn(exp, path, out, None, None,
                       first_steps.first_steps_probe(path) if seed == suite.seeds[0] else None)
    ev = final_eval.final_evaluation(exp, path)
    res = {"run": rel, "seed": seed, "train_summary": summary,
           "val_loss": ev.metrics["loss"], "domain_names": list(ev.domain_names),
           "domain_ce": ev.domain_ce.tolist(), "domain_count": ev.domain_count.tolist(),
           "loss_domains": list(exp.data.loss_domains), "corpus": corpus,
           "experiment": json.loads(experiment_to_json(exp))}
    for k in ("max_vio_global", "specialisation_mi", "specialisation_mi_norm"):
      if k in ev.metrics:
        res[k] = ev.metrics[k]
    if processes.is_lead():
      tmp = os.path.join(path, SOURCE_RESULT + ".tmp")
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, sort_keys=True)
      os.replace(tmp, os.path.join(path, SOURCE_RESULT))
    processes.sync(f"moejax_ablate_source_{rel}")
    results[seed] = res
  return results


def domain_loss(ce, count, names, domains) -> Optional[float]:
  """Token-weighted loss over ``domains`` (all when empty) from per-domain sums."""
  pick = [i for i, n in enumerate(names) if not domains or n in domains]
  n = float(np.sum(np.asarray(count, np.float64)[pick]))
  return None if n == 0 else float(np.sum(np.asarray(ce, np.float64)[pick]) / n)


def finetune_metrics(exp: ExperimentConfig, ev: final_eval.FinalEval, source: dict) -> dict:
  """:data:`KEYS` of a fine-tuned run against its source's result (see the module doc)."""
  names = list(ev.domain_names)
  if names != list(source["domain_names"]):
    raise ValueError(f"the source scored domains {source['domain_names']}, this run {names}")
  pre, target = tuple(source["loss_domains"]), tuple(exp.data.loss_domains)
  before = lambda doms: domain_loss(source["domain_ce"], source["domain_count"], names, doms)
  after = lambda doms: domain_loss(ev.domain_ce, ev.domain_count, names, doms)
  out = {"pretrain_domains": list(pre) or names, "target_domains": list(target) or names,
         "source_pretrain_loss": before(pre), "pretrain_loss": after(pre),
         "source_target_loss": before(target), "target_loss": after(target)}
  if out["pretrain_loss"] is not None and out["source_pretrain_loss"] is not None:
    out["forgetting"] = out["pretrain_loss"] - out["source_pretrain_loss"]
  if out["target_loss"] is not None and out["source_target_loss"] is not None:
    out["target_gain"] = out["source_target_loss"] - out["target_loss"]
  if "specialisation_mi_norm" in ev.metrics and "specialisation_mi_norm" in source:
    out["spec_change"] = ev.metrics["specialisation_mi_norm"] - source["specialisation_mi_norm"]
  return out
