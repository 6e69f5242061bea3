r"""Execution-plane benchmarks: the routed-expert layer and the grouped matmul.

Usage:
  python -m experiments.bench --suite=layer --json_out=/tmp/layer.json
  python -m experiments.bench --suite=gmm --json_out=/tmp/gmm.json \
      --gmm_m=8192 --gmm_k=512 --gmm_n=384        # CPU-sized
  python -m experiments.bench --suite=gmm         # GPU: m=65536 k=2048 n=1408
  python -m experiments.bench --suite=ep --json_out=/tmp/ep.json  # experiments/bench_ep.py
  python -m experiments.bench --suite=serving --json_out=/tmp/serving.json \
      --serving_plot=/tmp/serving.png                # experiments/bench_serving.py
  python -m experiments.bench --suite=step --step_scale=m   # experiments/bench_step.py
  python -m experiments.bench --suite=step --step_twin      # experiments/bench_twin.py
  python -m experiments.bench --suite=scaling --json_out=/tmp/scaling.json
  python -m experiments.bench --suite=profile --json_out=/tmp/profile.json  # bench_profile.py
      # experiments/bench_scaling.py: the MoE / dense ratio as E and T grow
  python -m experiments.bench --suite=peak     # this machine's MFU peak, cached once

``--suite=layer`` times, side by side in one process, forward and
forward+backward of
  (a) ``dense``: a SwiGLU FFN of width K*f (the same active FLOPs per token),
  (b) ``routed_experts`` with every grouped-matmul backend that runs natively
      here (``blocked`` = the fused default, ``blocked_unfused`` = permute +
      3 gmm + unpermute, ``blocked_folded`` = 3 gmm with the gather and the
      combine folded into their row loads and stores, ``blocked_t512`` = the
      fused loop with fixed 512-row tiles instead of ``tiling.fused_tiles``'
      rule, without ``--tile_m``/``--tile_small``); Pallas backends off
      their platform would only run
      interpreted and are listed as skipped,
  (c) ``gshard``: GShard one-hot einsum dispatch/combine, capacity factor
      ``--capacity_factor`` per group of ``--gshard_group`` tokens,
  (d) ``ragged_dot``: routed_experts with ``jax.lax.ragged_dot``,
  (e) the peer, when the ``interop`` extra (torch, transformers) is installed:
      ``torch_dense`` (the same dense SwiGLU FFN in PyTorch) and
      ``hf_mixtral`` (Hugging Face transformers' MixtralSparseMoeBlock, its
      default per-expert loop) and ``hf_mixtral_grouped_mm`` (the same block
      with ``experts_implementation='grouped_mm'``; ``--hf_impls`` picks
      the implementations), with ``torch.set_num_threads``
      = ``--torch_threads`` (default: the CPU count, as XLA:CPU uses),
at T=8192, d=512 for the ``fine`` shape (E=64, K=8, f=256) and the ``coarse``
shape (E=8, K=2, f=1024). JAX variants are compared with ``dense``, torch
variants with ``torch_dense``: the MoE / dense ratio of each framework,
measured side by side in one process. Routing comes from a fixed random router (Gaussian
logits, top-K, softmax over the K) and is computed outside the timed
functions; the backward pass differentiates params, x and the gate weights.
Repeats run round-robin over the variants so that load from other processes
hits them alike; medians are reported. A variant whose first run exceeds
``--slow_s`` gets ``--slow_repeats`` timed runs instead.

Every suite says what each variant did as it goes (``name: compiled and ran
in 0.31s``, ``FAILED: ...``, ``refused: ...``), then prints its table. A
variant that fails is a row saying so, and the binary then ends with one
``error:`` line naming the failed runs and exit status 1 (``--keep_going``:
status 0, and a note). On CPU, ragged_dot runs as a dense product over every
group, whose memory grows with E x T x d (tens of GB at the fine shape): its
variants are compiled first and refused in one line, not run, when XLA's
estimate of their memory exceeds what the machine has available. absl's
INFO lines and transformers' notices stay out of the output (``-v`` shows
them).

``--suite=peak`` measures this machine's dense matmul roof in float32 and
bfloat16 (the best of a few seconds of 512^3 matmuls each) and caches it in
the user's cache directory (``moejax.train.mfu.calibration_path``): the
trainer's MFU on a device without a datasheet peak (a CPU) is against it,
read, never measured again under a run's load.

``--suite=gmm`` times the grouped matmul alone (uneven groups, ``--gmm_dtype``)
for every native backend and a dense [m, k] x [k, n] matmul of the same
FLOPs, and reports TFLOP/s (2 m k n / time for all of them, so ragged_dot's
extra masked work on CPU shows as a low rate).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import bench_ep  # the expert-parallel suite and its ep_* flags
from experiments import bench_lib
from experiments import bench_profile  # where the layer's time goes, by kind; profile_* flags
from experiments import bench_scaling  # the E / T scaling suite and its scaling_* flags
from experiments import bench_serving  # the serving suite and its serving_* flags
from experiments import bench_step  # the training-step profile and its step_* flags
from experiments import bench_twin  # --suite=step --step_twin: MoE vs its dense twin
from experiments import cli
from experiments.bench_lib import (SHAPES, conditions, dense_ffn, gshard_ffn,  # noqa: F401
                                   native_backends, random_routing, time_round_robin,
                                   uneven_group_sizes)
from moejax.execution import gmm as gmm_lib

_SUITE = flags.DEFINE_enum("suite", "layer",
                           ["layer", "gmm", "ep", "serving", "step", "scaling", "profile",
                            "peak"],
                           "which benchmark ('peak': calibrate this machine's matmul peak "
                           "for the trainer's MFU, once)")
_JSON = flags.DEFINE_string("json_out", None, "write the results here as JSON")
_KEEP_GOING = flags.DEFINE_bool("keep_going", False, "exit 0 even when a variant failed (its "
                                "row says so); without it a failure makes the exit status 1")
_FAIL_VARIANTS = flags.DEFINE_list("fail_variants", [], "test hook: these variants (layer or "
                                   "gmm names) raise instead of running, to check the failure "
                                   "path")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per variant (median)")
_SLOW_S = flags.DEFINE_float("slow_s", 20.0, "a first run slower than this is 'slow' "
                             "(--suite=scaling: its first timed run, 6 s unless given)")
_SLOW_REPEATS = flags.DEFINE_integer("slow_repeats", 1, "timed runs for slow variants "
                                     "(--suite=scaling: 2 unless given)")
_SHAPES = flags.DEFINE_list("shapes", ["fine", "coarse"], "layer shapes to run")
_TOKENS = flags.DEFINE_integer("tokens", 8192, "T for the layer suite")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "d for the layer suite")
_VARIANTS = flags.DEFINE_list("variants", None, "subset of layer variants (default all)")
_TILE_M = flags.DEFINE_integer("tile_m", None, "row tile of the blocked backend")
_TILE_SMALL = flags.DEFINE_integer("tile_small", None, "remainder tile of the blocked backend")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "GShard capacity factor")
_GSHARD_GROUP = flags.DEFINE_integer("gshard_group", 1024, "GShard tokens per group")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", os.cpu_count(),
                                      "torch.set_num_threads for the torch variants")
_HF_IMPLS = flags.DEFINE_list("hf_impls", ["eager", "grouped_mm"],
                              "MixtralSparseMoeBlock experts_implementation values to time")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
_GMM_M = flags.DEFINE_integer("gmm_m", 65536, "gmm rows (token copies)")
_GMM_K = flags.DEFINE_integer("gmm_k", 2048, "gmm contraction width")
_GMM_N = flags.DEFINE_integer("gmm_n", 1408, "gmm output width")
_GMM_G = flags.DEFINE_integer("gmm_groups", 64, "gmm groups")
_GMM_DTYPE = flags.DEFINE_string("gmm_dtype", "bfloat16", "gmm operand dtype")
_GMM_BACKENDS = flags.DEFINE_list("gmm_backends", None,
                                  "gmm backends to time (default: all native ones)")
_GMM_CHECK = flags.DEFINE_bool("gmm_check", True,
                               "also compare each backend's output and gradients with "
                               "ragged_dot once (untimed), so one run checks correctness")


# --- Layer suite. -----------------------------------------------------------

TORCH_BASE, JAX_BASE = "torch_dense", "dense"


def layer_suite(shapes, variants_filter=None) -> dict:
  run, skipped = native_backends()
  out = {"conditions": conditions(), "shapes": {}}
  t, d = _TOKENS.value, _D_MODEL.value
  opts = {key: flag.value for key, flag in (("tile_m", _TILE_M), ("tile_small", _TILE_SMALL))
          if flag.value is not None}
  keep = lambda name: not variants_filter or name in variants_filter
  for shape in shapes:
    e, k, f = (SHAPES[shape][n] for n in ("num_experts", "k", "f"))
    prob = bench_lib.layer_problem(t, d, e, k, f, seed=_SEED.value)
    variants = {"dense": None}
    if "blocked" in run:
      variants["blocked"] = dict(backend="blocked", **opts)
      if not opts:  # the fixed 512-row tiles the fused loop used before tiling.fused_tiles
        variants["blocked_t512"] = dict(backend="blocked", tile_m=512, tile_small=64)
      variants["blocked_unfused"] = dict(backend="blocked", fused=False, fold_permute=False,
                                         **opts)
      variants["blocked_folded"] = dict(backend="blocked", fused=False, **opts)
    variants.update({name: dict(backend=name) for name in run
                     if name not in ("blocked", "ragged_dot")})
    variants["gshard"] = dict(capacity_factor=_CF.value, group=_GSHARD_GROUP.value)
    if "ragged_dot" in run:
      variants["ragged_dot"] = dict(backend="ragged_dot")
    fns = bench_lib.jax_layer_fns(prob, {n: v for n, v in variants.items() if keep(n)})
    torch_fns = bench_lib.torch_layer_fns(prob, _TORCH_THREADS.value, tuple(_HF_IMPLS.value))
    torch_note = torch_fns.pop("_skipped", None)
    fns.update({n: fn for n, fn in torch_fns.items() if keep(n.split("/")[0])})
    auto = bench_lib.auto_decision(t, d, e, k, f)
    print(f"{shape}: T={t} d={d} E={e} K={k} f={f}, {len(fns)} runs; auto runs "
          f"{auto['backend']} ({auto['line']})", flush=True)
    timed = time_round_robin(_forced_failures(fns), _REPEATS.value, _SLOW_S.value,
                             _SLOW_REPEATS.value)
    table = bench_lib.split_modes(timed)
    torch_names = {n.split("/")[0] for n in torch_fns}
    jax_rows = {n: r for n, r in table.items() if n not in torch_names}
    torch_rows = {n: r for n, r in table.items() if n in torch_names}
    bench_lib.ratios_to(jax_rows, JAX_BASE)
    bench_lib.ratios_to(torch_rows, TORCH_BASE)
    for rows, base in ((jax_rows, JAX_BASE), (torch_rows, TORCH_BASE)):
      for row in rows.values():  # one key for the printer: the ratio to its own dense
        for mode in row.values():
          if f"ratio_to_{base}" in mode:
            mode["ratio_to_dense"] = mode[f"ratio_to_{base}"]
            mode["cpu_ratio_to_dense"] = mode[f"cpu_ratio_to_{base}"]
    out["shapes"][shape] = {
        "T": t, "d": d, "E": e, "K": k, "f": f, "dense_width": k * f,
        "fwd_gflop": bench_lib.layer_fwd_flops(prob) / 1e9, "capacity_factor": _CF.value,
        "gshard_group": _GSHARD_GROUP.value, "tiles": opts,
        "torch_threads": _TORCH_THREADS.value if torch_fns else None,
        "torch_skipped": torch_note, "auto": auto,
        "variants": table, "skipped": skipped}
  out["conditions_after"] = {"load_avg_1_5_15": list(os.getloadavg())}
  return out


def _forced_failures(fns: dict) -> dict:
  """``fns`` with the --fail_variants ones (by variant name) raising instead."""
  def fail(name):
    def fn():
      raise RuntimeError(f"{name} forced to fail by --fail_variants")
    return fn
  return {n: fail(n) if n.split("/")[0] in _FAIL_VARIANTS.value else fn
          for n, fn in fns.items()}


def print_layer_table(res: dict) -> None:
  for shape, s in res["shapes"].items():
    print(f"\n{shape}: T={s['T']} d={s['d']} E={s['E']} K={s['K']} f={s['f']} "
          f"(dense width {s['dense_width']}, {s['fwd_gflop']:.1f} GFLOP forward)")
    print("(x dense: JAX variants vs dense, torch variants vs torch_dense; cpu: the same "
          "ratio in process CPU time)")
    if s.get("auto"):
      print(f"auto here runs {s['auto']['backend']}: {s['auto']['line']}")
    print(f"{'variant':<22}{'fwd s':>10}{'x dense':>9}{'fwd+bwd s':>11}{'x dense':>9}"
          f"{'cpu x':>8}{'runs':>6}")
    for name, row in s["variants"].items():
      cells, notes = [], []
      for mode in ("fwd", "fwdbwd"):
        r = row.get(mode, {})
        if "median_s" in r:
          cells += [f"{r['median_s']:.3f}", f"{r.get('ratio_to_dense', float('nan')):.2f}"]
        else:
          state = "failed" if "error" in r else "refused" if "refused" in r else "-"
          cells += [state, "-"]
          if state != "-":  # an error's first line is cut at 200 characters already
            notes.append(f"{mode}: {r.get('error') or r['refused']}")
      runs = max((r.get("runs", 0) for r in row.values()), default=0)
      cpu = row.get("fwdbwd", {}).get("cpu_ratio_to_dense")
      cpu_s = "-" if cpu is None else f"{cpu:.2f}"
      print(f"{name:<22}{cells[0]:>10}{cells[1]:>9}{cells[2]:>11}{cells[3]:>9}{cpu_s:>8}"
            f"{runs:>6}" + (f"  ({'; '.join(notes)})" if notes else ""))
    for name, why in s["skipped"].items():
      print(f"{name:<22}skipped: {why}")
    if s.get("torch_skipped"):
      print(f"{'torch variants':<22}skipped: {s['torch_skipped']}")


# --- Grouped-matmul suite. --------------------------------------------------

def gmm_suite() -> dict:
  run, skipped = native_backends()
  backends = _GMM_BACKENDS.value or run
  m, k, n, g = _GMM_M.value, _GMM_K.value, _GMM_N.value, _GMM_G.value
  dt = jnp.dtype(_GMM_DTYPE.value)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(_SEED.value), 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dt)
  rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k ** -0.5).astype(dt)
  sizes = uneven_group_sizes(k3, m, g)
  dense_rhs = rhs[0]
  fns = {"dense": lambda f=jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                                   .astype(dt)): f(lhs, dense_rhs)}
  for name in backends:
    f = jax.jit(lambda a, b, s, name=name: gmm_lib.gmm(a, b, s, backend=name))
    fns[name] = (bench_lib.memory_checked(f, (lhs, rhs, sizes), f"{name} (its dense CPU "
                                          "fallback)")
                 if name == "ragged_dot" and jax.default_backend() == "cpu"
                 else lambda f=f: f(lhs, rhs, sizes))
  timed = time_round_robin(_forced_failures(fns), _REPEATS.value, _SLOW_S.value,
                           _SLOW_REPEATS.value)
  failed = {n: r for n, r in timed.items() if "median_s" not in r}  # rows saying why
  timed = {n: r for n, r in timed.items() if "median_s" in r}
  if _GMM_CHECK.value and "ragged_dot" not in failed:  # the reference: refused, no check
    for name, err in bench_lib.check_against_ragged_dot(lhs, rhs, sizes, list(timed)[1:]).items():
      timed[name]["max_rel_err_vs_ragged_dot"] = err
  flops = 2 * m * k * n
  dense_s = timed["dense"]["median_s"] if "dense" in timed else float("nan")
  for name, r in timed.items():
    r["tflops"] = flops / r["median_s"] / 1e12
    r["fraction_of_dense"] = dense_s / r["median_s"]
  return {"conditions": conditions(), "m": m, "k": k, "n": n, "groups": g,
          "dtype": str(dt), "group_sizes": np.asarray(sizes).tolist(),
          "results": timed, "failed": failed,
          "skipped": {b: w for b, w in skipped.items() if b not in backends}}



def print_gmm_table(res: dict) -> None:
  print(f"\ngmm m={res['m']} k={res['k']} n={res['n']} G={res['groups']} {res['dtype']} "
        f"on {res['conditions']['platform']}")
  print(f"{'variant':<14}{'median s':>12}{'TFLOP/s':>10}{'x dense':>9}  max rel err "
        "vs ragged_dot (out, d_lhs, d_rhs)")
  for name, r in res["results"].items():
    err = r.get("max_rel_err_vs_ragged_dot")
    err_s = (", ".join(f"{v:.1e}" if isinstance(v, float) else str(v) for v in err.values())
             if err else "")
    print(f"{name:<14}{r['median_s']:>12.5f}{r['tflops']:>10.3f}{r['fraction_of_dense']:>9.2f}"
          f"  {err_s}")
  for name, r in res.get("failed", {}).items():
    print(f"{name:<14}{'failed' if 'error' in r else 'refused'}: "
          f"{r.get('error') or r.get('refused')}")
  for name, why in res["skipped"].items():
    print(f"{name:<14}skipped: {why}")


def peak_suite() -> dict:
  """Calibrates this machine's peak for the trainer's MFU (moejax.train.mfu.calibrate)."""
  from moejax.train import mfu  # pylint: disable=g-import-not-at-top
  return {"calibrations": mfu.calibrate(), "path": mfu.calibration_path(),
          "conditions": conditions()}


def print_peak_table(res: dict) -> None:
  from moejax.train import mfu  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  print(f"matmul peak of this machine, cached in {res['path']} (the trainer's MFU reads it):")
  for key, rec in res["calibrations"].items():
    hit = mfu.table_peak(device.device_kind, rec["dtype"])
    used = (f"; runs use the datasheet peak {hit[1] / 1e12:.4g} TFLOP/s ({hit[0]})" if hit
            else "")
    print(f"  {key}: {rec['tflops']:.4g} TFLOP/s ({rec['matmul']}){used}")


def main(argv):
  del argv
  bench_lib.PROGRESS[0] = sys.stdout  # a line per variant as it goes, before the table
  try:
    res = run_suite(_SUITE.value)
  except bench_lib.BenchFailed as e:
    cli.fail(f"{e}. Fix: see the error above; nothing was timed")
  print(f"\nconditions: {json.dumps(res['conditions'])}")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)
    print(f"wrote {_JSON.value}")
  finish(res, _KEEP_GOING.value)


def finish(res: dict, keep_going: bool) -> None:
  """Exit status 1 with one ``error:`` line naming the failed runs, unless ``keep_going``
  (then a note, status 0); nothing when every run ran."""
  failed = bench_lib.failures(res)
  if failed and not keep_going:
    cli.fail(f"{len(failed)} benchmark run(s) failed: {'; '.join(failed)[:600]}. Fix: see "
             "each one's row above, or pass --keep_going to exit 0 with them in the table")
  if failed:
    print(f"note: {len(failed)} benchmark run(s) failed (--keep_going: exit status 0)",
          file=sys.stderr)


def run_suite(suite: str) -> dict:
  """Runs ``suite`` and prints its table; returns its results."""
  if suite == "peak":
    res = peak_suite()
    print_peak_table(res)
  elif suite == "layer":
    unknown = set(_SHAPES.value) - set(SHAPES)
    if unknown:
      raise app.UsageError(f"--shapes: unknown {sorted(unknown)}; use {sorted(SHAPES)}")
    res = layer_suite(_SHAPES.value, _VARIANTS.value)
    print_layer_table(res)
  elif suite == "ep":
    res = bench_ep.ep_suite(_REPEATS.value)
    bench_ep.print_ep_table(res)
  elif suite == "step" and bench_twin.enabled():
    res = bench_twin.run_from_flags(conditions())
    bench_twin.print_twin_table(res)
  elif suite == "step":
    res = bench_step.step_suite(conditions())
    bench_step.print_step_table(res)
  elif suite == "scaling":
    given = lambda flag: flag.value if flag.present else None  # else the suite's defaults
    spec = bench_scaling.spec_from_flags(_REPEATS.value, given(_SLOW_S), given(_SLOW_REPEATS),
                                         _TORCH_THREADS.value, _SEED.value)
    res = bench_scaling.scaling_suite(spec, conditions())
    bench_scaling.print_scaling_table(res)
  elif suite == "profile":
    res = bench_profile.run_from_flags(_REPEATS.value, _SEED.value, conditions())
    bench_profile.print_profile_table(res)
  elif suite == "serving":
    res = bench_serving.serving_suite(conditions())
    bench_serving.print_serving_table(res)
  else:
    res = gmm_suite()
    print_gmm_table(res)
  return res


if __name__ == "__main__":
  # Transformers' notices (the torch peer's ExpertsInterface note) stay out of the table,
  # as absl's INFO lines and orbax / TFDS notes do (cli.run's quiet logs; -v shows them).
  if not any(a.startswith(("-v", "--verbosity")) for a in sys.argv[1:]):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  cli.run(main)
