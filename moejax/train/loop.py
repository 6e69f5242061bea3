"""The training loop: checks, resume, steps, logging, evaluation, checkpoints.

::

    from moejax.train import loop
    summary = loop.train(experiment_config, "/tmp/run")   # resumes if /tmp/run has a checkpoint

Order of work, so that a bad run fails before it costs anything:

1. read-only checks: the config (already validated), the execution backend
   on this platform (:func:`check_runnable`), the device layout, the
   workdir (another live run's lock; :func:`moejax.train.checkpoint.check_workdir`:
   a config that would misdescribe the results already there is refused),
   the newest usable checkpoint (restored and checked finite, damaged ones
   skipped: :func:`moejax.train.checkpoint.restore_latest`), the datasets;
2. only then, holding the workdir's lock (:mod:`moejax.train.lock`), is
   anything written (config.json, history.jsonl, metrics, checkpoints) or
   computed (initialisation, compilation).

A run already at its final step trains nothing and writes nothing: it
reports its final numbers from ``metrics.jsonl``.

NaN / inf (:mod:`moejax.train.guard`): every step's loss and gradient norm
are checked when metrics are next read back (every log, eval and checkpoint
step), and the whole state (params, optimizer state, router state) before
every checkpoint; a failure stops the run with
:class:`~moejax.train.guard.NonFiniteError` naming the newest checkpoint on
disk, which passed the same check.

SIGTERM / SIGINT (:mod:`moejax.train.preempt`): the step in progress
finishes, its checkpoint is written, history.jsonl records ``preempted``,
the lock is released and :class:`~moejax.train.preempt.Preempted` is raised.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, NamedTuple, Optional, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from moejax import data as data_lib
from moejax.config import ConfigError
from moejax.evaluate.validation import evaluate, make_eval_step
from moejax.execution import gmm
from moejax.execution import mesh as mesh_lib
from moejax.execution import parallel as parallel_lib
from moejax.model import ExpertParallel
from moejax.train import audit as audit_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train import guard
from moejax.train import integrity
from moejax.train import layer_load
from moejax.train import lock as lock_lib
from moejax.train import metrics_log
from moejax.train import mfu as mfu_lib
from moejax.train import preempt as preempt_lib
from moejax.train import profiling
from moejax.train import step as step_lib
from moejax.train import write_failure
from moejax.train.config import ExperimentConfig, check_capacity, drop_warning
from moejax.train.context import Probe, RunContext, StartHook, check_start
from moejax.train.optim import make_optimizer

# Key of the checkpoint's data item holding the metric rows logged since the
# last train row, so a resumed run's first row averages the same steps.
WINDOW_KEY = "unlogged_metrics"


def check_runnable(cfg: ExperimentConfig) -> None:
  """ConfigError when the MoE execution backend cannot run on this platform as configured.

  A Pallas backend off its platform (``pallas_tpu`` on CPU) needs the
  interpret switch; found here, with the other validation, instead of as a
  traceback at trace time after the workdir was written.
  """
  name = ckpt_lib.field_value(cfg, ckpt_lib.BACKEND_FIELD)
  if cfg.model.moe is None or name not in gmm.backend_names():
    return  # dense, or the reference backend (plain XLA everywhere)
  interpret = bool(ckpt_lib.field_value(cfg, ckpt_lib.BACKEND_INTERPRET_FIELD))
  try:
    gmm.check_available(name, interpret=interpret)
  except gmm.GmmError as e:
    problem, _, fix = str(e).partition(". Fix: ")
    problem = problem.split(": ", 1)[-1]
    fix = fix.replace("pass interpret=True", f"set {ckpt_lib.BACKEND_INTERPRET_FIELD}=True")
    fix = fix.replace("drop interpret=True", f"set {ckpt_lib.BACKEND_INTERPRET_FIELD}=False")
    raise ConfigError(ckpt_lib.BACKEND_FIELD, name, problem,
                      fix.replace("backend=", f"{ckpt_lib.BACKEND_FIELD}=")) from e


def _eval_batches(cfg: ExperimentConfig, docs, put):
  it = data_lib.make_batch_iterator(docs, cfg.data.seq_len, cfg.data.batch_size,
                                    seed=cfg.data.seed, train=False,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count(),
                                    loss_labels=data_lib.loss_labels(cfg.data, docs))
  return (put(batch) for batch in it)


class DeviceLayout(NamedTuple):
  """Where the run's arrays live: the model's expert-parallel mesh (or None) and placement.

  ``shardings(tree)``: the NamedSharding of every leaf of a state tree (what
  ``put_state`` places it with, and what a checkpoint is restored into, so
  that every process reads only its own shards).
  """

  expert_parallel: Optional[ExpertParallel]
  put_batch: Callable
  put_state: Callable
  shardings: Callable


def device_layout(cfg: ExperimentConfig) -> DeviceLayout:
  """Checks ``cfg.parallel`` against the devices (no compute) and returns the layout.

  ``parallel.expert == 1`` (the default): data parallelism. Every device of
  every process holds a replica of the state and B / devices rows of each
  batch; ``jax.jit`` partitions the step from these shardings (gradients,
  MoE loads and losses are reduced over the global batch by the
  partitioner). On one device this is plain placement.

  ``parallel.expert > 1``: a ('data', 'fsdp', 'expert') mesh from
  :func:`moejax.execution.mesh.make_mesh`; the batch rows are split over every
  axis, the routed expert weights (and their optimizer moments) over
  'expert' (d over 'fsdp'), everything else is replicated, and the model's
  MoE layers run :func:`moejax.layer.ep_moe_layer` on the mesh.
  """
  pcfg, n = cfg.parallel, jax.device_count()
  try:
    pcfg.axis_sizes(n)  # ConfigError naming the axes when their product is not n
  except ConfigError as e:
    raise _on_processes(e) from None
  check_capacity(cfg, n)  # under expert parallelism a group is one device's rows
  if cfg.data.batch_size % n:
    raise _on_processes(ConfigError(
        "data.batch_size", cfg.data.batch_size,
        f"does not split evenly over the {n} devices of the mesh", f"use a multiple of {n}"))
  if pcfg.expert == 1:
    # Auto axes: the partitioner propagates shardings through the model (the
    # model code has no explicit-sharding annotations).
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                               for k, v in batch.items()}
    shardings = lambda tree: jax.tree.map(lambda _: replicated, tree)
    put_state = lambda state: jax.device_put(state, shardings(state))
    return DeviceLayout(None, put_batch, put_state, shardings)

  moe = cfg.model.moe
  mesh = mesh_lib.make_mesh(pcfg, cfg=moe)
  parallel_lib.resolve_dispatch(pcfg, mesh.devices.flat[0].platform)  # native ragged on CPU
  rows = NamedSharding(mesh, mesh_lib.batch_spec(mesh))
  put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                             for k, v in batch.items()}
  shardings = lambda tree: state_shardings(tree, mesh)
  put_state = lambda state: jax.device_put(state, shardings(state))
  return DeviceLayout(ExpertParallel(mesh, pcfg), put_batch, put_state, shardings)


def _on_processes(e: ConfigError) -> ConfigError:
  """``e`` saying how the devices are spread, on a multi-process run (where the count is
  the global one: every process's local devices)."""
  if jax.process_count() == 1:
    return e
  return ConfigError(e.field, e.value, f"{e.problem} ({jax.process_count()} processes x "
                     f"{jax.local_device_count()} local devices)", e.fix, e.where)


def state_shardings(state, mesh):
  """NamedShardings of a TrainState on an expert-parallel mesh.

  A leaf ``.../experts/<name>`` (the routed expert weights in ``params`` and
  their moments in ``opt_state``) gets the layer's expert spec (E over
  'expert', d over 'fsdp'), so the shard_map inside the step finds its
  inputs in place; every other leaf is replicated.
  """
  def sharding(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    if len(keys) >= 2 and keys[-2] == "experts" and getattr(leaf, "ndim", 0) == 3:
      return NamedSharding(mesh, mesh_lib.expert_param_specs({keys[-1]: None}, mesh)[keys[-1]])
    return NamedSharding(mesh, PartitionSpec())
  return jax.tree_util.tree_map_with_path(sharding, state)


def _mean_rows(rows: list[dict]) -> dict[str, float]:
  keys = rows[0].keys()
  return {k: float(np.mean([r[k] for r in rows])) for k in keys}


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

  # --- 1. Read-only checks. -------------------------------------------------
  check_runnable(cfg)
  check_start(cfg, start)
  layout = device_layout(cfg)
  lead = jax.process_index() == 0   # writes the workdir for every process of the run
  if lead:  # the other processes run under the lock process 0 takes
    lock_lib.check_unlocked(workdir, take_over_lock)
  plan = ckpt_lib.check_workdir(workdir, cfg, extend=extend)
  tx = make_optimizer(tc, cfg.model, cfg.finetune)
  graphdef, abstract = step_lib.abstract_state(cfg, tx, layout.expert_parallel)
  audit_lib.audit(cfg, abstract.params)  # init vs the accounting: AuditError before training
  # Restored straight into this run's layout: a checkpoint written under
  # another layout (another process count or mesh) is resharded by orbax,
  # and every process reads only the shards it holds.
  abstract_tree = abstract.checkpoint_tree()
  abstract_tree = jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_tree,
      layout.shardings(abstract_tree))
  restored = None
  if plan.step is not None:
    restored = ckpt_lib.restore_latest(workdir, plan.steps, abstract_tree, cfg)
    if restored.step >= tc.steps:
      say(f"{workdir}: finished at step {restored.step} (train.steps={tc.steps}); nothing to do "
          "(to train on: raise --config.train.steps and pass --extend)")
      for change in plan.changes:
        say(f"  (not recorded: {change})")
      return report(workdir, _summary(workdir), say)
  initial = None
  if start is not None:  # fine-tuning: checks (and opens) its source, says its accounting
    initial = start(cfg, fresh=restored is None, abstract_params=abstract.params, tx=tx,
                    say=say)
  # Process 0 first: a dataset prepared on first use is written once, then read
  # by the others (a shared data_dir would otherwise be prepared concurrently).
  # The barrier also orders every process's read-only checks above before
  # process 0's first write below.
  if not lead:
    _sync("moejax_train_data")
  train_it = data_lib.make_batches(cfg.data, cfg.data.train_split,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count())
  val_docs = data_lib.load_documents(cfg.data, cfg.data.eval_split)
  if lead:
    _sync("moejax_train_data")
  if val_docs.num_tokens() == 0:
    raise data_lib.DatasetUnavailableError(
        f"{cfg.data.name}/{cfg.data.eval_split} is empty. Fix: pick another data.eval_split "
        "or a larger validation fraction")

  # --- 2. Write and compute, holding the workdir. ---------------------------
  # One process of a multi-process run holds the lock for all of them.
  locked = (lock_lib.WorkdirLock(workdir, say, take_over_lock) if lead
            else contextlib.nullcontext())
  with locked, preempt_lib.Preemption(say) as stop:  # SIGTERM / SIGINT: moejax.train.preempt
    if ckpt_lib.checkpoint_steps(workdir) != list(plan.steps):
      raise ckpt_lib.WorkdirError(
          f"{workdir} changed while this run was checking it (checkpoints {list(plan.steps)} -> "
          f"{ckpt_lib.checkpoint_steps(workdir)}). Fix: run the same command again")
    _record_start(workdir, cfg, plan, restored, say)
    ckpt = ckpt_lib.Checkpointer(workdir, tc.keep_checkpoints, resumed=restored)
    writer = metrics_log.MetricsWriter.for_run(cfg, workdir, restored.step if restored else 0, lead)
    progress = metrics_log.Progress(tc.steps, out=out, enabled=tc.progress,
                                    **(suite._asdict() if suite else {}), in_suite=bool(suite))
    ctx = RunContext(cfg=cfg, workdir=workdir, graphdef=graphdef, tx=tx, restored=restored,
                     train_it=train_it, val_docs=val_docs, ckpt=ckpt, writer=writer,
                     progress=progress, say=say, layout=layout, final_eval=final_eval,
                     initial=initial, stop=stop, probe=None if restored else probe)
    try:
      step = _run(ctx)
    except guard.NonFiniteError as e:
      _history(workdir, "stopped", reason=str(e).split(":")[0],
                              train_seconds=progress.train_seconds)
      raise
    except Exception as e:  # a full disk, an unwritable file: one error, no thread left waiting
      failed = write_failure.stopped(e, workdir, ckpt)
      if failed is None:
        raise
      raise failed from e
    finally:
      profiling.stop()  # a trace cut short by an error
      write_failure.finish(ckpt, writer, failing=sys.exc_info()[0] is not None)
    _history(workdir, "preempted" if stop.signum else "end", step=step,
             train_seconds=progress.train_seconds)
  if probe is not None and probe.stop and restored is None:
    return {"step": step, "probed_rows": list(probe.rows)}
  if stop.signum:  # the lock is released, the checkpoint of `step` complete
    raise stop.preempted(step, os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR))
  _sync("moejax_train_end")  # process 0 has written the last rows that report() reads
  return report(workdir, _summary(workdir), say)


def _sync(name: str) -> None:
  """A barrier of every process of a multi-process run (nothing on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _record_start(workdir, cfg, plan, restored, say) -> None:
  """Moves damaged checkpoints aside, writes config.json and the history line of this start.

  Files are written by process 0 only; every process says what happens.
  """
  lead = jax.process_index() == 0
  if restored is not None and restored.skipped:
    skipped = [s for s, _ in restored.skipped]
    moved = (ckpt_lib.move_aside(workdir, skipped) if lead else
             [os.path.join(workdir, ckpt_lib.DAMAGED_DIR, str(s)) for s in skipped])
    for (s, why), dst in zip(restored.skipped, moved):
      say(f"{workdir}: checkpoint {s} is {why}; moved to {dst}")
    say(f"{workdir}: falling back to checkpoint {restored.step}, the newest that restores, is "
        "finite and matches its checksums (if it has any)")
  if restored is None:
    if plan.saved is not None and plan.changes:
      say(f"{workdir}: no checkpoint was written before it stopped; starting the run again "
          f"with this config")
    if lead:
      ckpt_lib.write_config(workdir, cfg)
    _history(workdir, "start", step=0, steps=cfg.train.steps)
    return
  for change in plan.changes:
    say(f"resuming with a changed execution / logging setting: {change}")
  if plan.extend_from is not None:
    say(f"{workdir}: extending the run from train.steps={plan.extend_from} to "
        f"{cfg.train.steps} (from step {restored.step}; the learning-rate schedule now decays "
        f"over {cfg.train.steps} steps)")
  if lead and (plan.changes or plan.extend_from is not None):
    ckpt_lib.write_config(workdir, cfg)  # not a finished run: it trains on under this config
  fields = {"step": restored.step, "changes": list(plan.changes)}
  if restored.skipped:
    fields["skipped"] = [f"{s}: {why}" for s, why in restored.skipped]
  if plan.extend_from is not None:
    _history(workdir, "extend", step=restored.step,
                            steps=[plan.extend_from, cfg.train.steps])
  _history(workdir, "resume", **fields)


def _history(workdir: str, event: str, **fields) -> None:
  if jax.process_index() == 0:  # one line per event, not one per process
    ckpt_lib.append_history(workdir, event, **fields)


def _summary(workdir: str) -> dict:
  out = {"step": None, "train_loss": None, "val_loss": None, "unigram_baseline": None}
  out.update(metrics_log.final_values(workdir))
  out["train_seconds"] = sum(float(h.get("train_seconds", 0.0))
                             for h in ckpt_lib.read_history(workdir)
                             if h.get("event") in ("end", "stopped", "preempted"))
  return out


def _fmt(v, digits: int = 4) -> str:
  return "n/a" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def report(workdir: str, summary: dict, say) -> dict:
  """Prints the headline numbers and every output path of the run; returns ``summary``."""
  line = (f"done: step {summary.get('step')} | train loss {_fmt(summary.get('train_loss'))} | "
          f"val loss {_fmt(summary.get('val_loss'))} (unigram "
          f"{_fmt(summary.get('unigram_baseline'), 3)})")
  if summary.get("max_vio_global") is not None:
    line += f" | MaxVio_global {_fmt(summary['max_vio_global'], 3)}"
  say(line)
  steps = ckpt_lib.checkpoint_steps(workdir)
  for name, path, note in (
      ("config", ckpt_lib.CONFIG_FILE, ""),
      ("metrics", metrics_log.METRICS_FILE, ""),
      ("tensorboard", metrics_log.TENSORBOARD_DIR,
       f"tensorboard --logdir {os.path.join(workdir, metrics_log.TENSORBOARD_DIR)}"),
      ("checkpoints", ckpt_lib.CHECKPOINT_DIR, f"steps {', '.join(map(str, steps))}"),
      ("profile", profiling.PROFILE_DIR, "jax.profiler trace: tensorboard --logdir "
       f"{os.path.join(workdir, profiling.PROFILE_DIR)}"),
      ("history", ckpt_lib.HISTORY_FILE, ""),
      ("damaged", ckpt_lib.DAMAGED_DIR, "checkpoints that did not restore")):
    full = os.path.join(workdir, path)
    if os.path.exists(full):
      say(f"  {name:<12} {full}{f'  ({note})' if note else ''}")
  return summary


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
  cfg, workdir, say = ctx.cfg, ctx.workdir, ctx.say
  train_it, val_docs, ckpt, writer, progress = (ctx.train_it, ctx.val_docs, ctx.ckpt,
                                                ctx.writer, ctx.progress)
  graphdef, tx, final_eval = ctx.graphdef, ctx.tx, ctx.final_eval
  put_batch = ctx.layout.put_batch
  tc = cfg.train
  unigram = data_lib.unigram_cross_entropy(train_it.docs, val_docs)
  state, window, start = _first_state(ctx, unigram)  # window: host metrics not yet logged

  train_step = step_lib.make_train_step(graphdef, cfg, tx)
  eval_step = make_eval_step(graphdef, cfg.model, len(val_docs.domain_names))
  meter = mfu_lib.Meter.for_run(cfg)  # its peak is read, never measured (moejax.train.mfu)
  say(meter.describe())
  profiler = profiling.StepProfiler(workdir, tc.profile_steps, start, say)
  pending: list = []          # device metrics not yet read back
  tokens = 0.0                # target tokens of the timed steps of this window
  step = start
  t0 = time.perf_counter()
  compiled = False

  timed_steps, excluded = 0, 0.0   # steps and eval/checkpoint seconds of this window
  whole = len(data_lib.make_batch_iterator(val_docs, cfg.data.seq_len, cfg.data.batch_size,
                                           seed=cfg.data.seed, train=False))
  progress.plan_evals(
      evals_left=(len(range((start // tc.eval_every + 1) * tc.eval_every, tc.steps,
                            tc.eval_every)) if tc.eval_every else 0),
      eval_batches=min(tc.eval_batches or whole, whole), final_batches=whole)
  while step < tc.steps:
    batch = next(train_it)
    state, metrics = train_step(state, put_batch(batch))
    step += 1
    pending.append(metrics)
    if ctx.probe is not None and ctx.probe.after_step(step, metrics, tc.steps):
      break  # a re-check's last step: nothing of it is logged, evaluated or saved
    # A signal: this step is the last, checkpointed (every process stops at the same step).
    stop = ctx.stop is not None and step < tc.steps and ctx.stop.should_stop(step)
    if compiled:
      # Every non-padding target (data.loss_domains scores a subset of them).
      tokens += float(batch.get("valid", batch["mask"]).sum()) * jax.process_count()
      timed_steps += 1
    else:
      # The first step compiles; keep it out of tokens/s and the ETA.
      jax.block_until_ready(metrics)
      say(f"compiled and ran the first step in {time.perf_counter() - t0:.1f}s")
      progress.first_step_done()
      compiled, t0 = True, time.perf_counter()
    excluded += profiler.after_step(step, metrics)  # trace start / write: not step time
    log_now = step % tc.log_every == 0 or step == tc.steps
    eval_now = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
    ckpt_now = ((tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps
                or stop)
    if not (log_now or eval_now or ckpt_now):
      continue
    host = [layer_load.host_row(m) for m in jax.device_get(pending)]
    pending = []
    _check_rows(host, step, ckpt, workdir)
    ckpt.poll()  # the checksums of a checkpoint orbax has committed since
    if ckpt_now:  # before evaluating or saving a non-finite state; its seconds: not step time
      excluded += _check_state(state.checkpoint_tree(), step, ckpt, workdir)
    window.extend(host)
    if log_now:
      now = time.perf_counter()
      elapsed = max(now - t0 - excluded, 1e-9)
      row, loads = layer_load.summarise(_mean_rows(window))
      row["tokens_per_s"] = tokens / elapsed if timed_steps else 0.0
      row.update(meter.row(timed_steps, elapsed))
      row["epoch"] = train_it.epoch
      progress.add_time(elapsed, timed_steps)
      writer.write(step, "train", row)
      writer.histograms(step, "train", {f"load/{n}": layer_load.relative(v)
                                        for n, v in loads.items()})
      extra = "".join(f" | {name} {row[key]:.3f}" for key, name in
                      (("max_vio_batch", "MaxVio"), ("drop_rate", "drop")) if key in row)
      progress.line(step, row["tokens_per_s"], row["loss"], extra + mfu_lib.progress_text(row))
      if step <= start + tc.log_every and (warning := drop_warning(cfg, row)):
        say(warning)  # the first row of this segment: most copies skip their experts
      window = []
      tokens, timed_steps, excluded, t0 = 0.0, 0, 0.0, now
    if eval_now:
      t_eval = time.perf_counter()
      final = step == tc.steps
      if final and final_eval is not None:
        result = dict(final_eval(state.params, state.router_state, state.other))
      else:
        result = evaluate(eval_step, state.params, state.router_state, state.other,
                          _eval_batches(cfg, val_docs, put_batch),
                          None if final else tc.eval_batches, val_docs.domain_names)
      result["unigram_baseline"] = unigram
      writer.write(step, "eval", result)
      extra = "".join(f" | {name} {result[key]:.3f}" for key, name in
                      (("max_vio_global", "MaxVio_global"), ("specialisation_mi", "MI"))
                      if key in result)
      full = final or tc.eval_batches is None
      say(f"eval step {step}{' (whole split)' if full else ''}: val loss "
          f"{result['loss']:.4f} (unigram {unigram:.3f}){extra}")
      excluded += time.perf_counter() - t_eval
      progress.add_eval(time.perf_counter() - t_eval, progress.eval_batches, final=final)
    if ckpt_now:
      t_ckpt = time.perf_counter()
      ckpt.save(step, state.checkpoint_tree(), {**train_it.get_state(), WINDOW_KEY: window})
      excluded += time.perf_counter() - t_ckpt
    if stop:
      break

  ckpt.wait()
  return step


_FIX = ("Fix: lower train.learning_rate, raise train.warmup_steps or set train.grad_clip, and "
        "run in a new --workdir (this one's config.json describes its checkpoints)")


def _last_good(ckpt, workdir: str, at: int, fix: str = _FIX) -> str:
  """Where the run stands after a NaN at step ``at``, and ``fix``; or, when no checkpoint was
  saved since the run resumed, that the resume checkpoint may be at fault (its own fix)."""
  ckpt.wait()
  last = ckpt.latest_step()
  resumed = ckpt.resumed
  suspect = integrity.resume_suspect(
      resumed.step if resumed else None, bool(resumed and resumed.verified), last, at,
      ckpt_lib.checkpoint_steps(workdir), os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR),
      os.path.join(workdir, ckpt_lib.DAMAGED_DIR), fix)
  if suspect:
    return suspect
  if last is None:
    return f"no checkpoint was written before it. {fix}"
  return (f"the last good checkpoint (checked finite before it was saved) is step {last} in "
          f"{os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)}. {fix}")


def _check_rows(rows: list[dict], step: int, ckpt, workdir: str) -> None:
  bad = guard.first_nonfinite_row(rows, step - len(rows) + 1)
  if bad is None:
    return
  at, key, row = bad
  raise guard.NonFiniteError(
      f"{'loss' if key == 'loss' else 'gradient norm'} is {row[key]} at step {at} (loss "
      f"{row.get('loss')}, cross-entropy {row.get('ce')}, aux {row.get('aux_loss')}, grad norm "
      f"{row.get('grad_norm')}): stopping; nothing was saved after it, "
      f"{_last_good(ckpt, workdir, at)}")


def _check_state(tree, step: int, ckpt, workdir: str) -> float:  # seconds (reads every array)
  t0, bad = time.perf_counter(), guard.nonfinite_leaves(tree)
  if not bad:
    return time.perf_counter() - t0
  raise guard.NonFiniteError(
      f"the train state after step {step} is not finite ({guard.describe(bad)}), though every "
      f"loss and gradient norm up to it was: stopping without saving it; "
      + _last_good(ckpt, workdir, step, fix=(
          "Fix: a router_state leaf points at the bias controller (model.moe.balance.bias_rate), "
          "params / opt_state at the optimizer: " + _FIX.split(": ", 1)[1])))
