r"""Training-step profile (``--suite=step``): where one step of a suite arm spends its time.

Usage:
  python -m experiments.bench --suite=step --step_suite=configs/ablations/lossfree.py \
      --step_scale=m --json_out=/tmp/step_m.json

Builds the arm (``--step_arm``, default the suite's baseline) at the rung
``--step_scale`` of the scale ladder (moejax.ablation.scale) and times, side
by side in one process (round-robin repeats, medians):

* ``train step``: the trainer's jitted step (moejax.train.step) on real
  batches: forward, backward, AdamW, bias controller, metrics;
* its parts, each jitted alone with the model's own modules and shapes:
  ``attention`` (one block's attention, forward+backward of params and input,
  times the layers), ``MoE FFN`` (one MoE layer with its losses and metrics,
  forward+backward, times the MoE layers), ``dense FFN`` of the same active
  width (what the MoE layer is compared with), ``embedding + LM head + CE``,
  ``optimizer`` (AdamW update and apply); ``rest`` = step - parts (norms,
  residuals, the controller, XLA's scheduling of the whole program);
* ``eval forward``: one validation batch of the trainer's eval step;
* host work per step: ``data`` (packing the next batch and placing it),
  per log line ``metrics read-back``, per checkpoint ``checkpoint save``;
* compilation of the train step and the eval step.

``--step_twin`` times the MoE config's step against its dense twin's instead
(experiments/benchmarks/twin.py).

Each time is reported as wall seconds and as this process's CPU seconds
(``time.process_time``, all threads): on a machine shared with other jobs
the wall time stretches with the load while the CPU time stays close to the
work done, so the CPU column is the one to compare between runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry, twin

_SUITE = flags.DEFINE_string("step_suite", "configs/ablations/lossfree.py",
                             "suite file whose arm --suite=step profiles")
_ARM = flags.DEFINE_string("step_arm", None, "arm to profile (default: the suite's baseline)")
_SCALE = flags.DEFINE_string("step_scale", "m", "rung of the scale ladder: s, m or l")
_STEP_REPEATS = flags.DEFINE_integer("step_repeats", 10, "timed runs per part (median)")


def time_parts(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
  """Median wall and CPU seconds per fn (``bench_lib.time_round_robin``: round-robin, the
  compiling first run excluded); a part that fails stops the profile with its error."""
  timed = bench_lib.time_round_robin(fns, repeats)
  failed = {n: t["error"] for n, t in timed.items() if "error" in t}
  if failed:
    raise bench_lib.BenchFailed(f"step profile: parts failed: {failed}")
  return {n: {"wall_s": t["median_s"], "cpu_s": t["cpu_s"]} for n, t in timed.items()}


def _arm(path: str, arm: str | None, scale: str):
  from moejax.ablation import suite as suite_lib  # pylint: disable=g-import-not-at-top
  tree = suite_lib.load_suite_file(path)
  tree = tree.to_dict() if hasattr(tree, "to_dict") else dict(tree)
  tree["scale"] = scale
  suite = suite_lib.suite_from_dict(tree)
  return suite.arm(arm or suite.baseline).experiment


def step_suite(conditions: dict) -> dict:
  """The step profile of --step_suite / --step_arm at --step_scale (see the module doc)."""
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from moejax import data as data_lib
  from moejax.evaluate.validation import make_eval_step
  from moejax.nn.ffn import DenseFFN
  from moejax.nn.losses import masked_cross_entropy
  from moejax.topology.accounting import budget as model_budget
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import layer_load
  from moejax.train import step as step_lib
  from moejax.train.optim import make_optimizer
  import optax

  exp = _arm(_SUITE.value, _ARM.value, _SCALE.value)
  cfg, b, s = exp.model, exp.data.batch_size, exp.data.seq_len
  tx = make_optimizer(exp.train, cfg)
  graphdef, state = step_lib.init_state(exp, tx)
  train_it = data_lib.make_batches(exp.data, exp.data.train_split)
  put = lambda batch: {k: jnp.asarray(v) for k, v in batch.items()}
  batches = [put(next(train_it)) for _ in range(4)]

  step = step_lib.make_train_step(graphdef, exp, tx)
  t, c = time.perf_counter(), time.process_time()
  step_c = step.lower(state, batches[0]).compile()
  compile_step = (time.perf_counter() - t, time.process_time() - c)
  holder = {"state": state, "i": 0}

  def train_step():
    holder["i"] += 1
    holder["state"], metrics = step_c(holder["state"], batches[holder["i"] % len(batches)])
    return metrics

  val_docs = data_lib.load_documents(exp.data, exp.data.eval_split)
  val = data_lib.make_batch_iterator(val_docs, s, b, seed=exp.data.seed, train=False)
  val_batches = len(val)
  vbatch = put(next(iter(val)))
  eval_step = make_eval_step(graphdef, cfg, len(val_docs.domain_names))
  args = (state.params, state.router_state, state.other)
  t, c = time.perf_counter(), time.process_time()
  eval_c = eval_step.lower(*args, vbatch).compile()
  compile_eval = (time.perf_counter() - t, time.process_time() - c)

  # The parts, with the model's own modules.
  model = nnx.merge(graphdef, state.params, state.router_state, state.other)
  block = next(blk for blk in model.blocks if getattr(blk, "is_moe", False))
  x = jax.random.normal(jax.random.key(1), (b, s, cfg.d_model))
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  tokens = batches[0]["inputs"]

  def grad_of(module, loss):
    gd, p, rest = nnx.split(module, nnx.Param, ...)
    f = jax.jit(jax.grad(lambda p, x: loss(nnx.merge(gd, p, rest), x), argnums=(0, 1)))
    return lambda: f(p, x)

  def moe_loss(ffn, x):
    y, aux = ffn(x, tokens, train=True, rng=jax.random.key(0))
    metrics = sum(jnp.sum(v) for v in jax.tree.leaves(aux) if jnp.issubdtype(v.dtype, jnp.inexact))
    return jnp.sum(y * y) + aux["losses"]["total"] + 0.0 * jax.lax.stop_gradient(metrics)

  moe = cfg.moe
  active_width = int(round(sum(moe.widths) * moe.routing.top_k / max(moe.topology.num_experts, 1)))
  dense = DenseFFN(cfg.d_model, active_width, "swiglu", rngs=nnx.Rngs(0))
  head_w = jax.random.normal(jax.random.key(2), (cfg.d_model, cfg.vocab_size)) * 0.02
  embed_w = jax.random.normal(jax.random.key(3), (cfg.vocab_size, cfg.d_model))
  mask = jnp.ones((b, s), bool)

  def head_loss(w, e):
    logits = (e[tokens] @ w).astype(jnp.float32)
    _, ce, n = masked_cross_entropy(logits, batches[0]["targets"], mask)
    return ce / n

  head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
  grads = jax.tree.map(jnp.ones_like, state.params)
  update = jax.jit(lambda g, o, p: optax.apply_updates(p, tx.update(g, o, p)[0]))
  n_layers = cfg.n_layers
  n_moe = sum(cfg.is_moe_layer(i) for i in range(n_layers))
  fns = {
      "train step": train_step,
      "attention": grad_of(block.attn, lambda a, x: jnp.sum(a(x, pos) ** 2)),
      "MoE FFN": grad_of(block.ffn, moe_loss),
      "dense FFN": grad_of(dense, lambda f, x: jnp.sum(f(x) ** 2)),
      "embedding + LM head + CE": lambda: head(head_w, embed_w),
      "optimizer": lambda: update(grads, state.opt_state, state.params),
      "eval forward": lambda: eval_c(*args, vbatch),
  }
  times = time_parts(fns, _STEP_REPEATS.value)
  mult = {"attention": n_layers, "MoE FFN": n_moe, "dense FFN": n_moe}
  for name, m in mult.items():
    times[name] = {k: v * m for k, v in times[name].items()}
    times[name]["per_layer"] = m

  # Host work.
  data_t = []
  for _ in range(20):
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(put(next(train_it)))
    data_t.append((time.perf_counter() - t, time.process_time() - c))
  pending = [train_step() for _ in range(exp.train.log_every)]
  jax.block_until_ready(pending)
  t, c = time.perf_counter(), time.process_time()
  [layer_load.host_row(m) for m in jax.device_get(pending)]  # what the loop reads back
  readback = (time.perf_counter() - t, time.process_time() - c)
  tmp = tempfile.mkdtemp(prefix="moejax_step_bench_")
  try:
    ckpt = ckpt_lib.Checkpointer(tmp, 2)
    tree = holder["state"].checkpoint_tree()
    ckpt.save(1, tree, train_it.get_state())  # first save: orbax's own setup
    ckpt.wait()
    t, c = time.perf_counter(), time.process_time()
    ckpt.save(2, tree, train_it.get_state())
    ckpt.wait()
    save = (time.perf_counter() - t, time.process_time() - c)
    ckpt.close()
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  host = {"data (per step)": tuple(float(np.median(v)) for v in zip(*data_t)),
          "metrics read-back (per log line)": readback,
          "checkpoint save (per checkpoint)": save,
          "compile train step": compile_step, "compile eval step": compile_eval}
  for name, (w, c) in host.items():
    times[name] = {"wall_s": w, "cpu_s": c}
  parts = ("attention", "MoE FFN", "embedding + LM head + CE", "optimizer")
  times["rest of the step"] = {k: times["train step"][k] - sum(times[p][k] for p in parts)
                               for k in ("wall_s", "cpu_s")}
  bud = model_budget(cfg, s)
  return {"conditions": conditions, "suite": _SUITE.value, "scale": _SCALE.value,
          "arm": _ARM.value, "shape": {"d_model": cfg.d_model, "n_layers": n_layers,
                                      "moe_layers": n_moe, "batch": b, "seq_len": s,
                                      "params": int(bud.total), "active": float(bud.active),
                                      "flops_per_token": float(bud.flops_per_token)},
          "steps": exp.train.steps, "log_every": exp.train.log_every,
          "val_batches": val_batches, "times": times}


ORDER = ("train step", "attention", "MoE FFN", "embedding + LM head + CE", "optimizer",
         "rest of the step", "dense FFN", "eval forward", "data (per step)",
         "metrics read-back (per log line)", "checkpoint save (per checkpoint)",
         "compile train step", "compile eval step")


def step_markdown(res: dict) -> str:
  """The profile's header line and table (also docs/benchmarks.md's ``step_profile`` block)."""
  sh, times = res["shape"], res["times"]
  step_cpu = times["train step"]["cpu_s"]
  tokens = res["steps"] * sh["batch"] * sh["seq_len"]
  lines = [f"{res['suite']} at scale {res['scale']}: d={sh['d_model']}, {sh['n_layers']} layers "
           f"({sh['moe_layers']} MoE), batch {sh['batch']} x {sh['seq_len']}, "
           f"{sh['params'] / 1e6:.2f}M params ({sh['active'] / 1e6:.2f}M active); "
           f"{res['steps']} steps ({tokens / 1e3:.0f}K tokens, "
           f"{3 * sh['flops_per_token'] * tokens / 1e12:.2f} TFLOP of training), "
           f"{res['val_batches']} validation batches", "",
           "| part | wall ms | CPU ms | CPU share of the step |", "|---|---:|---:|---:|"]
  for name in ORDER:
    t = times[name]
    layers = f" (x{t['per_layer']} layers)" if "per_layer" in t else ""
    share = (f"{100 * t['cpu_s'] / step_cpu:.0f}%" if name in ORDER[1:6] else "")
    lines.append(f"| {name}{layers} | {1e3 * t['wall_s']:.1f} | {1e3 * t['cpu_s']:.1f} | "
                 f"{share} |")
  return "\n".join(lines) + "\n"


def print_step_table(res: dict) -> None:
  print(step_markdown(res))


def run() -> dict:
  """--suite=step: the twin comparison under --step_twin, else the one-arm profile."""
  if twin.enabled():
    return twin.run_from_flags(bench_lib.conditions())
  return step_suite(bench_lib.conditions())


def show(res: dict) -> None:
  (twin.print_twin_table if twin.enabled() else print_step_table)(res)


SUITE = registry.register(registry.Suite(
    "step", "one training step by part, or (--step_twin) the MoE step vs its dense twin",
    run, show))
