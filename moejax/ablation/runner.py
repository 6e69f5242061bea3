"""Runs a suite: budget check, every arm and seed, per-run analysis, the summary.

Layout of a suite directory ``DIR``::

    DIR/suite.json             the suite (name, fixed, seeds, scale, arms' overrides)
    DIR/budget.json            the budget of every arm (see moejax.ablation.budget)
    DIR/<arm>[/seed_<s>]/      a moejax.train run (config.json, checkpoints, metrics.jsonl)
        result.json            written last: budget + final metrics + analysis, corpus
                               fingerprint and provenance (command, commit, machine)
        per_doc_loss.npz       per validation document: CE sum and target count
        routing.json           per-layer loads over training, domain counts, co-activation
    DIR/summary.md, summary.csv, plots/*.png

A run whose ``result.json`` exists (for the same experiment, up to the
resume-free fields of :mod:`moejax.train.checkpoint`) is finished and is not
retrained; a run killed mid-training resumes from its own last checkpoint
through :func:`moejax.train.loop.train`. Runs use the same data config (same
order) and the suite's ``train.seed`` values.

Before anything is written (suite.json, budget.json), :func:`plan_suite`
checks every run's directory: a config that would relabel finished results
(``--config.base.train.steps=500`` on a finished suite, another learning
rate) is refused there, naming the run and the field; ``extend=True``
(``--extend``) trains the extra steps instead. The suite directory is
locked while the suite runs (moejax.train.lock), each run's directory by its
trainer.

Several processes (a multi-process launch of ``experiments.ablate``): every
process runs every run in the same order (each run's training, final
evaluation and analysis need them all: the trainer's steps are collectives,
the evaluation gathers the sharded state); process 0 alone holds the suite's
lock and writes the suite's files (suite.json, budget.json, each run's
result.json, routing.json and per_doc_loss.npz, the summary and plots), and
the others read them after a barrier. Which runs are finished, and what
happens to the others, is decided once by process 0 and sent to every
process (:func:`moejax.train.processes.decided_by_lead`), so that no process
can take another branch (:func:`run_suite`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import textwrap
import time
from typing import Callable, Optional, TextIO

import jax
import numpy as np

from moejax.ablation import analysis as analysis_lib
from moejax.ablation import budget as budget_lib
from moejax.ablation import final_eval
from moejax.ablation import first_steps
from moejax.ablation import provenance
from moejax.ablation import realised
from moejax.ablation import replay_finetune as replay_lib
from moejax.ablation import scale as scale_lib
from moejax.ablation import sources as sources_lib
from moejax.ablation import terminal
from moejax.ablation.suite import Suite
from moejax.config.registry import BALANCE_LOSS_LOG_PREFIX
from moejax.serve import consistency_child
from moejax.balance.aux import LayerMetrics
from moejax.train import checkpoint as ckpt_lib
from moejax.train import lock as lock_lib
from moejax.train import metrics_log
from moejax.train import processes
from moejax.train import step as step_lib
from moejax.topology.accounting import human
from moejax.train.config import ExperimentConfig, experiment_to_json

# Training-log metrics summarised per run (moejax.train.step's summary): the
# MoE layers' from their metrics type (every kind), then mixture-of-depths.
SUMMARIZED_TRAIN_METRICS = LayerMetrics.summarized() + step_lib.MOD_SUMMARIZED
RESULT_FILE = "result.json"
ROUTING_FILE = "routing.json"


def budgets(suite: Suite) -> dict[str, budget_lib.ArmBudget]:
  """Every arm's budget; arms fine-tuning from the suite's source are charged its training."""
  return {a.name: budget_lib.arm_budget(
      a.experiment, f"arm {a.name!r}",
      source=suite.source if a.experiment.finetune.source == sources_lib.SUITE_SOURCE else None)
          for a in suite.arms}


def check_suite(suite: Suite, out: TextIO = sys.stdout) -> dict[str, budget_lib.ArmBudget]:
  """Prints the budget table and checks it; BudgetError before anything is written."""
  b = budgets(suite)
  scale = scale_lib.get_scale(suite.scale)
  print(f"suite {suite.name} at scale {scale.name} ({scale.describe()}): {len(suite.arms)} arms "
        f"x {len(suite.seeds)} seed(s); budget (* = held fixed):", file=out)
  print(budget_lib.table(b, suite.fixed), file=out)
  notes = budget_lib.check(b, suite.fixed, {a.name: a.experiment for a in suite.arms},
                           exempt=suite.exempt)
  for line in notes:  # as wide as the table (budget_lib.TABLE_WIDTH)
    print(textwrap.fill(line, budget_lib.TABLE_WIDTH, initial_indent="  ok  ",
                        subsequent_indent="      ", break_on_hyphens=False), file=out)
  return b


def ladder_table(tree) -> str:
  """Markdown: the suite's baseline arm at every rung of the scale ladder (sizes, compute)."""
  from moejax.ablation import suite as suite_lib  # pylint: disable=g-import-not-at-top
  tree = suite_lib._plain(tree)  # pylint: disable=protected-access
  rows = ["| scale | factors | d | layers | seq x batch x steps | params | active/token | "
          "train tokens | train FLOPs | compute / s |", "|---|---|---:|---:|---|---:|---:|---:|"
          "---:|---:|"]
  first = None
  for name, rung in scale_lib.SCALES.items():
    suite = suite_lib.suite_from_dict(dict(tree, scale=name))
    exp = suite.arm(suite.baseline).experiment
    b = budget_lib.arm_budget(exp, f"arm {suite.baseline!r} at scale {name}")
    first = first or b.train_flops
    rows.append(f"| {name} | {rung.describe()} | {exp.model.d_model} | {exp.model.n_layers} | "
                f"{exp.data.seq_len} x {exp.data.batch_size} x {exp.train.steps} | "
                f"{human(b.total)} | {human(b.active)} | {human(b.tokens)} | "
                f"{human(b.train_flops)} | {b.train_flops / first:.1f} |")
  return "\n".join(rows)


def _seeded(exp: ExperimentConfig, seed: int) -> ExperimentConfig:
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, seed=seed))


def is_finished(run_path: str, exp: ExperimentConfig) -> bool:
  """A result.json exists for this experiment (resume-free fields such as log_every aside)."""
  path = os.path.join(run_path, RESULT_FILE)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    res = json.load(f)
  saved = res.get("experiment")
  new = json.loads(experiment_to_json(exp))
  return isinstance(saved, dict) and not ckpt_lib.identity_changes(
      ckpt_lib.with_defaults(saved, new), new)


def plan_suite(suite: Suite, workdir: str, extend: bool = False,
               take_over_lock: bool = False) -> list[tuple[str, str]]:
  """``(run, what happens)`` for every run; reads only.

  ``take_over_lock``: locks left by runs on another host do not count
  (:mod:`moejax.train.lock`).

  Raises WorkdirError (naming the run) when a run's directory holds results
  this suite would misdescribe, or when a directory is in use.
  """
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  ckpt_lib.check_writable(workdir, "--workdir")
  lock_lib.check_unlocked(workdir, take_over_lock)
  for arm in suite.arms:
    loop.check_runnable(arm.experiment)
  out = []
  for seed, rel in suite.source_runs():
    exp, path = _seeded(suite.source, seed), os.path.join(workdir, rel)
    if sources_lib.is_finished(path, exp):
      out.append((rel, "finished (source)"))
      continue
    lock_lib.check_unlocked(path, take_over_lock)
    try:
      plan = ckpt_lib.check_workdir(path, exp, extend=extend)
    except ckpt_lib.WorkdirError as e:
      raise ckpt_lib.WorkdirError(f"source run {rel} of suite {suite.name}: {e}") from e
    out.append((rel, "new (source)" if plan.step is None else f"source, from step {plan.step}"))
  for arm, seed, rel in suite.runs():
    exp = sources_lib.resolve(suite, arm.experiment, seed, workdir)
    path = os.path.join(workdir, rel)
    if is_finished(path, exp):
      out.append((rel, "finished"))
      continue
    lock_lib.check_unlocked(path, take_over_lock)
    try:
      plan = ckpt_lib.check_workdir(path, exp, extend=extend)
    except ckpt_lib.WorkdirError as e:
      raise ckpt_lib.WorkdirError(f"run {rel} of suite {suite.name}: {e}") from e
    if plan.step is None:
      out.append((rel, "new"))
    elif plan.finished:
      out.append((rel, f"trained to step {plan.step}; analysis to do"))
    else:
      out.append((rel, f"resumes from step {plan.step}"
                  + (f" (extended from {plan.extend_from} steps)" if plan.extend_from else "")))
  return out


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
    # Every balance loss the run logged (balance/<name>: its config's losses).
    losses = sorted({k for r in late for k in r if k.startswith(BALANCE_LOSS_LOG_PREFIX)})
    for k in (*SUMMARIZED_TRAIN_METRICS, "tokens_per_s", *losses):
      vals = [r[k] for r in late if isinstance(r.get(k), (int, float))]
      if vals:
        out[k] = float(np.mean(vals))
  return out


class _FinalEvalHook:
  """The trainer's final evaluation: :func:`final_eval.evaluate_state`, kept for the runner."""

  def __init__(self, exp: ExperimentConfig):
    self.exp, self.result = exp, None

  def __call__(self, params, router_state, other) -> dict:
    self.result = final_eval.evaluate_state(self.exp, params, router_state, other,
                                            self.exp.train.steps)
    return self.result.metrics


def analyse(exp: ExperimentConfig, run_path: str, options: dict, say,
            final_routing: Optional[final_eval.FinalEval] = None) -> tuple[dict, dict]:
  """(scalar analysis metrics, routing.json content) of a finished run.

  ``final_routing``: the run's final evaluation; when the routing sample is
  the whole split (the default), its routing of the final checkpoint stands
  in for a second pass over the split.
  """
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
  reuse = (final_routing if n_batches is None and final_routing is not None
           and final_routing.routing is not None else None)
  for step in ckpt_lib.checkpoint_steps(run_path):
    model, _ = analysis_lib.load_model(exp, run_path, step)
    if reuse is not None and step == reuse.step:
      rp = reuse.routing  # the same forward over the same batches, done once
    else:
      rp = analysis_lib.routing_pass(model, exp, batches, len(domains))
    routing["steps"].append(step)
    for name, acc in rp.items():
      layer = routing["layers"].setdefault(name, {"load_over_training": []})
      layer["load_over_training"].append(acc["load"].tolist())
    final = (model, rp, step)
  if final is None:
    raise FileNotFoundError(f"{run_path}: no checkpoint to analyse")
  model, rp, final_step = final
  for name, acc in rp.items():
    routing["layers"][name]["joint"] = acc["joint"].tolist()
    routing["layers"][name]["coact"] = acc["coact"].tolist()
  routing["num_experts"] = moe.topology.num_experts
  routing["num_routed"] = moe.num_routed
  if not rp:
    res["a2a_note"] = "n/a: the layer has no token -> expert decision (soft / PEER)"
  else:
    wanted = int(options.get("comm_devices", 8))
    p = analysis_lib.ep_devices(moe.topology.num_experts, wanted)
    row_bytes = exp.model.d_model * (2 if exp.model.compute_dtype == "bfloat16" else 4)
    tot = {"copies": 0.0, "min_device": 0.0}
    for name, acc in rp.items():
      b = analysis_lib.a2a_bytes(acc["ids"], moe.topology.num_experts, p, row_bytes)
      for k in tot:
        tot[k] += b[k]
    res["a2a_bytes_per_token"] = tot["copies"]
    res["a2a_min_bytes_per_token"] = tot["min_device"]
    res["a2a_devices"] = p
    res["a2a_note"] = (f"analytic: realised validation routing, {p} EP devices, experts "
                       f"placed contiguously, dispatch+combine forward, all MoE layers")
  res["exposed_comm"] = None
  res["exposed_comm_note"] = (
      "n/a: exposed (non-overlapped) communication needs a step timed across real devices; "
      "the suite's analysis computes the all-to-all volume only"
      + ("; ScMoE removes the data dependency that serialises the all-to-all"
         if exp.model.moe_schedule == "scmoe" else ""))
  if options.get("latency", True):
    say("measuring MoE layer latency")
    res.update(analysis_lib.moe_latency(exp, reps=int(options.get("latency_reps", 30))))
  if options.get("causal_probe"):
    s = exp.data.seq_len
    positions = sorted({s // 8, s // 4, s // 2, s - 1})
    say(f"causal-leak probe at positions {positions}")
    res.update(analysis_lib.causal_probe(model, batches[:2], positions))
  if options.get("routing_consistency"):
    say(f"routing consistency under {', '.join(options['routing_consistency'])}")
    res.update(_consistency(model, batches[:analysis_lib.CONSISTENCY_BATCHES],
                            tuple(options["routing_consistency"]), run_path, final_step))
  if options.get("replay_finetune"):
    name, steps = replay_lib.check_options(options["replay_finetune"])
    say(f"replay fine-tuning: {steps} steps on its own routing and on {name} recordings")
    res.update(replay_lib.finetune_pair(exp, model, name, steps,
                                        batches[:analysis_lib.CONSISTENCY_BATCHES], len(domains)))
  return res, routing


def _consistency(model, batches, names: tuple[str, ...], run_path: str, step: int) -> dict:
  """The routing-consistency columns; the perturbations that need more devices than this
  process has (expert parallelism) run in a child process on simulated CPU devices."""
  away = consistency_child.needs_child(names, jax.device_count(), jax.default_backend())
  res = analysis_lib.routing_consistency(model, batches, tuple(n for n in names if n not in away))
  if away:
    tokens = np.concatenate([np.asarray(b["inputs"]) for b in batches])
    child = consistency_child.columns(run_path, step, tokens, away)
    res["consistency_na"] = {**res["consistency_na"], **child.pop("consistency_na")}
    res.update(child)
  return res


def run_suite(suite: Suite, workdir: str, *, out: TextIO = sys.stdout,
              train_fn: Optional[Callable] = None, analyse_runs: bool = True,
              extend: bool = False, before_plan: Optional[Callable[[], object]] = None,
              take_over_lock: bool = False) -> dict:
  """Checks, trains (or resumes) and summarises the suite; returns {run: result}.

  ``extend``: runs may grow their ``train.steps`` (see :func:`plan_suite`).
  ``before_plan``: called once the budget check has passed and before the runs are
  planned (``--import_runs`` copies finished runs in there, moejax.ablation.merge).
  ``take_over_lock``: the suite's and its runs' locks left on another host are
  taken over whatever their age (``--take_over_lock``, moejax.train.lock).
  """
  from moejax.ablation import summary as summary_lib  # pylint: disable=g-import-not-at-top
  if train_fn is None:
    # pylint: disable=g-import-not-at-top
    from moejax.finetune.start import finetune_start
    from moejax.train import loop
    # The trainer also shows the suite's ETA (the steps of the runs after this one), its
    # final evaluation is the runner's (final_eval.evaluate_state, kept in `hook`), and
    # arms that fine-tune start from their source (finetune_start).
    train_fn = lambda exp, path, out, eta, hook, probe=None: loop.train(
        exp, path, out=out, extend=extend, suite=eta, final_eval=hook, start=finetune_start,
        take_over_lock=take_over_lock, probe=probe)
  else:
    custom = train_fn
    train_fn = lambda exp, path, out, eta, hook, probe=None: custom(exp, path, out=out)
  say = lambda text: print(text, file=out, flush=True)
  b = check_suite(suite, out)  # raises before anything is written
  from moejax.data import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top

  def decide() -> dict:  # process 0's reading of the directory, for every process
    if before_plan is not None:
      before_plan()
    # Raises before anything is written.
    return {"plan": plan_suite(suite, workdir, extend, take_over_lock),
            # Reads (and on first use prepares) the dataset: once, before the others read it.
            "corpus": fingerprint_lib.corpus_fingerprint(suite.arms[0].experiment.data)}
  decided = processes.decided_by_lead(decide)
  plan, corpus = {rel: what for rel, what in decided["plan"]}, decided["corpus"]
  say(f"corpus: {corpus['id']} (Python {corpus['python_version']})")
  for line in provenance.plugin_changes(workdir, plan):  # before any run is trained
    say(f"  {line}")
  prov = provenance.run_provenance(plugins=_suite_plugins(suite))
  lead = processes.is_lead()
  # One process of a multi-process run holds the suite's lock for all of them.
  locked = lock_lib.WorkdirLock(workdir, say, take_over_lock) if lead else contextlib.nullcontext()
  with locked:
    _write_json(os.path.join(workdir, "suite.json"), {
        "name": suite.name, "description": suite.description, "fixed": dict(suite.fixed),
        "seeds": list(suite.seeds), "analysis": dict(suite.analysis),
        "baseline": suite.baseline, "reproduction": suite.reproduction,
        "scale": suite.scale, "scale_factors": scale_lib.get_scale(suite.scale).factors(),
        "exempt": {a: list(q) for a, q in suite.exempt.items()},
        "compare_to": dict(suite.compare_to), "match_compute": dict(suite.match_compute),
        "effects": {k: dict(v) for k, v in suite.effects.items()},
        "source": (None if suite.source is None
                   else json.loads(experiment_to_json(suite.source))),
        "arms": {a.name: a.overrides for a in suite.arms},
        "arm_order": [a.name for a in suite.arms]})
    _write_json(os.path.join(workdir, "budget.json"), {n: v.as_dict() for n, v in b.items()})
    results = _train_runs(suite, workdir, b, plan, train_fn, analyse_runs, say, out, corpus,
                          prov)
    if lead:
      summary_lib.write_summary(workdir, suite_name=suite.name)
  processes.sync("moejax_ablate_summary")  # the others print the summary process 0 wrote
  for line in realised.report(b, results.values(), suite.fixed, suite.exempt, suite.baseline):
    say(line)
  _report_suite(workdir, say)
  return results


def _train_runs(suite, workdir, b, plan, train_fn, analyse_runs, say, out, corpus,
                prov) -> dict:
  results = {}
  source_results = sources_lib.train_sources(suite, workdir, train_fn, say, out, corpus)
  runs = list(suite.runs())
  todo = [rel for _, _, rel in runs if plan[rel] != "finished"]
  steps = {rel: arm.experiment.train.steps for arm, _, rel in runs}
  overhead: list[float] = []   # seconds per trained run outside its training steps
  walls: list[float] = []      # wall seconds per trained run
  for i, (arm, seed, rel) in enumerate(runs):
    # for_platform: result.json records the backend that ran (auto resolved), as config.json does.
    exp = sources_lib.resolve(suite, arm.experiment, seed, workdir).for_platform()
    path = os.path.join(workdir, rel)
    tag = f"[{i + 1}/{len(runs)}] {rel}"
    if plan[rel] == "finished":
      say(f"{tag}: finished earlier, not retrained")
      with open(os.path.join(path, RESULT_FILE), encoding="utf-8") as f:
        results[rel] = json.load(f)
      for line in budget_lib.corpus_check({"this run": corpus, rel: results[rel].get("corpus")}):
        say(f"  ! {rel}: {line}; its numbers are not comparable with runs on this corpus: "
            "move the suite directory aside to retrain it here")
      continue
    after = todo[todo.index(rel) + 1:]
    # Suite ETA: the other runs' steps at this run's step time, plus the mean time
    # outside training of the runs done so far for this one and each after it (before
    # one is done, the trainer estimates it from this run; metrics_log.Progress).
    eta = metrics_log.SuiteEta(
        then_steps=sum(steps[r] for r in after),
        then_seconds=(sum(overhead) / len(overhead) * (len(after) + 1) if overhead else None),
        then_runs=len(after), **_analysis_passes(exp, dict(suite.analysis), analyse_runs))
    left = (f", suite ETA {metrics_log.format_duration(np.mean(walls) * (len(after) + 1))}"
            if walls else "")
    say(f"{tag}: training ({arm.name}, seed {seed}); {len(after)} more run(s) after it{left}")
    t0, c0 = time.perf_counter(), time.process_time()
    hook = _FinalEvalHook(exp)
    summary = train_fn(exp, path, out, eta, hook,
                       first_steps.first_steps_probe(path) if seed == suite.seeds[0] else None)
    t_trained, c_trained = time.perf_counter(), time.process_time()
    # Before anything of the run's result: a router that used more experts than it declares
    # (process 0 reads the log and decides for every process).
    processes.decided_by_lead(lambda: realised.check_run(exp, b[arm.name], path, rel))
    rows = metrics_log.read_metrics(path, "train")
    res = {"suite": suite.name, "arm": arm.name, "seed": seed, "run": rel, "scale": suite.scale,
           "budget": b[arm.name].as_dict(), "train_summary": summary,
           **train_metrics(path)}
    # The trainer's final evaluation when it made one here; else (a run trained earlier, or
    # a custom train_fn) the same evaluation of the final checkpoint.
    ev = hook.result or final_eval.final_evaluation(exp, path)
    res.update(_final_metrics(ev, path, write=processes.is_lead()))
    res.update(realised.from_evaluation(rows, ev, exp.model))
    if exp.finetune.enabled and seed in source_results and arm.experiment.finetune.source \
        == sources_lib.SUITE_SOURCE:
      res.update(sources_lib.finetune_metrics(exp, ev, source_results[seed]))
    res["corpus"], res["provenance"] = corpus, _run_provenance(prov, exp)
    t_evaluated, c_evaluated = time.perf_counter(), time.process_time()
    if analyse_runs:
      extra, routing = analyse(exp, path, dict(suite.analysis), say, final_routing=ev)
      res.update(extra)
      for name, layer in routing["layers"].items():  # the summary's counts, whole split
        if name not in ev.joints:
          continue
        layer["joint"] = ev.joints[name].tolist()
        layer["final_load"] = ev.loads[name].tolist()
      routing["joint_source"] = "final whole-split evaluation (moejax.ablation.final_eval)"
      _write_json(os.path.join(path, ROUTING_FILE), routing, indent=None)
    res["wall_seconds"] = time.perf_counter() - t0
    # Where the run's time went (training includes its periodic evaluations and, with the
    # hook, the final whole-split evaluation; final_eval is then only the fallback). The
    # CPU seconds (all threads of this process) stay comparable on a shared machine.
    res["phase_seconds"] = {"train": t_trained - t0, "final_eval": t_evaluated - t_trained,
                            "analysis": time.perf_counter() - t_evaluated}
    res["phase_cpu_seconds"] = {"train": c_trained - c0, "final_eval": c_evaluated - c_trained,
                                "analysis": time.process_time() - c_evaluated}
    res["experiment"] = json.loads(experiment_to_json(exp))
    _write_json(os.path.join(path, RESULT_FILE), res)  # last: marks the run finished
    processes.sync(f"moejax_ablate_run_{rel}")  # every process is done with this run
    results[rel] = res
    walls.append(res["wall_seconds"])
    trained = (summary or {}).get("train_seconds") or 0.0
    overhead.append(max(res["wall_seconds"] - trained, 0.0))
    # Rounded as the trainer's lines are (result.json keeps the full value).
    say(f"{tag}: done in {res['wall_seconds']:.0f}s, val loss {res['val_loss']:.3f}; "
        f"{os.path.join(path, RESULT_FILE)}")
  return results


def _analysis_passes(exp, options: dict, analyse_runs: bool) -> dict:
  """The routing analysis's forward passes after a run (:func:`analyse`): one per kept
  checkpoint, the final one reused from the final evaluation when the sample is the
  whole split."""
  if not analyse_runs or exp.model.moe is None:
    return {"after_passes": 0}
  tc = exp.train
  saves = (len(range(tc.checkpoint_every, tc.steps, tc.checkpoint_every)) + 1
           if tc.checkpoint_every else 1)
  n = options.get("routing_batches")
  kept = min(saves, tc.keep_checkpoints)
  return {"after_passes": kept - 1 if n is None else kept,
          "after_batches": None if n is None else int(n)}


def _report_suite(workdir: str, say) -> None:
  """Prints the suite's summary as text of at most 100 columns (moejax.ablation.terminal;
  summary.md has the markdown tables) and every output path of the suite."""
  path = os.path.join(workdir, "summary.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      say(terminal.render(json.load(f)))
    say(f"the tables as markdown: {os.path.join(workdir, 'summary.md')}")
  say(f"outputs in {workdir}:")
  plots = os.path.join(workdir, "plots")
  pngs = sorted(os.path.join("plots", n) for n in os.listdir(plots)) if os.path.isdir(plots) \
      else []
  for name in ["summary.md", "summary.json", "summary.csv", *pngs, "suite.json", "budget.json"]:
    if os.path.exists(os.path.join(workdir, name)):
      say(f"  {os.path.join(workdir, name)}")
  say(f"  {os.path.join(workdir, '<run>', RESULT_FILE)}, {ROUTING_FILE}, config.json, "
      "metrics.jsonl, tensorboard/, checkpoints/ per run")


def _final_metrics(ev: final_eval.FinalEval, path: str, write: bool = True) -> dict:
  """The run's final numbers from the whole-split evaluation, and (``write``) its
  per-document file."""
  if write:
    final_eval.write_per_doc(path, ev)
  out = {"val_loss": ev.metrics["loss"], "val_tokens": ev.metrics["tokens"],
         "per_doc": {"file": final_eval.PER_DOC_FILE,
                     "documents": int(ev.doc_count.size), "step": ev.step}}
  for k in ("max_vio_global", "specialisation_mi", "specialisation_mi_norm"):
    if k in ev.metrics:
      out[k] = ev.metrics[k]
  out["layers"] = {k: v for k, v in ev.metrics.items()
                   if "/" in k and not k.startswith("loss_domain/")}
  out["domain_losses"] = {k.split("/", 1)[1]: v for k, v in ev.metrics.items()
                          if k.startswith("loss_domain/")}
  return out


def _write_json(path: str, obj, indent: Optional[int] = 1) -> None:
  """Writes ``obj`` to ``path`` atomically; on process 0 only (the others' files are its)."""
  if not processes.is_lead():
    return
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


def _suite_plugins(suite) -> list:
  """The plugin modules of every arm, once each with the ideas of all arms (see
  moejax.config.plugins)."""
  from moejax.config import plugins as plugins_lib  # pylint: disable=g-import-not-at-top
  from moejax.config import to_dict  # pylint: disable=g-import-not-at-top
  return plugins_lib.merge(plugins_lib.used(to_dict(arm.experiment)) for arm in suite.arms)


def _run_provenance(prov: dict, exp: ExperimentConfig) -> dict:
  """The suite's provenance with the plugins of this run only (none: no ``plugins`` key)."""
  from moejax.config import plugins as plugins_lib  # pylint: disable=g-import-not-at-top
  from moejax.config import to_dict  # pylint: disable=g-import-not-at-top
  out = {k: v for k, v in prov.items() if k != "plugins"}
  own = plugins_lib.used(to_dict(exp))
  if own:
    out["plugins"] = own
  return out
