r"""One command that checks and times moejax on an accelerator.

Usage:
  python -m experiments.device_check --json_out=/tmp/device_check.json   # GPU or TPU
  python -m experiments.device_check --dry_run --json_out=/tmp/dry.json  # CPU

Legend: m / k / n / G the grouped matmul's rows, contraction, output width
and groups; T tokens, d model width, E experts, K slots per token, f expert
width; R = T K gathered rows.

Steps, in order (``--steps`` picks a subset). Each one is recorded in the
JSON, written again after every step: a failing step gets its error and a
traceback summary and the run goes on; a step that would start after
``--budget_s`` is recorded as skipped, so a run always finishes in time.

  environment      devices, versions, the bf16 peak FLOP/s of the device kind.
  lowering         the Pallas kernels (gmm, gmm with rhs^T, tgmm, row gathers,
                   the folded gather_gmm / scatter_gmm / gather_tgmm)
                   lowered for both accelerator platforms (``cuda``, ``tpu``):
                   catches what the interpreters accept but the compilers reject.
  gmm_correctness  this platform's kernels (GPU: ``pallas_gpu``; TPU:
                   ``pallas_tpu`` and JAX's megablox; the peer ``tokamax``
                   where it installs) against ``ragged_dot`` in bf16: output
                   and both gradients on ragged sizes with empty groups and
                   rows past the groups, one group, empty groups, all empty;
                   rows past the groups and empty groups' gradients exactly 0.
  gmm_timing       dense bf16 matmul (the roof), ragged_dot, the kernels (GPU:
                   a small tiling sweep of pallas_gpu, JAX's
                   ``ragged_dot_mgpu``), tokamax; forward TFLOP/s and
                   forward+backward; the issue-13 target (pallas_gpu >= 70% of
                   the dense TFLOP/s at m=65536 k=2048 n=1408 G=64, faster than
                   ragged_dot).
  gather           the token gather (R rows from [T, d]): XLA's take vs the
                   Pallas kernels; exactness and GB/s.
  layer            the routed-expert layer fwd+bwd vs a dense SwiGLU FFN of the
                   same active FLOPs in bf16, with the platform's kernel
                   (its folded gather/scatter gmm, and ``+permute``: the
                   composed permute -> 3 gmm -> unpermute), ragged_dot, the
                   portable fused ``blocked`` path and the whole-group matmuls,
                   at the fine and coarse shapes.
  train            configs/default.py and a ~10x larger model (bf16 activations,
                   the platform's kernel) for a fixed number of steps on
                   synthetic tokens: tokens/s, model FLOPs
                   (``moejax.topology.accounting``, training = 3 x forward) and
                   model FLOP utilisation vs the device's bf16 peak and vs the
                   measured dense matmul roof.

``--dry_run`` (any platform, meant for CPU) runs every step at tiny shapes with
the Pallas kernels of *both* platforms in interpret mode, so that this script
works the day a device appears; ``tests/test_device_check.py`` runs it.

This binary holds the flags, the plan of sizes and the step runner; the
steps themselves are in ``experiments/device_checks/`` (gmm, kernels,
training), apart from the layer step, which reads the ``--layer_*`` flags.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional

import jax
from absl import app, flags

from experiments import cli, common_flags
from experiments.benchmarks import lib as bench_lib
# The steps, one module per kind of check; failure / guarded / Plan importable from here.
from experiments.device_checks.common import BF16, Plan, failure, guarded  # noqa: F401
from experiments.device_checks.gmm import gmm_correctness, gmm_timing
from experiments.device_checks.kernels import gather, lowering
from experiments.device_checks.training import train

_JSON = common_flags.json_out()  # written again after every step
_DRY = flags.DEFINE_bool("dry_run", False, "tiny shapes, Pallas kernels interpreted (CPU)")
_STEPS = flags.DEFINE_list("steps", None, "subset of steps to run (default: all)")
_BUDGET = flags.DEFINE_float("budget_s", 450.0, "no step starts after this many seconds")
_REPEATS = common_flags.repeats()  # default 10; dry run 1
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", None, "timed train steps (default 20)")
_LAYER_SHAPES = flags.DEFINE_list("layer_shapes", None, "layer step: subset of its shapes "
                                  "(default: all)")
_LAYER_VARIANTS = flags.DEFINE_list("layer_variants", None, "layer step: subset of its "
                                    "variants, dense always kept (default: all)")

# Boolean results that make a step's status 'check_failed' when False.
CHECK_KEYS = ("all_lowered", "all_kernels_passed", "all_exact")
STEPS = ("environment", "lowering", "gmm_correctness", "gmm_timing", "gather", "layer", "train")


def make_plan(platform: str, dry_run: bool) -> Plan:
  if dry_run:
    interp = {"interpret": True}
    return Plan(
        platform=platform, dry_run=True, kernels=("pallas_gpu", "pallas_tpu"),
        options={"pallas_gpu": dict(interp, tiling=(64, 64, 64)),
                 "pallas_tpu": dict(interp, tiling=(32, 64, 64))},
        peers=("megablox", "tokamax"), gathers=("pallas_gpu", "pallas_tpu"),
        repeats=_REPEATS.value or 1, inner=1, check_m=128, check_kn=(64, 64),
        gmm_shape=(128, 64, 64, 4), sweep=(), gather_shape=(32, 2, 128),
        layer_td=(32, 64), layer_shapes={"tiny": dict(num_experts=4, k=2, f=64)},
        train_steps=_TRAIN_STEPS.value or 2,
        train_small=dict(d_model=32, n_layers=1, n_heads=2, num_experts=4, expert_width=32,
                         seq_len=16, batch_size=2),
        train_backend="blocked")
  gpu = platform == "gpu"
  kernel = "pallas_gpu" if gpu else "pallas_tpu"
  return Plan(
      platform=platform, dry_run=False, kernels=(kernel,), options={kernel: {}},
      peers=("tokamax", "jax_mgpu") if gpu else ("megablox", "tokamax"),
      gathers=(kernel,), repeats=_REPEATS.value or 10, inner=5, check_m=4096,
      check_kn=(512, 768), gmm_shape=(65536, 2048, 1408, 64),
      sweep=((128, 64, 256), (64, 64, 128), (128, 128, 128)) if gpu else (),
      gather_shape=(8192, 8, 2048), layer_td=(16384, 2048),
      layer_shapes=dict(bench_lib.SHAPES), train_steps=_TRAIN_STEPS.value or 20,
      train_small={}, train_backend=kernel)


# --- Running steps. ---------------------------------------------------------

def run_steps(steps: dict[str, Callable[[], dict]], budget_s: float,
              write: Optional[Callable[[dict], None]] = None,
              results: Optional[dict] = None) -> dict:
  """Runs every step in order; each result gets status, seconds and, on error, why.

  ``results`` (filled in place, also returned) lets later steps read earlier ones.
  """
  results = {} if results is None else results
  t_start = time.perf_counter()
  for name, fn in steps.items():
    if time.perf_counter() - t_start > budget_s:
      results[name] = {"status": "skipped", "why": f"time budget {budget_s:.0f}s spent"}
    else:
      t0 = time.perf_counter()
      print(f"[device_check] {name} ...", flush=True)
      try:
        res = fn()
        failed = [key for key in CHECK_KEYS if res.get(key) is False]
        res.setdefault("status", "check_failed" if failed else "ok")
        if failed:
          res["failed_checks"] = failed
      except Exception as e:  # noqa: BLE001 - one failing step never ends the run
        res = failure(e)
      res["seconds"] = round(time.perf_counter() - t0, 2)
      results[name] = res
      print(f"[device_check] {name}: {res['status']} ({res['seconds']}s)", flush=True)
    if write is not None:
      write(results)
  return results


# --- Layer. -----------------------------------------------------------------

def layer(plan: Plan) -> dict:
  t, d = plan.layer_td
  out = {}
  for shape, dims in plan.layer_shapes.items():
    if _LAYER_SHAPES.value and shape not in _LAYER_SHAPES.value:
      continue
    e, k, f = dims["num_experts"], dims["k"], dims["f"]
    prob = bench_lib.layer_problem(t, d, e, k, f, dtype=BF16)
    variants = {"dense": None}
    for b in plan.kernels:
      if plan.dry_run and b == "pallas_gpu":
        continue  # interpreted it costs a minute here; tests/execution covers it
      if not plan.dry_run:
        variants[b] = dict(backend=b, **plan.options[b])
        # The composed path without the folded kernels, to see what folding saves.
        variants[f"{b}+permute"] = dict(backend=b, fold_permute=False, **plan.options[b])
      variants[f"{b}+gather"] = dict(backend=b, gather_backend=b, **plan.options[b])
    if not plan.dry_run:
      variants["ragged_dot"] = dict(backend="ragged_dot")
      variants["blocked"] = dict(backend="blocked")
      # Whole-group matmuls (one batched matmul over capacity-bucketed experts): on a GPU the
      # alternative to a grouped-matmul kernel that `auto`'s shape rule could pick.
      variants["whole_group"] = dict(backend="whole_group")
    if _LAYER_VARIANTS.value:
      variants = {n: v for n, v in variants.items()
                  if n == "dense" or n in _LAYER_VARIANTS.value}
    bench_lib.progress(f" layer {shape}: {', '.join(variants)}")
    timed = bench_lib.time_round_robin(bench_lib.jax_layer_fns(prob, variants), plan.repeats)
    table = bench_lib.split_modes(timed)
    bench_lib.ratios_to(table, "dense")
    out[shape] = {"T": t, "d": d, "E": e, "K": k, "f": f, "dtype": "bfloat16",
                  "fwd_gflop": bench_lib.layer_fwd_flops(prob) / 1e9, "variants": table}
  return out


# --- Environment. ---------------------------------------------------------

def environment(plan: Plan) -> dict:
  out = bench_lib.conditions()
  out.update(dry_run=plan.dry_run, kernels=list(plan.kernels), peers=list(plan.peers),
             argv=sys.argv)
  for mod in ("jaxlib", "tokamax", "flax", "numpy"):
    try:
      out[f"{mod}_version"] = __import__(mod).__version__
    except Exception as e:  # noqa: BLE001
      out[f"{mod}_version"] = f"unavailable ({type(e).__name__})"
  return out


def all_steps(plan: Plan, results: dict) -> dict[str, Callable[[], dict]]:
  def roof():
    r = results.get("gmm_timing", {}).get("variants", {}).get("dense", {}).get("fwd", {})
    return r.get("tflops")
  return {"environment": lambda: environment(plan), "lowering": lambda: lowering(plan),
          "gmm_correctness": lambda: gmm_correctness(plan),
          "gmm_timing": lambda: gmm_timing(plan), "gather": lambda: gather(plan),
          "layer": lambda: layer(plan), "train": lambda: train(plan, roof())}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.check_writable_file("--json_out", _JSON.value, "device_check.json")  # before any step
  platform = jax.default_backend()
  if platform not in ("gpu", "tpu") and not _DRY.value:
    raise app.UsageError(f"no accelerator (jax platform {platform!r}). Fix: run on a GPU "
                         "or TPU, or pass --dry_run (tiny shapes, interpret mode)")
  unknown = set(_STEPS.value or ()) - set(STEPS)
  if unknown:
    raise app.UsageError(f"--steps: unknown {sorted(unknown)}; use {', '.join(STEPS)}")
  plan = make_plan(platform, _DRY.value)
  unknown = set(_LAYER_SHAPES.value or ()) - set(plan.layer_shapes)
  if unknown:
    raise app.UsageError(f"--layer_shapes: unknown {sorted(unknown)}; use "
                         f"{', '.join(plan.layer_shapes)}")
  # Each variant's compile-and-first-run as it happens: a step that stalls says where.
  bench_lib.PROGRESS[0] = sys.stdout
  report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "platform": platform,
            "dry_run": plan.dry_run, "steps": {}}

  def write(steps):
    report["steps"] = steps
    report["summary"] = {n: r["status"] for n, r in steps.items()}
    if _JSON.value:
      tmp = cli.file_to_write(_JSON.value) + ".tmp"
      with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
      os.replace(tmp, _JSON.value)

  results: dict = {}
  steps = all_steps(plan, results)
  chosen = {n: f for n, f in steps.items() if not _STEPS.value or n in _STEPS.value}
  run_steps(chosen, _BUDGET.value, write, results)
  print(json.dumps(report["summary"]))
  if _JSON.value:
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  cli.run(main)
