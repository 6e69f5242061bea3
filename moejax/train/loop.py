"""The training loop: checks, resume, steps, logging, evaluation, checkpoints.

::

    from moejax.train import loop
    summary = loop.train(experiment_config, "/tmp/run")   # resumes if /tmp/run has a checkpoint

Order of work, so that a bad run fails before it costs anything:

1. read-only checks (:func:`_check`): the config (already validated), the
   execution backend on this platform, the device layout
   (:mod:`moejax.train.layout`), the workdir (another live run's lock; a
   config that would misdescribe the results already there is refused:
   :func:`moejax.train.checkpoint.check_workdir`), the newest usable
   checkpoint (restored and checked finite, damaged ones skipped:
   :func:`moejax.train.checkpoint.restore_latest`), the datasets;
2. only then, holding the workdir, is anything written (config.json,
   history.jsonl, metrics, checkpoints) or computed (initialisation,
   compilation): :func:`_run`, the steps.

A run already at its final step trains nothing and writes nothing: it
reports its final numbers from ``metrics.jsonl``.

The run's safety (the workdir lock, SIGTERM / SIGINT, the NaN / inf guard,
checkpoint checksums, failed writes) is one object the loop calls at a few
points: :class:`moejax.train.safety.RunSafety`, whose docstring says what
each part guarantees.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, TextIO

import jax
import numpy as np

from moejax import data as data_lib
from moejax.evaluate.validation import evaluate, make_eval_step
from moejax.train import audit as audit_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train import layer_load
from moejax.train import metrics_log
from moejax.train import mfu as mfu_lib
from moejax.train import processes
from moejax.train import profiling
from moejax.train import records
from moejax.train import safety as safety_lib
from moejax.train import step as step_lib
from moejax.train.config import ExperimentConfig, drop_warning
from moejax.train.context import Probe, RunContext, StartHook, check_start
# Importable from here as before they moved beside the loop.
from moejax.train.layout import (DeviceLayout, check_runnable, device_layout,  # noqa: F401
                                 state_shardings)
from moejax.train.optim import make_optimizer
from moejax.train.records import report  # noqa: F401
from moejax.train.safety import NAN_FIX as _FIX, last_good as _last_good  # noqa: F401

# Key of the checkpoint's data item holding the metric rows logged since the
# last train row, so a resumed run's first row averages the same steps.
WINDOW_KEY = "unlogged_metrics"


def train(cfg: ExperimentConfig, workdir: str, *, out: TextIO = sys.stdout,
          extend: bool = False, suite: Optional[metrics_log.SuiteEta] = None,
          final_eval: Optional[Callable] = None, probe: Optional[Probe] = None,
          start: Optional[StartHook] = None, take_over_lock: bool = False) -> dict:
  """Trains (or resumes) the run in ``workdir``; returns a summary dict.

  Args:
    cfg: the experiment.
    workdir: the run's directory (see moejax.train.checkpoint).
    out: where progress goes.
    extend: allow ``cfg.train.steps`` above the stored run's and train the
      extra steps (the cosine schedule is then stretched from the resumed
      step on: not the same run as a fresh longer one).
    suite: inside a suite, what is left after this run (the later runs'
      steps, their measured other time, ...), for the progress line's suite
      ETA (:class:`moejax.train.metrics_log.SuiteEta`).
    final_eval: ``(params, router_state, other) -> metrics`` replacing the
      trainer's own whole-split evaluation at the last step (the metrics of
      :func:`moejax.evaluate.validation.summarise` over the whole split): the
      ablation runner passes its per-document evaluation, so the split is
      read once per run instead of twice. None: the trainer's own.
    start: how the run starts when it does not start from its
      initialisation (:class:`moejax.train.context.StartHook`); a
      fine-tuning config needs one (``moejax.finetune.start.finetune_start``),
      a run from scratch ignores it.
    take_over_lock: take over a lock left by a run on another host whatever
      its heartbeat's age (``--take_over_lock``; :mod:`moejax.train.lock`).
    probe: reads a fresh run's first steps back (:class:`moejax.train.context.Probe`);
      with ``probe.stop`` the run ends there, returning ``{"step", "probed_rows"}``.

  Returns:
    ``{"step", "train_loss", "val_loss", "unigram_baseline",
    "max_vio_global" (MoE), "train_seconds"}``, read from metrics.jsonl;
    train_seconds sums every segment of the run (history.jsonl).

  Raises:
    moejax.config.ConfigError / checkpoint.WorkdirError (lock.WorkdirLockedError) /
    moejax.data.DatasetUnavailableError: before any compute or write.
    guard.NonFiniteError: a NaN/inf loss, gradient norm or state (checkpoints
    before it kept).
  """
  # A config built in Python or by replace(): what will run, backend 'auto' resolved for this
  # platform (so config.json names the backend that ran).
  cfg = cfg.resolved().for_platform()
  tc = cfg.train
  say = lambda text: print(text, file=out, flush=True)
  safety = safety_lib.RunSafety(workdir, say, take_over_lock)

  # --- 1. Read-only checks. -------------------------------------------------
  run = _check(cfg, workdir, safety, extend, start, say)
  plan, restored, lead = run.plan, run.restored, safety.lead
  if restored is not None and restored.step >= tc.steps:
    say(f"{workdir}: finished at step {restored.step} (train.steps={tc.steps}); nothing to do "
        "(to train on: raise --config.train.steps and pass --extend)")
    for change in plan.changes:
      say(f"  (not recorded: {change})")
    return report(workdir, records.final_summary(workdir), say)

  # --- 2. Write and compute, holding the workdir. ---------------------------
  with safety.hold(plan.steps):  # one process holds the lock for all; SIGTERM / SIGINT
    records.record_start(workdir, cfg, plan, restored, say)
    ckpt = ckpt_lib.Checkpointer(workdir, tc.keep_checkpoints, resumed=restored)
    writer = metrics_log.MetricsWriter.for_run(cfg, workdir, restored.step if restored else 0, lead)
    progress = metrics_log.Progress(tc.steps, out=out, enabled=tc.progress,
                                    **(suite._asdict() if suite else {}), in_suite=bool(suite))
    ctx = RunContext(cfg=cfg, workdir=workdir, graphdef=run.graphdef, tx=run.tx,
                     restored=restored, train_it=run.train_it, val_docs=run.val_docs, ckpt=ckpt,
                     writer=writer, progress=progress, say=say, layout=run.layout,
                     safety=safety, final_eval=final_eval, initial=run.initial,
                     probe=None if restored else probe)
    with safety.guarding(ckpt, writer, progress):
      step = _run(ctx)
    safety.end(step, progress.train_seconds)
  if probe is not None and probe.stop and restored is None:
    return {"step": step, "probed_rows": list(probe.rows)}
  safety.raise_if_preempted(step)  # the lock is released, the checkpoint of `step` complete
  processes.sync("moejax_train_end")  # process 0 has written the last rows that report() reads
  return report(workdir, records.final_summary(workdir), say)


class _Checked(NamedTuple):
  """What the read-only checks found; a finished run's has no datasets (nothing to train)."""

  layout: DeviceLayout
  plan: ckpt_lib.ResumePlan
  tx: Any
  graphdef: Any
  restored: Optional[ckpt_lib.Restored]
  initial: Any = None
  train_it: Any = None
  val_docs: Any = None


def _check(cfg: ExperimentConfig, workdir: str, safety: safety_lib.RunSafety, extend: bool,
           start: Optional[StartHook], say) -> _Checked:
  """The read-only checks, in the order that fails a bad run soonest; nothing is written."""
  check_runnable(cfg)
  check_start(cfg, start)
  layout = device_layout(cfg)
  safety.check()  # another live run's lock
  plan = ckpt_lib.check_workdir(workdir, cfg, extend=extend)
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, abstract = step_lib.abstract_state(cfg, tx, layout.expert_parallel)
  audit_lib.audit(cfg, abstract.params)  # init vs the accounting: AuditError before training
  restored = None
  if plan.step is not None:
    restored = ckpt_lib.restore_latest(workdir, plan.steps, _restore_target(abstract, layout),
                                       cfg)
    if restored.step >= cfg.train.steps:
      return _Checked(layout, plan, tx, graphdef, restored)
  initial = None
  if start is not None:  # fine-tuning: checks (and opens) its source, says its accounting
    initial = start(cfg, fresh=restored is None, abstract_params=abstract.params, tx=tx,
                    say=say)
  return _Checked(layout, plan, tx, graphdef, restored, initial, *_datasets(cfg))


def _restore_target(abstract, layout: DeviceLayout):
  """The checkpoint tree of ``abstract`` placed in this run's layout.

  Restored straight into it: a checkpoint written under another layout
  (another process count or mesh) is resharded by orbax, and every process
  reads only the shards it holds.
  """
  tree = abstract.checkpoint_tree()
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree,
                      layout.shardings(tree))


def _datasets(cfg: ExperimentConfig):
  """(the training batches, the validation documents) of this process.

  Process 0 first: a dataset prepared on first use is written once, then
  read by the others (a shared data_dir would otherwise be prepared
  concurrently). The barrier also orders every process's read-only checks
  before process 0's first write.
  """
  lead = jax.process_index() == 0
  if not lead:
    processes.sync("moejax_train_data")
  train_it = data_lib.make_batches(cfg.data, cfg.data.train_split,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count())
  val_docs = data_lib.load_documents(cfg.data, cfg.data.eval_split)
  if lead:
    processes.sync("moejax_train_data")
  if val_docs.num_tokens() == 0:
    raise data_lib.DatasetUnavailableError(
        f"{cfg.data.name}/{cfg.data.eval_split} is empty. Fix: pick another data.eval_split "
        "or a larger validation fraction")
  return train_it, val_docs


def _first_state(ctx: RunContext, unigram: float):
  """(placed state, unlogged metric rows, its step): fresh (initialised, then
  ``ctx.initial``) or from the restored checkpoint, whose data position it restores."""
  cfg, workdir, say = ctx.cfg, ctx.workdir, ctx.say
  if ctx.restored is None:
    _, state = step_lib.init_state(cfg, ctx.tx, ctx.layout.expert_parallel)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    say(f"{workdir}: new run, {n_params / 1e6:.2f}M params, {cfg.train.steps} steps of "
        f"{cfg.data.batch_size}x{cfg.data.seq_len} tokens on {cfg.data.name}; "
        f"unigram baseline {unigram:.3f} nats/token")
    if ctx.initial is not None:
      state = ctx.initial.apply(state, ctx.tx)
      say(f"{workdir}: initialised from {ctx.initial.describe()}")
    return ctx.layout.put_state(state), [], 0
  state = step_lib.TrainState(**ctx.restored.tree)
  data_state = dict(ctx.restored.data_state)
  window = list(data_state.pop(WINDOW_KEY, []))
  ctx.train_it.set_state(data_state)
  start = int(state.step)
  say(f"{workdir}: resumed from checkpoint at step {start} ({ctx.restored.integrity})")
  return ctx.layout.put_state(state), window, start


def _run(ctx: RunContext) -> int:
  """The steps of the run described by ``ctx``; returns the last step done."""
  cfg, tc, safety, ckpt = ctx.cfg, ctx.cfg.train, ctx.safety, ctx.ckpt
  unigram = data_lib.unigram_cross_entropy(ctx.train_it.docs, ctx.val_docs)
  state, window, start = _first_state(ctx, unigram)  # window: host metrics not yet logged
  train_step = step_lib.make_train_step(ctx.graphdef, cfg, ctx.tx)
  eval_step = make_eval_step(ctx.graphdef, cfg.model, len(ctx.val_docs.domain_names))
  meter = mfu_lib.Meter.for_run(cfg)  # its peak is read, never measured (moejax.train.mfu)
  ctx.say(meter.describe())
  profiler = profiling.StepProfiler(ctx.workdir, tc.profile_steps, start, ctx.say)
  clock = _Clock()
  _plan_evals(ctx, start)
  pending: list = []  # device metrics not yet read back
  step = start
  while step < tc.steps:
    batch = next(ctx.train_it)
    state, metrics = train_step(state, ctx.layout.put_batch(batch))
    step += 1
    pending.append(metrics)
    if ctx.probe is not None and ctx.probe.after_step(step, metrics, tc.steps):
      break  # a re-check's last step: nothing of it is logged, evaluated or saved
    stop = safety.after_step(step, tc.steps)  # a signal: this step is the last, checkpointed
    clock.step_done(batch, metrics, ctx)
    clock.excluded += profiler.after_step(step, metrics)  # trace start / write: not step time
    log_now = step % tc.log_every == 0 or step == tc.steps
    eval_now = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
    ckpt_now = ((tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps
                or stop)
    if not (log_now or eval_now or ckpt_now):
      continue
    host = [layer_load.host_row(m) for m in jax.device_get(pending)]
    pending = []
    safety.check_rows(host, step)  # NaN / inf; then a committed checkpoint's checksums
    if ckpt_now:  # before evaluating or saving a non-finite state; its seconds: not step time
      clock.excluded += safety.before_checkpoint(state.checkpoint_tree(), step)
    window.extend(host)
    if log_now:
      _log(ctx, step, start, window, clock, meter)
      window = []
    if eval_now:
      clock.excluded += _evaluate(ctx, step, state, eval_step, unigram)
    if ckpt_now:
      t_ckpt = time.perf_counter()
      ckpt.save(step, state.checkpoint_tree(), {**ctx.train_it.get_state(), WINDOW_KEY: window})
      clock.excluded += time.perf_counter() - t_ckpt
    if stop:
      break
  ckpt.wait()
  return step


@dataclasses.dataclass
class _Clock:
  """Time of the steps since the last train row, for tokens/s, MFU and the ETA.

  The first step compiles and is kept out; so are the seconds of
  evaluations, checkpoints and traces (``excluded``).
  """

  tokens: float = 0.0  # target tokens of the timed steps
  steps: int = 0  # timed steps
  excluded: float = 0.0
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  compiled: bool = False

  def step_done(self, batch: dict, metrics, ctx: RunContext) -> None:
    if self.compiled:
      # Every non-padding target (data.loss_domains scores a subset of them).
      self.tokens += float(batch.get("valid", batch["mask"]).sum()) * jax.process_count()
      self.steps += 1
      return
    jax.block_until_ready(metrics)
    ctx.say(f"compiled and ran the first step in {time.perf_counter() - self.t0:.1f}s")
    ctx.progress.first_step_done()
    self.compiled, self.t0 = True, time.perf_counter()

  def restart(self, now: float) -> None:
    self.tokens, self.steps, self.excluded, self.t0 = 0.0, 0, 0.0, now


def _plan_evals(ctx: RunContext, start: int) -> None:
  """Tells the progress line the evaluations left, for its ETA."""
  cfg, tc = ctx.cfg, ctx.cfg.train
  whole = len(data_lib.make_batch_iterator(ctx.val_docs, cfg.data.seq_len, cfg.data.batch_size,
                                           seed=cfg.data.seed, train=False))
  ctx.progress.plan_evals(
      evals_left=(len(range((start // tc.eval_every + 1) * tc.eval_every, tc.steps,
                            tc.eval_every)) if tc.eval_every else 0),
      eval_batches=min(tc.eval_batches or whole, whole), final_batches=whole)


def _log(ctx: RunContext, step: int, start: int, window: list, clock: _Clock, meter) -> None:
  """Writes the train row of ``window`` (metrics, TensorBoard) and the progress line."""
  now = time.perf_counter()
  elapsed = max(now - clock.t0 - clock.excluded, 1e-9)
  row, loads = layer_load.summarise(_mean_rows(window))
  row["tokens_per_s"] = clock.tokens / elapsed if clock.steps else 0.0
  row.update(meter.row(clock.steps, elapsed))
  row["epoch"] = ctx.train_it.epoch
  ctx.progress.add_time(elapsed, clock.steps)
  ctx.writer.write(step, "train", row)
  ctx.writer.histograms(step, "train", {f"load/{n}": layer_load.relative(v)
                                        for n, v in loads.items()})
  extra = "".join(f" | {name} {row[key]:.3f}" for key, name in
                  (("max_vio_batch", "MaxVio"), ("drop_rate", "drop")) if key in row)
  ctx.progress.line(step, row["tokens_per_s"], row["loss"], extra + mfu_lib.progress_text(row))
  if step <= start + ctx.cfg.train.log_every and (warning := drop_warning(ctx.cfg, row)):
    ctx.say(warning)  # the first row of this segment: most copies skip their experts
  clock.restart(now)


def _evaluate(ctx: RunContext, step: int, state, eval_step, unigram: float) -> float:
  """Evaluates ``state`` (the whole split at the last step), writes and says the result;
  returns its seconds."""
  cfg, tc = ctx.cfg, ctx.cfg.train
  t_eval = time.perf_counter()
  final = step == tc.steps
  if final and ctx.final_eval is not None:
    result = dict(ctx.final_eval(state.params, state.router_state, state.other))
  else:
    result = evaluate(eval_step, state.params, state.router_state, state.other,
                      _eval_batches(cfg, ctx.val_docs, ctx.layout.put_batch),
                      None if final else tc.eval_batches, ctx.val_docs.domain_names)
  result["unigram_baseline"] = unigram
  ctx.writer.write(step, "eval", result)
  extra = "".join(f" | {name} {result[key]:.3f}" for key, name in
                  (("max_vio_global", "MaxVio_global"), ("specialisation_mi", "MI"))
                  if key in result)
  full = final or tc.eval_batches is None
  ctx.say(f"eval step {step}{' (whole split)' if full else ''}: val loss "
          f"{result['loss']:.4f} (unigram {unigram:.3f}){extra}")
  seconds = time.perf_counter() - t_eval
  ctx.progress.add_eval(time.perf_counter() - t_eval, ctx.progress.eval_batches, final=final)
  return seconds


def _eval_batches(cfg: ExperimentConfig, docs, put):
  it = data_lib.make_batch_iterator(docs, cfg.data.seq_len, cfg.data.batch_size,
                                    seed=cfg.data.seed, train=False,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count(),
                                    loss_labels=data_lib.loss_labels(cfg.data, docs))
  return (put(batch) for batch in it)


def _mean_rows(rows: list[dict]) -> dict[str, float]:
  keys = rows[0].keys()
  return {k: float(np.mean([r[k] for r in rows])) for k in keys}
