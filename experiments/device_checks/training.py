"""Training on the device: configs/default.py and a ~10x larger model, tokens/s and MFU."""

from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from experiments.device_checks.common import Plan, guarded
from moejax.train import mfu as mfu_lib

# Config fields this step sets, in one place (field paths move with the
# config redesign).
CONFIG_PATHS = {"backend": "model.moe.execution.backend",
                "interpret": "model.moe.execution.interpret",
                "compute_dtype": "model.compute_dtype", "d_model": "model.d_model",
                "n_layers": "model.n_layers", "n_heads": "model.n_heads",
                "num_experts": "model.moe.topology.num_experts",
                "expert_width": "model.moe.topology.expert_width",
                "seq_len": "data.seq_len", "batch_size": "data.batch_size"}
# The ~10x larger training model (12x the forward FLOPs per token of
# configs/default.py by moejax.topology.accounting; the JSON records the ratio).
LARGE = dict(d_model=384, n_layers=6, n_heads=6, num_experts=16, expert_width=384, seq_len=256)

def _set(tree, path: str, value) -> None:
  *parents, leaf = CONFIG_PATHS[path].split(".")
  for p in parents:
    tree = tree[p]
  tree[leaf] = value


def train_config(plan: Plan, large: bool):
  from configs import default  # the shipped default training config
  from moejax.train.config import experiment_from_dict
  tree = default.get_config().to_dict()
  for name, value in plan.train_small.items():
    _set(tree, name, value)
  if large:
    for name, value in LARGE.items():
      _set(tree, name, value if not plan.dry_run else max(2, value // 12))
    if plan.dry_run:
      _set(tree, "n_heads", 2)
  _set(tree, "backend", plan.train_backend)
  _set(tree, "compute_dtype", "bfloat16")
  return experiment_from_dict(tree)


def train(plan: Plan, roof_tflops: Optional[float]) -> dict:
  from moejax.topology import accounting
  from moejax.train import optim, step as step_lib
  hit = mfu_lib.table_peak(jax.devices()[0].device_kind)
  peak = None if hit is None else hit[1]
  out = {}
  base_flops = None
  for name, large in (("default", False), ("large", True)):
    def one(large=large):
      cfg = train_config(plan, large)
      b, s = cfg.data.batch_size, cfg.data.seq_len
      if large and plan.dry_run:  # same code path as default: config and FLOPs only
        budget = accounting.budget(cfg.model, seq_len=s)
        return {"trained": False, "params": budget.total,
                "fwd_flops_per_token": budget.flops_per_token}
      tx = optim.make_optimizer(cfg.train)
      graphdef, state = step_lib.init_state(cfg, tx)
      train_step = step_lib.make_train_step(graphdef, cfg, tx)
      rng = np.random.default_rng(0)
      batches = [{"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
                  "mask": jnp.ones((b, s), bool)}
                 for tok in (rng.integers(0, cfg.model.vocab_size, (b, s + 1), np.int32)
                             for _ in range(2))]
      t0 = time.perf_counter()
      for i in range(2):  # compile + one more warm step
        state, metrics = train_step(state, batches[i % 2])
      jax.block_until_ready(metrics)
      compile_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      for i in range(plan.train_steps):
        state, metrics = train_step(state, batches[i % 2])
      jax.block_until_ready(metrics)
      dt = (time.perf_counter() - t0) / plan.train_steps
      budget = accounting.budget(cfg.model, seq_len=s)
      tok_s = b * s / dt
      model_flops = mfu_lib.step_flops(cfg) / dt  # 3 x forward FLOPs/token x B x S per step
      return {"batch": b, "seq_len": s, "d_model": cfg.model.d_model,
              "n_layers": cfg.model.n_layers, "params": budget.total,
              "backend": plan.train_backend, "compute_dtype": cfg.model.compute_dtype,
              "steps": plan.train_steps, "compile_and_warmup_s": round(compile_s, 2),
              "step_s": dt, "tokens_per_s": tok_s,
              "fwd_flops_per_token": budget.flops_per_token,
              "model_tflops_per_s": model_flops / 1e12,
              "mfu_vs_peak_bf16": None if peak is None else model_flops / peak,
              "peak_bf16_tflops": None if peak is None else peak / 1e12,
              "mfu_vs_measured_matmul": (None if not roof_tflops
                                         else model_flops / 1e12 / roof_tflops),
              "final_loss": float(metrics["loss"]), "trained": True}
    out[name] = guarded(one)
    if "fwd_flops_per_token" in out[name]:
      base_flops = base_flops or out[name]["fwd_flops_per_token"]
      out[name]["flops_per_token_vs_default"] = out[name]["fwd_flops_per_token"] / base_flops
  return out
