"""MoE layer latency: P50 / P99 of one layer's forward over many batches.

Legend: B batch, S sequence length, T = B*S tokens, d model width.

The layer (:func:`moejax.layer.moe_layer`, ``train=False``) is jitted once
per batch size and called on ``num_inputs`` different random inputs in turn,
so data-dependent routers (top-p, zero-computation experts, expert choice,
capacity) see varying routing; each call is timed to
``block_until_ready``. The first ``warmup`` calls (compilation, caches) are
not counted. Timings are wall clock on whatever device JAX uses: on a shared
machine they are noisy, which is what the P99 is for.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax import layer as layer_lib
from moejax.config import MoEConfig


def layer_latency(cfg: MoEConfig, d_model: int, *, batch_sizes: Sequence[int] = (1, 8),
                  seq_len: int = 128, iters: int = 50, warmup: int = 2, num_inputs: int = 4,
                  seed: int = 0, dtype=jnp.float32) -> list[dict]:
  """One row per batch size: ``batch_size, tokens, p50_ms, p99_ms, mean_ms, iters``."""
  if iters < 1 or warmup < 0 or num_inputs < 1:
    raise ValueError(f"layer_latency: iters={iters} must be >= 1, warmup={warmup} >= 0, "
                     f"num_inputs={num_inputs} >= 1")
  key_params, key_x, key_ids = jax.random.split(jax.random.key(seed), 3)
  params = layer_lib.init_moe_params(key_params, d_model, cfg)
  state = layer_lib.init_router_state(cfg)

  @jax.jit
  def forward(params, state, x, ids):
    return layer_lib.moe_layer(params, x, state, cfg, token_ids=ids, train=False)[0]

  rows = []
  for b in batch_sizes:
    xs = [jax.random.normal(jax.random.fold_in(key_x, i), (b, seq_len, d_model), dtype)
          for i in range(num_inputs)]
    ids = [jax.random.randint(jax.random.fold_in(key_ids, i), (b, seq_len), 0, 256, jnp.int32)
           for i in range(num_inputs)]
    times = []
    for i in range(warmup + iters):
      x, tok = xs[i % num_inputs], ids[i % num_inputs]
      start = time.perf_counter()
      jax.block_until_ready(forward(params, state, x, tok))
      if i >= warmup:
        times.append(time.perf_counter() - start)
    ms = np.asarray(times) * 1e3
    rows.append({"batch_size": int(b), "tokens": int(b * seq_len),
                 "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                 "mean_ms": float(ms.mean()), "iters": int(iters)})
  return rows


def format_rows(name: str, rows: list[dict]) -> str:
  """A plain table of :func:`layer_latency` rows under a heading."""
  lines = [f"{name}", f"{'batch':>6} {'tokens':>7} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}"]
  lines += [f"{r['batch_size']:>6} {r['tokens']:>7} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} "
            f"{r['mean_ms']:>9.3f}" for r in rows]
  return "\n".join(lines)
