"""The training loop: checks, resume, steps, logging, evaluation, checkpoints.

::

    from moejax.train import loop
    summary = loop.train(experiment_config, "/tmp/run")   # resumes if /tmp/run has a checkpoint

Order of work, so that a bad run fails before it costs anything:

1. read-only checks: the config (already validated), the workdir
   (:func:`moejax.train.checkpoint.check_workdir`; checkpoint shapes against
   the model's abstract shapes), the datasets (absent: a clear error);
2. only then is anything written (config.json, metrics, checkpoints) or
   computed (initialisation, compilation).

Every step's loss is checked for NaN/inf when metrics are next read back
(every log, eval and checkpoint step, before the checkpoint is written): a
non-finite loss stops the run with :class:`NonFiniteLossError`, and the
checkpoints on disk are the last good ones.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, NamedTuple, Optional, TextIO

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moejax import data as data_lib
from moejax.config import ConfigError
from moejax.evaluate.validation import evaluate, make_eval_step
from moejax.execution import mesh as mesh_lib
from moejax.execution import parallel as parallel_lib
from moejax.model import ExpertParallel
from moejax.train import checkpoint as ckpt_lib
from moejax.train import metrics_log
from moejax.train import step as step_lib
from moejax.train.config import ExperimentConfig
from moejax.train.optim import make_optimizer


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or inf; the run stopped without saving after it."""


def _eval_batches(cfg: ExperimentConfig, docs, put):
  it = data_lib.make_batch_iterator(docs, cfg.data.seq_len, cfg.data.batch_size,
                                    seed=cfg.data.seed, train=False,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count())
  return (put(batch) for batch in it)


class DeviceLayout(NamedTuple):
  """Where the run's arrays live: the model's expert-parallel mesh (or None) and placement."""

  expert_parallel: Optional[ExpertParallel]
  put_batch: Callable
  put_state: Callable


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
  MoE layers run :func:`moejax.execution.parallel.ep_moe_layer` on the mesh.
  """
  pcfg, n = cfg.parallel, jax.device_count()
  pcfg.axis_sizes(n)  # ConfigError naming the axes when their product is not n
  if cfg.data.batch_size % n:
    raise ConfigError("data.batch_size", cfg.data.batch_size,
                      f"does not split evenly over the {n} devices of the mesh",
                      f"use a multiple of {n}")
  if pcfg.expert == 1:
    # Auto axes: the partitioner propagates shardings through the model (the
    # model code has no explicit-sharding annotations).
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                               for k, v in batch.items()}
    put_state = lambda state: jax.device_put(state, replicated)
    return DeviceLayout(None, put_batch, put_state)

  moe = cfg.model.moe
  mesh = mesh_lib.make_mesh(pcfg, cfg=moe)
  parallel_lib.resolve_dispatch(pcfg, mesh.devices.flat[0].platform)  # native ragged on CPU
  rows = NamedSharding(mesh, mesh_lib.batch_spec(mesh))
  put_batch = lambda batch: {k: jax.make_array_from_process_local_data(rows, v)
                             for k, v in batch.items()}
  put_state = lambda state: jax.device_put(state, state_shardings(state, mesh))
  return DeviceLayout(ExpertParallel(mesh, pcfg), put_batch, put_state)


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


def train(cfg: ExperimentConfig, workdir: str, *, out: TextIO = sys.stdout) -> dict:
  """Trains (or resumes) the run in ``workdir``; returns a summary dict.

  Raises:
    moejax.config.ConfigError / checkpoint.WorkdirError /
    moejax.data.DatasetUnavailableError: before any compute or write.
    NonFiniteLossError: the loss became NaN/inf (checkpoints before it kept).
  """
  tc = cfg.train
  say = lambda text: print(text, file=out, flush=True)

  # --- 1. Read-only checks. -------------------------------------------------
  layout = device_layout(cfg)
  resume_step, train_changes = ckpt_lib.check_workdir(workdir, cfg)
  tx = make_optimizer(tc)
  graphdef, abstract = step_lib.abstract_state(cfg, tx, layout.expert_parallel)
  abstract_tree = abstract.checkpoint_tree()
  if resume_step is not None:
    ckpt_lib.Checkpointer(workdir, tc.keep_checkpoints, read_only=True).check_shapes(
        resume_step, abstract_tree)
  train_it = data_lib.make_batches(cfg.data, cfg.data.train_split,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count())
  val_docs = data_lib.load_documents(cfg.data, cfg.data.eval_split)
  if val_docs.num_tokens() == 0:
    raise data_lib.DatasetUnavailableError(
        f"{cfg.data.name}/{cfg.data.eval_split} is empty. Fix: pick another data.eval_split "
        "or a larger validation fraction")
  if resume_step is not None and resume_step >= tc.steps:
    say(f"{workdir}: checkpoint at step {resume_step} >= train.steps={tc.steps}; "
        "nothing to do (raise --config.train.steps to continue)")

  # --- 2. Write and compute. ---------------------------------------------
  if resume_step is None or train_changes:
    for change in train_changes:
      say(f"resuming with a changed train/parallel config: {change}")
    ckpt_lib.write_config(workdir, cfg)
  ckpt = ckpt_lib.Checkpointer(workdir, tc.keep_checkpoints)
  writer = metrics_log.MetricsWriter(workdir, resume_step or 0)
  try:
    return _run(cfg, workdir, graphdef, tx, abstract_tree, resume_step, train_it, val_docs,
                ckpt, writer, say, out, layout)
  finally:
    ckpt.wait()
    ckpt.close()
    writer.close()


def _run(cfg, workdir, graphdef, tx, abstract_tree, resume_step, train_it, val_docs, ckpt,
         writer, say, out, layout) -> dict:
  tc = cfg.train
  put_batch, put_state = layout.put_batch, layout.put_state
  unigram = data_lib.unigram_cross_entropy(train_it.docs, val_docs)
  if resume_step is None:
    _, state = step_lib.init_state(cfg, tx, layout.expert_parallel)
    start = 0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    say(f"{workdir}: new run, {n_params / 1e6:.2f}M params, {tc.steps} steps of "
        f"{cfg.data.batch_size}x{cfg.data.seq_len} tokens on {cfg.data.name}; "
        f"unigram baseline {unigram:.3f} nats/token")
  else:
    tree, data_state = ckpt.restore(resume_step, abstract_tree)
    state = step_lib.TrainState(**tree)
    train_it.set_state(data_state)
    start = int(state.step)
    say(f"{workdir}: resumed from checkpoint at step {start}")
  state = put_state(state)

  train_step = step_lib.make_train_step(graphdef, cfg, tx)
  eval_step = make_eval_step(graphdef, cfg.model, len(val_docs.domain_names))
  progress = metrics_log.Progress(tc.steps, out=out, enabled=tc.progress)
  window: list[dict] = []     # host metrics since the last log line
  pending: list = []          # device metrics not yet read back
  tokens = 0.0                # target tokens of the timed steps of this window
  last_eval: dict = {}
  last_train: dict = {}
  step = start
  t0 = time.perf_counter()
  compiled = False

  timed_steps, excluded = 0, 0.0   # steps and eval/checkpoint seconds of this window
  while step < tc.steps:
    batch = next(train_it)
    state, metrics = train_step(state, put_batch(batch))
    step += 1
    pending.append(metrics)
    if compiled:
      tokens += float(batch["mask"].sum()) * jax.process_count()  # local rows only
      timed_steps += 1
    else:
      # The first step compiles; keep it out of tokens/s and the ETA.
      jax.block_until_ready(metrics)
      say(f"compiled and ran the first step in {time.perf_counter() - t0:.1f}s")
      compiled, t0 = True, time.perf_counter()
    log_now = step % tc.log_every == 0 or step == tc.steps
    eval_now = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
    ckpt_now = (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps
    if not (log_now or eval_now or ckpt_now):
      continue
    host = [{k: float(v) for k, v in m.items()} for m in jax.device_get(pending)]
    pending = []
    _check_finite(host, step, ckpt, workdir)
    window.extend(host)
    if log_now:
      now = time.perf_counter()
      elapsed = max(now - t0 - excluded, 1e-9)
      row = _mean_rows(window)
      row["tokens_per_s"] = tokens / elapsed if timed_steps else 0.0
      row["epoch"] = train_it.epoch
      progress.add_time(elapsed, timed_steps)
      writer.write(step, "train", row)
      extra = "".join(f" | {name} {row[key]:.3f}" for key, name in
                      (("max_vio_batch", "MaxVio"), ("drop_rate", "drop")) if key in row)
      progress.line(step, row["tokens_per_s"], row["loss"], extra)
      last_train, window = row, []
      tokens, timed_steps, excluded, t0 = 0.0, 0, 0.0, now
    if eval_now:
      t_eval = time.perf_counter()
      final = step == tc.steps
      result = evaluate(eval_step, state.params, state.router_state, state.other,
                        _eval_batches(cfg, val_docs, put_batch),
                        None if final else tc.eval_batches)
      result["unigram_baseline"] = unigram
      writer.write(step, "eval", result)
      extra = "".join(f" | {name} {result[key]:.3f}" for key, name in
                      (("max_vio_global", "MaxVio_global"), ("specialisation_mi", "MI"))
                      if key in result)
      full = final or tc.eval_batches is None
      say(f"eval step {step}{' (whole split)' if full else ''}: val loss "
          f"{result['loss']:.4f} (unigram {unigram:.3f}){extra}")
      last_eval = result
      excluded += time.perf_counter() - t_eval
    if ckpt_now:
      t_ckpt = time.perf_counter()
      ckpt.save(step, state.checkpoint_tree(), train_it.get_state())
      excluded += time.perf_counter() - t_ckpt

  ckpt.wait()
  summary = {"step": step, "train_loss": last_train.get("loss"),
             "val_loss": last_eval.get("loss"), "unigram_baseline": unigram,
             "train_seconds": progress.train_seconds}
  say(f"done: step {step}, train loss {summary['train_loss']}, val loss "
      f"{summary['val_loss']}, unigram baseline {unigram:.3f}")
  return summary


def _check_finite(rows: list[dict], step: int, ckpt, workdir: str) -> None:
  first = step - len(rows) + 1
  for i, row in enumerate(rows):
    if not math.isfinite(row["loss"]):
      ckpt.wait()
      last = ckpt.latest_step()
      keep = (f"the last good checkpoint is step {last} in {os.path.join(workdir, 'checkpoints')}"
              if last is not None else "no checkpoint was written before it")
      raise NonFiniteLossError(
          f"loss is {row['loss']} at step {first + i} (cross-entropy {row.get('ce')}, aux "
          f"{row.get('aux_loss')}, grad norm {row.get('grad_norm')}): stopping; nothing was "
          f"saved after it, {keep}. Fix: lower train.learning_rate, raise train.warmup_steps "
          "or set train.grad_clip, then resume from the workdir")
