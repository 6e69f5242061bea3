r"""Serving benchmark (``--suite=serving``): prefill and decode latency / throughput vs batch size.

Usage:
  python -m experiments.bench --suite=serving --json_out=results/serving/serving_bench.json \
      --serving_plot=results/serving/serving_bench.png

Three models with the same attention, embeddings and depth, random weights
(timing does not depend on training; routing does, see below):

  * ``moe``: every FFN an MoE of ``--serving_experts`` SwiGLU experts of width
    ``--serving_expert_width``, top-``--serving_top_k`` softmax routing,
    ``--serving_backend`` (``blocked``: only the chosen experts run);
  * ``dense_active``: :func:`moejax.model.dense_equivalent`, the dense FFN of
    width K f, the same active parameters (and FLOPs) per token;
  * ``dense_total``: a dense FFN of width E f, the same total FFN parameters.

For each batch size B (``--serving_batches``) and model, round-robin over
the models so that load from other processes hits them alike:

  * prefill: one cached call on B random prompts of ``--serving_prompt``
    tokens (median of ``--serving_prefill_repeats`` timed calls after a
    compile call), reported as seconds and prompt tokens / s;
  * decode: ``--serving_steps`` single-token steps through the KV cache
    (capacity prompt + steps), each timed to ``block_until_ready``, after
    one untimed compile step: P50 / P99 step latency and B / P50 tokens / s;
  * ``experts_touched``: distinct experts the B tokens of a decode step
    used, averaged over steps and MoE layers (from the routing the step
    returns);
  * ``ffn_slot_s``: the FFN slot of layer 0 alone on B tokens (median of
    ``--serving_ffn_repeats``), for the MoE through each execution path --
    ``blocked``, ``ragged_dot``, ``reference`` (every expert on every token)
    and ``gather`` (each token's K experts' weights gathered, what a batch-1
    decode kernel reads; a bench-only function checked against ``blocked``)
    -- and for the two dense FFNs: where the decode step's time goes.

Decode steps run round-robin too (step t of every model, then step t + 1),
and the decode and prefill inputs are the same for every model.

Random routers route near-uniformly, so ``experts_touched`` is close to its
expectation for uniform routing, E (1 - (1 - K/E)^B); a trained router's
skew lowers it a little at small B.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from flax import nnx

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry
from moejax.config import (ExecutionConfig, ModelConfig, MoEConfig, RoutingConfig,
                           TopologyConfig)
from moejax.model import Transformer, dense_equivalent, param_count
from moejax.serve import Decoder
from moejax.serve.generate import prefill_inputs
from moejax.topology import experts as experts_lib

_BATCHES = flags.DEFINE_list("serving_batches", ["1", "2", "4", "8", "16", "32", "64", "128",
                                                 "256"], "batch sizes")
_PROMPT = flags.DEFINE_integer("serving_prompt", 32, "prompt tokens per sequence")
_STEPS = flags.DEFINE_integer("serving_steps", 32, "timed decode steps per batch size")
_PREFILL_REPEATS = flags.DEFINE_integer("serving_prefill_repeats", 3, "timed prefill calls")
_FFN_REPEATS = flags.DEFINE_integer("serving_ffn_repeats", 20, "timed calls of the FFN slot")
_D = flags.DEFINE_integer("serving_d_model", 256, "model width")
_LAYERS = flags.DEFINE_integer("serving_layers", 4, "layers")
_HEADS = flags.DEFINE_integer("serving_heads", 4, "attention heads")
_EXPERTS = flags.DEFINE_integer("serving_experts", 8, "routed experts E")
_TOP_K = flags.DEFINE_integer("serving_top_k", 2, "experts per token K")
_WIDTH = flags.DEFINE_integer("serving_expert_width", 512, "expert hidden width f")
_BACKEND = flags.DEFINE_string("serving_backend", "blocked", "MoE execution backend")
_MODELS = flags.DEFINE_list("serving_models", ["moe", "dense_active", "dense_total"],
                            "which models to time")
_PLOT = flags.DEFINE_string("serving_plot", None, "write the PNG plot here")
_SEED = flags.DEFINE_integer("serving_seed", 0, "PRNG seed of weights and prompts")


def model_configs() -> dict[str, ModelConfig]:
  """The MoE and its two dense twins (module docstring)."""
  e, k, f = _EXPERTS.value, _TOP_K.value, _WIDTH.value
  moe = ModelConfig(vocab_size=256, d_model=_D.value, n_layers=_LAYERS.value,
                    n_heads=_HEADS.value,
                    moe=MoEConfig(
                        topology=TopologyConfig(num_experts=e, expert_width=f,
                                                activation="swiglu"),
                        execution=ExecutionConfig(backend=_BACKEND.value),
                        routing=RoutingConfig(kind="topk", top_k=k, gating="topk_softmax")))
  active = dense_equivalent(moe)
  total = dataclasses.replace(active, dense_ff_width=e * f)
  return {"moe": moe, "dense_active": active, "dense_total": total}


def _decode_step(dec, caches, lengths, p, t, rng):
  b = lengths.shape[0]
  tok = rng.integers(0, 256, (b, 1), dtype=np.int32)
  t0 = time.perf_counter()
  logits, caches, info = dec.extend(tok, (lengths + t)[:, None], np.ones((b, 1), bool), caches,
                                    p + t, last_only=True)
  jax.block_until_ready(logits)
  return time.perf_counter() - t0, caches, np.asarray(info["experts_touched"])


def _compile(dec, tokens, positions, write, lengths, p, capacity) -> None:
  """Compiles a decoder's prefill and decode shapes (untimed)."""
  b = tokens.shape[0]
  caches = dec.init_caches(b, capacity)
  lg, caches, _ = dec.extend(tokens, positions, write, caches, 0, last_only=True)
  lg, caches, _ = dec.extend(tokens[:, :1], lengths[:, None], np.ones((b, 1), bool), caches,
                             p, last_only=True)
  jax.block_until_ready(lg)


def _model_rows(cfgs, decoders, b, p, steps, capacity, seed) -> dict:
  """Prefill and decode timings of every model at batch b, round-robin over the models; a
  model whose first calls raise is a row ``{"error": ...}`` and the others still run."""
  rng = np.random.default_rng(seed + b)
  tokens = rng.integers(0, 256, (b, p), dtype=np.int32)
  lengths = np.full((b,), p, np.int32)
  positions, write = prefill_inputs(lengths, p)
  errors = {}
  for name, dec in decoders.items():
    try:
      _compile(dec, tokens, positions, write, lengths, p, capacity)
    except Exception as e:  # noqa: BLE001 - its row says so, the others still run
      errors[name] = bench_lib.variant_failed(f"batch {b}/{name}", e)
  live = {n: d for n, d in decoders.items() if n not in errors}
  pre = {n: [] for n in live}
  caches = {}
  for _ in range(_PREFILL_REPEATS.value):
    for name, dec in live.items():
      c = dec.init_caches(b, capacity)
      t0 = time.perf_counter()
      lg, caches[name], _ = dec.extend(tokens, positions, write, c, 0, last_only=True)
      jax.block_until_ready(lg)
      pre[name].append(time.perf_counter() - t0)
  dts = {n: [] for n in live}
  touched = {n: [] for n in live}
  for t in range(steps):
    for name, dec in live.items():
      dt, caches[name], hit = _decode_step(dec, caches[name], lengths, p, t, rng)
      dts[name].append(dt)
      touched[name].append(hit)
  rows = {}
  for name in decoders:
    if name in errors:
      rows[name] = {"error": errors[name]}
      continue
    dt, pr = np.asarray(dts[name]), float(np.median(pre[name]))
    row = {"prefill_s": pr, "prefill_all_s": [round(x, 5) for x in pre[name]],
           "prefill_tokens_per_s": b * p / pr,
           "decode_p50_s": float(np.percentile(dt, 50)),
           "decode_p99_s": float(np.percentile(dt, 99)),
           "decode_tokens_per_s": b / float(np.percentile(dt, 50)),
           "decode_all_s": [round(x, 5) for x in dt.tolist()]}
    moe = cfgs[name].moe
    if moe is not None:
      hits = np.stack(touched[name]).astype(np.float64)  # [steps, L_moe]
      e, k = moe.num_experts, moe.routing.top_k
      row.update(experts_touched_mean=float(hits.mean()),
                 experts_touched_min_max=[int(hits.min()), int(hits.max())],
                 experts_touched_uniform=e * (1 - (1 - k / e) ** b))
    rows[name] = row
  return rows


# --- The FFN slot alone at decode token counts. ------------------------------

def _gather_moe(params, x, top_k):
  """Top-k softmax MoE that reads only the chosen experts' weights (per-token gather).

  y[t] = sum_k w[t, k] FFN_{id[t, k]}(x[t]) with the K weight matrices of
  each token gathered ([T, K, d, f]): the memory traffic of a batch-1
  decode kernel (K experts read), O(T K) weight copies as T grows.
  """
  vals, ids = jax.lax.top_k(x @ params["router"]["w"], top_k)
  w = jax.nn.softmax(vals, axis=-1)
  e = params["experts"]
  gate, up = experts_lib.split_gate_up(jnp.einsum("td,tkdf->tkf", x, e["w_gate_up"][ids]))
  h = jax.nn.silu(gate) * up
  return jnp.einsum("tk,tkd->td", w, jnp.einsum("tkf,tkfd->tkd", h, e["w_down"][ids]))


def _dense_fn(ffn):
  p = {"g": ffn.w_gate.kernel[...], "u": ffn.w_up.kernel[...], "d": ffn.w_down.kernel[...]}
  return jax.jit(lambda x: (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["d"])


def ffn_rows(models: dict, b: int, seed: int, repeats: int) -> dict:
  """Median seconds of one FFN slot (layer 0) on B tokens: MoE paths and the dense twins."""
  from moejax import layer as layer_lib
  from moejax.nn.moe_block import values

  fns = {}
  moe_model = models.get("moe")
  if moe_model is not None:
    ffn = moe_model.blocks[0].ffn
    params, cfg = values(ffn.params), ffn.cfg
    for backend in ("blocked", "ragged_dot", "reference"):
      c = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, backend=backend))
      fns[f"moe_{backend}"] = jax.jit(
          lambda x, c=c: layer_lib.moe_layer(params, x, None, c)[0])
    fns["moe_gather"] = jax.jit(lambda x: _gather_moe(params, x, cfg.routing.top_k))
  for name in ("dense_active", "dense_total"):
    if name in models:
      fns[name] = _dense_fn(models[name].blocks[0].ffn)
  x = jax.random.normal(jax.random.key(seed + b), (b, next(iter(models.values())).cfg.d_model))
  outs, errors = {}, {}
  for n, f in fns.items():  # compile + correctness (untimed)
    try:
      outs[n] = np.asarray(f(x))
    except Exception as e:  # noqa: BLE001 - its entry says so, the others still run
      errors[n] = bench_lib.variant_failed(f"batch {b}/ffn {n}", e)
  for n in ("moe_ragged_dot", "moe_reference", "moe_gather"):
    if n in outs and "moe_blocked" in outs:
      err = np.max(np.abs(outs[n] - outs["moe_blocked"])) / max(
          np.max(np.abs(outs["moe_blocked"])), 1e-30)
      if err > 1e-4:  # a wrong result's time means nothing: a failure, not a row of times
        errors[n] = bench_lib.variant_failed(f"batch {b}/ffn {n}", AssertionError(
            f"{n} differs from moe_blocked by {err:.2e} (relative)"))
  live = {n: f for n, f in fns.items() if n not in errors}
  times = {n: [] for n in live}
  for _ in range(repeats):
    for n, f in live.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      times[n].append(time.perf_counter() - t0)
  return {n: float(np.median(times[n])) if n in times else {"error": errors[n]} for n in fns}


def serving_suite(conditions: dict) -> dict:
  """Runs the suite; ``conditions``: the run's platform / load dict (experiments.bench)."""
  cfgs = {n: c for n, c in model_configs().items() if n in _MODELS.value}
  batches = [int(b) for b in _BATCHES.value]
  p, steps = _PROMPT.value, _STEPS.value
  capacity = p + steps + 1
  models, decoders, info = {}, {}, {}
  for name, cfg in cfgs.items():
    try:
      models[name] = Transformer(cfg, rngs=nnx.Rngs(_SEED.value))
      decoders[name] = Decoder(models[name])
    except Exception as e:  # the flags describe no model: nothing to time it against
      raise bench_lib.BenchFailed(f"--suite=serving: the {name} model cannot be built: "
                                  f"{bench_lib.error_text(e)}") from e
    info[name] = {"params": param_count(models[name]),
                  "ffn_width": None if cfg.moe else cfg.dense_ff_width}
  rows = {name: {} for name in cfgs}
  ffn = {}
  for b in batches:
    bench_lib.progress(f"timing prefill and decode at batch {b}: {', '.join(decoders)}")
    for name, row in _model_rows(cfgs, decoders, b, p, steps, capacity, _SEED.value).items():
      rows[name][b] = row
    ffn[b] = ffn_rows(models, b, _SEED.value, _FFN_REPEATS.value)
    logging.info("B=%d: %s", b, {n: round(r[b].get("decode_p50_s", np.nan), 5)
                                 for n, r in rows.items()})
  for b in batches:
    base = rows.get("dense_active", {}).get(b)
    for name in rows:
      if base is not None and "error" not in base and "error" not in rows[name][b]:
        rows[name][b]["decode_p50_x_dense_active"] = (rows[name][b]["decode_p50_s"]
                                                      / base["decode_p50_s"])
        rows[name][b]["prefill_x_dense_active"] = rows[name][b]["prefill_s"] / base["prefill_s"]
  out = {"conditions": conditions, "prompt": p, "steps": steps, "cache_slots": capacity,
         "models": {n: {"config": dataclasses.asdict(c), **info[n]} for n, c in cfgs.items()},
         "batches": batches, "results": rows, "ffn_slot_s": ffn}
  out["conditions_after"] = {"load_avg_1_5_15": list(os.getloadavg())}
  if _PLOT.value:
    plot(out, _PLOT.value)
    out["plot"] = _PLOT.value
  return out


def print_serving_table(res: dict) -> None:
  models = list(res["results"])
  m = res["models"]
  for name in models:
    moe = m[name]["config"]["moe"]
    ff = (f"E={moe['topology']['num_experts']} K={moe['routing']['top_k']} "
          f"f={moe['topology']['expert_width']}" if moe else f"F={m[name]['ffn_width']}")
    print(f"{name}: {m[name]['params'] / 1e6:.2f}M params, {ff}")
  print(f"\nprompt {res['prompt']} tokens, {res['steps']} decode steps, "
        f"{res['cache_slots']} cache slots")
  head = (f"{'B':>4} {'model':<13}{'prefill s':>10}{'prefill tok/s':>14}{'x act':>7}"
          f"{'decode p50 ms':>14}{'p99 ms':>9}{'decode tok/s':>13}{'x act':>7}{'experts':>9}")
  print(head)
  for b in res["batches"]:
    for name in models:
      r = res["results"][name][b]
      if "error" in r:
        print(f"{b:>4} {name:<13}failed: {r['error']}")
        continue
      touched = f"{r['experts_touched_mean']:.2f}" if "experts_touched_mean" in r else "-"
      print(f"{b:>4} {name:<13}{r['prefill_s']:>10.4f}{r['prefill_tokens_per_s']:>14.0f}"
            f"{r.get('prefill_x_dense_active', float('nan')):>7.2f}"
            f"{1e3 * r['decode_p50_s']:>14.2f}{1e3 * r['decode_p99_s']:>9.2f}"
            f"{r['decode_tokens_per_s']:>13.0f}"
            f"{r.get('decode_p50_x_dense_active', float('nan')):>7.2f}"
            f"{touched:>9}")
  names = list(next(iter(res["ffn_slot_s"].values())))
  print("\nFFN slot alone (layer 0, B tokens), median ms: " + ", ".join(names))
  print(f"{'B':>4}" + "".join(f"{n:>16}" for n in names))
  for b, row in res["ffn_slot_s"].items():
    print(f"{b:>4}" + "".join(f"{_ms(row[n], '.3f'):>16}" for n in names))
  print("\n" + markdown_tables(res))


def _ms(seconds, spec: str) -> str:
  """A median in ms, or ``failed`` for a path that raised (its error: the FAILED line, the
  JSON and the binary's error line)."""
  return "failed" if isinstance(seconds, dict) else format(1e3 * seconds, spec)


def plot(res: dict, path: str) -> None:
  """Four panels: decode tokens/s, decode P50 latency, prefill tokens/s, experts touched."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(15, 8))
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 3)
  batches = res["batches"]
  nan = lambda r, key, scale=1.0: scale * r[key] if key in r else np.nan  # failed: a gap
  for name, rows in res["results"].items():
    ys = [rows[b] for b in batches]
    axes[0, 0].plot(batches, [nan(r, "decode_tokens_per_s") for r in ys], "o-", label=name)
    axes[0, 1].plot(batches, [nan(r, "decode_p50_s", 1e3) for r in ys], "o-",
                    label=f"{name} P50")
    axes[0, 1].plot(batches, [nan(r, "decode_p99_s", 1e3) for r in ys], ":", color=
                    axes[0, 1].lines[-1].get_color(), label=f"{name} P99")
    axes[1, 0].plot(batches, [nan(r, "prefill_tokens_per_s") for r in ys], "o-", label=name)
    if any("experts_touched_mean" in r for r in ys):
      axes[1, 1].plot(batches, [nan(r, "experts_touched_mean") for r in ys], "o-",
                      label=f"{name}: measured")
      axes[1, 1].plot(batches, [nan(r, "experts_touched_uniform") for r in ys], "--",
                      label="uniform routing E(1-(1-K/E)^B)")
    axes[0, 2].plot(batches, [r.get("decode_p50_x_dense_active", np.nan) for r in ys], "o-",
                    label=name)
  ffn = res["ffn_slot_s"]
  for name in next(iter(ffn.values())):
    axes[1, 2].plot(batches, [np.nan if isinstance(ffn[b][name], dict) else 1e3 * ffn[b][name]
                              for b in batches], "o-", label=name)
  titles = [("decode throughput", "tokens / s"), ("decode step latency", "ms per step"),
            ("decode step P50 / dense_active's", "ratio"),
            ("prefill throughput", f"prompt tokens / s ({res['prompt']} per sequence)"),
            ("distinct experts per decode step", "experts (mean over layers, steps)"),
            ("one FFN slot on B tokens (layer 0)", "ms (median)")]
  for ax, (title, ylabel) in zip(axes.flat, titles):
    ax.set_xscale("log", base=2)
    if title not in (titles[2][0], titles[4][0]):
      ax.set_yscale("log")
    ax.set_xlabel("batch size B (sequences)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  c = res["conditions"]
  fig.suptitle(f"moejax serving bench on {c['platform']} ({c['cpu_count']} cores), "
               f"jax {c['jax']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=150)


def markdown_tables(res: dict) -> str:
  """The decode / prefill table and the FFN-slot table as Markdown (docs/serving.md)."""
  lines = ["| B | model | prefill tok/s | decode P50 ms | decode P99 ms | decode tok/s "
           "| P50 x dense_active | experts touched |", "|---|---|---|---|---|---|---|---|"]
  for b in res["batches"]:
    for name, rows in res["results"].items():
      r = rows[b] if b in rows else rows[str(b)]  # str keys after a JSON round trip
      if "error" in r:
        lines.append(f"| {b} | {name} | failed: {r['error']} |" + " |" * 5)
        continue
      touched = (f"{r['experts_touched_mean']:.2f} (uniform {r['experts_touched_uniform']:.2f})"
                 if "experts_touched_mean" in r else "-")
      lines.append(f"| {b} | {name} | {r['prefill_tokens_per_s']:.0f} | "
                   f"{1e3 * r['decode_p50_s']:.2f} | {1e3 * r['decode_p99_s']:.2f} | "
                   f"{r['decode_tokens_per_s']:.0f} | "
                   f"{r.get('decode_p50_x_dense_active', float('nan')):.2f} | {touched} |")
  names = list(next(iter(res["ffn_slot_s"].values())))
  lines += ["", "One FFN slot (layer 0) on B tokens, median ms:", "",
            "| B | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for b, row in res["ffn_slot_s"].items():
    lines.append(f"| {b} | " + " | ".join(_ms(row[n], ".2f") for n in names) + " |")
  return "\n".join(lines)


SUITE = registry.register(registry.Suite(
    "serving", "decode and prefill latency and throughput of an MoE vs its dense twins",
    lambda: serving_suite(bench_lib.conditions()), print_serving_table,
    outputs=(("serving_plot", "file"),)))
