r"""MoE vs its dense twin, one trainer step each (``--suite=step --step_twin``).

Usage:
  python -m experiments.bench --suite=step --step_twin --json_out=/tmp/twin.json

Builds ``--step_twin_config`` (default configs/default.py) and its ``active``
dense twin (:func:`moejax.model.dense_twin`: every MoE FFN replaced by one
dense FFN of width K*f, the same active parameters and FLOPs per token;
attention, embeddings, data and optimiser identical), compiles both trainer
steps (moejax.train.step: forward, backward, AdamW, the bias controller,
metrics) and times them interleaved with a square f32 matmul of
``--step_matmul_n`` (``bench_lib.time_round_robin``: round-robin repeats,
medians, the compiling first run excluded; both steps see the same batches).

Reported per arm: tokens/s (batch x seq_len over the median step), its CPU
time twin, the spread of the per-round MoE / dense ratios, and the achieved
FLOP rate (3 x the forward FLOPs per token of
``moejax.topology.accounting.budget``, times the step's tokens, over the
step) next to the matmul's rate (2 n^3 / its median): the gap between a
step and the matmul roof is what neither arm spends in matmuls.

``--step_twin_backends=whole_group`` (a list) adds the same MoE config with
another execution backend as one more arm of the same rounds, with its own
ratio to the dense twin: a backend compared at the step, side by side.

With ``--step_twin_profile=N`` both arms then run N more steps each under
``jax.profiler.trace``, and the traced wall time is split by kind of XLA:CPU
instruction exactly as the profile suite does (``bench_profile.summarize``:
matmul, copies, fills, ..., ``pool work only``, ``no instruction``), per
step, with each kind's excess over the dense twin's step: where the MoE
step's distance from its twin goes.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
from absl import flags

from experiments import cli
from experiments.benchmarks import lib as bench_lib

_TWIN = flags.DEFINE_bool("step_twin", False, "--suite=step: time the MoE config's trainer "
                          "step against its dense twin's instead of profiling one arm")
_TWIN_CONFIG = flags.DEFINE_string("step_twin_config", "configs/default.py",
                                   "config file of the MoE arm of --step_twin")
_TWIN_REPEATS = flags.DEFINE_integer("step_twin_repeats", 20, "timed steps per arm (median)")
_BACKENDS = flags.DEFINE_list("step_twin_backends", [], "more MoE arms: the same config with "
                              "model.moe.execution.backend set to each of these, timed in the "
                              "same interleaved rounds (e.g. whole_group)")
_MATMUL_N = flags.DEFINE_integer("step_matmul_n", 1024, "n of the [n, n] x [n, n] f32 matmul")
_PROFILE = flags.DEFINE_integer("step_twin_profile", 0, "after timing, trace this many steps of "
                                "each arm and split their wall time by kind of XLA:CPU "
                                "instruction (0: no trace)", lower_bound=0)

ARMS = ("moe", "dense")


def enabled() -> bool:
  return _TWIN.value


def twin_configs(exp) -> dict:
  """{'moe': exp, 'dense': exp with its model replaced by the 'active' dense twin}."""
  from moejax.model import dense_twin  # pylint: disable=g-import-not-at-top
  if exp.model.moe is None:
    raise ValueError("error: --step_twin_config: model.moe is None (a dense model); "
                     "pass an MoE config such as configs/default.py")
  return {"moe": exp, "dense": dataclasses.replace(exp, model=dense_twin(exp.model, "active"))}


def _step_fn(exp, batches) -> tuple[Callable[[], object], float]:
  """(a thunk running one compiled trainer step on the next batch, compile seconds)."""
  # pylint: disable=g-import-not-at-top
  import time
  from moejax.train import step as step_lib
  from moejax.train.optim import make_optimizer
  tx = make_optimizer(exp.train, exp.model)
  graphdef, state = step_lib.init_state(exp, tx)
  t0 = time.perf_counter()
  compiled = step_lib.make_train_step(graphdef, exp, tx).lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - t0
  holder = {"state": state, "i": 0}

  def run():
    holder["i"] += 1
    holder["state"], metrics = compiled(holder["state"], batches[holder["i"] % len(batches)])
    return metrics

  return run, compile_s


def matmul_fn(n: int) -> Callable[[], object]:
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  return lambda: mm(a, b)


def profile_arms(fns: dict, steps: int) -> dict:
  """{arm: the wall split of ``steps`` traced steps, per step} with each kind's
  excess over the dense arm's step (``bench_profile.summarize``'s fields)."""
  from experiments.benchmarks import profile as bench_profile  # pylint: disable=g-import-not-at-top
  cores = len(os.sched_getaffinity(0))

  def many(fn):
    def run():
      out = None
      for _ in range(steps):  # each step reads the last one's state: blocking the last waits for all
        out = fn()
      return out
    return run

  out = {}
  with tempfile.TemporaryDirectory(prefix="moejax_twin_profile_") as root:
    for name in ARMS:
      wall, events = bench_profile.trace_once(many(fns[name]), os.path.join(root, name))
      r = bench_profile.summarize(events, wall, cores)
      out[name] = {"steps": steps, "traced_s": wall / steps, "utilization": r["utilization"],
                   "wall_ms": {k: v / steps for k, v in r["wall_ms"].items()},
                   "counts": {k: v / steps for k, v in r["counts"].items()},
                   "top": r["top"]}
  for r in out.values():
    r["excess_x_dense"] = bench_profile.excess_x_dense(r, out["dense"])
  return out


def twin_suite(exp, repeats: int, matmul_n: int, conditions: dict,
               label: str = "config", profile_steps: int = 0,
               alternatives: dict | None = None) -> dict:
  """Both arms' trainer steps and the matmul, interleaved (see the module doc).

  ``alternatives`` ({backend: the MoE config with that execution backend})
  adds one MoE arm ``moe:<backend>`` each to the same rounds; their ratios to
  the dense twin are in ``alternatives_over_dense``.
  """
  # pylint: disable=g-import-not-at-top
  from moejax import data as data_lib
  from moejax.topology.accounting import budget
  load_before = os.getloadavg()[0]
  arms = twin_configs(exp)
  arms.update({f"moe:{b}": alt for b, alt in (alternatives or {}).items()})
  b, s = exp.data.batch_size, exp.data.seq_len
  train_it = data_lib.make_batches(exp.data, exp.data.train_split)
  batches = [{k: jnp.asarray(v) for k, v in next(train_it).items()} for _ in range(4)]
  fns, compile_s = {}, {}
  for name, cfg in arms.items():
    fns[name], compile_s[name] = _step_fn(cfg, batches)
  fns["matmul"] = matmul_fn(matmul_n)
  timed = bench_lib.time_round_robin(fns, repeats)
  failed = {n: t["error"] for n, t in timed.items() if "error" in t}
  if failed:
    raise bench_lib.BenchFailed(f"step twin: failed: {failed}")
  tokens = b * s
  out = {}
  for name, cfg in arms.items():
    t = timed[name]
    flops = 3.0 * budget(cfg.model, s).flops_per_token * tokens
    out[name] = {"median_s": t["median_s"], "cpu_s": t["cpu_s"], "all_s": t["all_s"],
                 "spread_s": bench_lib.spread(t["all_s"]), "compile_s": compile_s[name],
                 "tokens_per_s": tokens / t["median_s"], "cpu_tokens_per_s": tokens / t["cpu_s"],
                 "train_flops": flops, "flops_per_s": flops / t["median_s"],
                 "ffn": (f"dense, width {cfg.model.dense_ff_width}" if cfg.model.moe is None
                         else f"MoE, E={cfg.model.moe.num_experts} K="
                              f"{cfg.model.moe.routing.top_k} f={cfg.model.moe.topology.expert_width}")}
  mm = timed["matmul"]
  mm_rate = 2.0 * matmul_n ** 3 / mm["median_s"]
  for r in out.values():
    r["fraction_of_matmul"] = r["flops_per_s"] / mm_rate
  def over_dense(name):
    rounds = zip(timed[name]["all_s"], timed["dense"]["all_s"])
    return {"tokens_per_s": out[name]["tokens_per_s"] / out["dense"]["tokens_per_s"],
            "cpu_tokens_per_s": out[name]["cpu_tokens_per_s"] / out["dense"]["cpu_tokens_per_s"],
            "spread": bench_lib.spread([d / m for m, d in rounds])}

  ratio = over_dense("moe")
  alt_ratios = {n: over_dense(n) for n in out if n not in ARMS}
  profile = profile_arms(fns, profile_steps) if profile_steps else None
  return {"conditions": conditions, "config": label,
          "batch": b, "seq_len": s, "tokens_per_step": tokens, "repeats": repeats,
          "arms": out, "moe_over_dense": ratio, "alternatives_over_dense": alt_ratios,
          "profile": profile,
          "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
          "matmul": {"n": matmul_n, "median_s": mm["median_s"], "flops_per_s": mm_rate}}


def run_from_flags(conditions: dict) -> dict:
  from moejax.config import files  # pylint: disable=g-import-not-at-top
  from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
  loaded = files.load_config_file(_TWIN_CONFIG.value)
  exp = experiment_from_dict(copy.deepcopy(loaded))
  alternatives = {}
  for backend in _BACKENDS.value:
    cfg = copy.deepcopy(loaded)
    try:
      cfg.model.moe.execution.backend = backend  # a fresh dict per arm, then built
      alternatives[backend] = experiment_from_dict(cfg)
    except (ValueError, AttributeError, TypeError) as e:
      cli.fail(f"--step_twin_backends: {backend!r} does not build with "
               f"{_TWIN_CONFIG.value}: {e}")
  return twin_suite(exp, _TWIN_REPEATS.value, _MATMUL_N.value, conditions,
                    label=_TWIN_CONFIG.value, profile_steps=_PROFILE.value,
                    alternatives=alternatives)


def ratio_interval(moe_s, dense_s, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
  """95% percentile bootstrap interval of median(dense_s) / median(moe_s): the tokens/s
  ratio, each arm's steps resampled on their own (scipy's bootstrap, as the results'
  document intervals; fixed seed, so a record renders the same each time)."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import scipy.stats
  res = scipy.stats.bootstrap(
      (np.asarray(dense_s), np.asarray(moe_s)),
      lambda d, m, axis=-1: np.median(d, axis) / np.median(m, axis), paired=False,
      vectorized=True, n_resamples=draws, confidence_level=0.95, method="percentile",
      rng=np.random.default_rng(seed))
  return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _interval_note(res: dict, name: str) -> str:
  arms = res["arms"]
  if "all_s" not in arms[name] or "all_s" not in arms["dense"]:
    return ""
  lo, hi = ratio_interval(arms[name]["all_s"], arms["dense"]["all_s"])
  return f"; bootstrap 95% [{lo:.3f}-{hi:.3f}]"


def twin_markdown(res: dict) -> str:
  """The step suite's record as printed: conditions, the arms' table, the ratio line and,
  when traced, the profile (docs/benchmarks.md renders the same from results/bench/)."""
  mm = res["matmul"]
  lines = [f"{res['config']} and its active dense twin: batch {res['batch']} x "
           f"{res['seq_len']} = {res['tokens_per_step']} tokens per step, medians of "
           f"{res['repeats']} interleaved steps; f32 matmul {mm['n']}^3: "
           f"{mm['flops_per_s'] / 1e9:.1f} GFLOP/s; 1-min load {res['load_1min_before']:.1f} -> "
           f"{res['load_1min_after']:.1f}", "",
           "| arm | step ms [min-max] | tokens/s | CPU tokens/s | GFLOP/s | x matmul | compile s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, r in res["arms"].items():
    sp = r["spread_s"]
    lines.append(f"| {name} | {1e3 * r['median_s']:.1f} [{1e3 * sp['min']:.1f}-"
                 f"{1e3 * sp['max']:.1f}] | {r['tokens_per_s']:.0f} | "
                 f"{r['cpu_tokens_per_s']:.0f} | {r['flops_per_s'] / 1e9:.2f} | "
                 f"{r['fraction_of_matmul']:.2f} | {r['compile_s']:.1f} |")
  def ratio_line(name, label, q):
    return (f"{label} / dense tokens/s: {q['tokens_per_s']:.3f}{_interval_note(res, name)} "
            f"(per-round [{q['spread']['min']:.3f}-{q['spread']['max']:.3f}]; CPU time "
            f"{q['cpu_tokens_per_s']:.3f})")

  lines += ["", ratio_line("moe", "MoE", res["moe_over_dense"]) + "; target >= 0.98"]
  lines += [ratio_line(n, n, q) for n, q in res.get("alternatives_over_dense", {}).items()]
  if res.get("profile"):
    lines.append(profile_markdown(res["profile"]))
  return "\n".join(lines)


def print_twin_table(res: dict) -> None:
  print("\n" + twin_markdown(res))


def profile_markdown(profile: dict) -> str:
  """The traced steps' wall split, 'moe ms / dense ms (+excess x dense)' per kind."""
  from experiments.benchmarks import profile as bench_profile  # pylint: disable=g-import-not-at-top
  m, d = profile["moe"], profile["dense"]
  lines = [f"\nwall ms per step over {m['steps']} traced steps, split by kind of XLA:CPU "
           "instruction (the profile suite):", "",
           "| kind | moe ms / dense ms (+excess x dense) |", "|---|---:|"]
  for k in bench_profile.ROWS:
    lines.append(f"| {k} | {bench_profile.wall_cell(m, d, k, '.1f')} |")
  lines.append(f"| traced step | {m['traced_s'] * 1e3:.1f} / {d['traced_s'] * 1e3:.1f} "
               f"({m['traced_s'] / d['traced_s'] - 1:+.3f}) |")
  lines.append(f"| utilization (busy / cores x wall) | {m['utilization']:.2f} / "
               f"{d['utilization']:.2f} |")
  return "\n".join(lines)
