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

``--suite=layer`` times, side by side in one process, forward and
forward+backward of
  (a) ``dense``: a SwiGLU FFN of width K*f (the same active FLOPs per token),
  (b) ``routed_experts`` with every grouped-matmul backend that runs natively
      here (``blocked`` = the fused default, ``blocked_unfused`` = permute +
      3 gmm + unpermute); Pallas backends off their platform would only run
      interpreted and are listed as skipped,
  (c) ``gshard``: GShard one-hot einsum dispatch/combine, capacity factor
      ``--capacity_factor`` per group of ``--gshard_group`` tokens,
  (d) ``ragged_dot``: routed_experts with ``jax.lax.ragged_dot``,
at T=8192, d=512 for the ``fine`` shape (E=64, K=8, f=256) and the ``coarse``
shape (E=8, K=2, f=1024). Routing comes from a fixed random router (Gaussian
logits, top-K, softmax over the K) and is computed outside the timed
functions; the backward pass differentiates params, x and the gate weights.
Repeats run round-robin over the variants so that load from other processes
hits them alike; medians are reported. A variant whose first run exceeds
``--slow_s`` gets ``--slow_repeats`` timed runs instead.

``--suite=gmm`` times the grouped matmul alone (uneven groups, ``--gmm_dtype``)
for every native backend and a dense [m, k] x [k, n] matmul of the same
FLOPs, and reports TFLOP/s (2 m k n / time for all of them, so ragged_dot's
extra masked work on CPU shows as a low rate).
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import bench_ep  # the expert-parallel suite and its ep_* flags
from experiments import bench_serving  # the serving suite and its serving_* flags
from experiments import bench_step  # the training-step profile and its step_* flags
from moejax.execution import experts as experts_lib
from moejax.execution import gmm as gmm_lib
from moejax.routing.types import RoutingResult

_SUITE = flags.DEFINE_enum("suite", "layer", ["layer", "gmm", "ep", "serving", "step"],
                           "which benchmark")
_JSON = flags.DEFINE_string("json_out", None, "write the results here as JSON")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per variant (median)")
_SLOW_S = flags.DEFINE_float("slow_s", 20.0, "a first run slower than this is 'slow'")
_SLOW_REPEATS = flags.DEFINE_integer("slow_repeats", 1, "timed runs for slow variants")
_SHAPES = flags.DEFINE_list("shapes", ["fine", "coarse"], "layer shapes to run")
_TOKENS = flags.DEFINE_integer("tokens", 8192, "T for the layer suite")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "d for the layer suite")
_VARIANTS = flags.DEFINE_list("variants", None, "subset of layer variants (default all)")
_TILE_M = flags.DEFINE_integer("tile_m", None, "row tile of the blocked backend")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "GShard capacity factor")
_GSHARD_GROUP = flags.DEFINE_integer("gshard_group", 1024, "GShard tokens per group")
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

SHAPES = {"fine": dict(num_experts=64, k=8, f=256), "coarse": dict(num_experts=8, k=2, f=1024)}


def native_backends() -> tuple[list[str], dict[str, str]]:
  """(backends that run natively here, {skipped backend: why})."""
  run, skipped = [], {}
  for name in gmm_lib.BACKENDS:
    try:
      gmm_lib.check_available(name)
      run.append(name)
    except gmm_lib.GmmError as e:
      skipped[name] = str(e).split(". Fix:")[0] + " (interpret mode is not a performance path)"
  return run, skipped


def conditions() -> dict:
  return {"platform": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "cpu_count": os.cpu_count(), "load_avg_1_5_15": list(os.getloadavg()),
          "jax": jax.__version__, "python": platform.python_version(),
          "processor": platform.processor() or platform.machine()}


def _block(x):
  return jax.block_until_ready(x)


def time_round_robin(fns: dict[str, Callable[[], object]], repeats: int,
                     slow_s: float, slow_repeats: int) -> dict[str, dict]:
  """Median seconds per fn; compile + first run are excluded.

  A variant that fails on its first run (e.g. out of memory) is reported
  with its error instead of a time, and the others still run.
  """
  first, failed = {}, {}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    try:
      _block(fn())
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
      failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      logging.warning("%s failed: %s", name, failed[name])
      continue
    first[name] = time.perf_counter() - t0
    logging.info("compiled+ran %s in %.2fs", name, first[name])
  live = {n: f for n, f in fns.items() if n in first}
  want = {n: (slow_repeats if first[n] > slow_s else repeats) for n in live}
  times = {n: [] for n in live}
  for r in range(max(want.values(), default=0)):
    for name, fn in live.items():
      if r < want[name]:
        t0 = time.perf_counter()
        _block(fn())
        times[name].append(time.perf_counter() - t0)
  out = {n: {"median_s": float(np.median(ts)), "runs": len(ts),
             "all_s": [round(t, 4) for t in ts], "first_run_s": round(first[n], 3)}
         for n, ts in times.items()}
  out.update({n: {"error": err} for n, err in failed.items()})
  return out


# --- Layer suite. -----------------------------------------------------------

def random_routing(key, t, e, k) -> RoutingResult:
  logits = jax.random.normal(key, (t, e), jnp.float32)
  vals, ids = jax.lax.top_k(logits, k)
  return RoutingResult(expert_ids=ids.astype(jnp.int32), weights=jax.nn.softmax(vals, -1),
                       valid=jnp.ones((t, k), bool), probs=jax.nn.softmax(logits, -1),
                       logits=logits)


def dense_ffn(p, x):
  h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
  return h @ p["w_down"]


def gshard_ffn(p, x, ids, weights, *, num_experts, capacity_factor, group):
  """GShard (Lepikhin et al. 2006.16668) one-hot dispatch and combine.

  Tokens are split into groups of ``group``; in each group expert e keeps
  C = ceil(cf * group * K / E) copies, slot-major priority (all top-1 before
  top-2). Dispatch and combine are dense [G, S, E, C] einsums.
  """
  t, d = x.shape
  k = ids.shape[1]
  s = min(group, t)
  g = t // s
  c = int(np.ceil(capacity_factor * s * k / num_experts))
  onehot = jax.nn.one_hot(ids.reshape(g, s, k), num_experts, dtype=jnp.int32)  # [G,S,K,E]
  sm = jnp.swapaxes(onehot, 1, 2).reshape(g, k * s, num_experts)  # slot-major
  pos = (jnp.cumsum(sm, axis=1) - 1).reshape(g, k, s, num_experts).swapaxes(1, 2)
  keep = (onehot > 0) & (pos < c)
  # A token picks an expert in at most one slot, so summing over K selects it.
  pos_e = jnp.sum(jnp.where(keep, pos, 0), axis=2)  # [G,S,E]
  kept_e = jnp.any(keep, axis=2)
  gate_e = jnp.einsum("gsk,gske->gse", weights.reshape(g, s, k).astype(x.dtype),
                      keep.astype(x.dtype))
  dispatch = jax.nn.one_hot(jnp.where(kept_e, pos_e, c), c, dtype=x.dtype)  # [G,S,E,C]
  combine = dispatch * gate_e[..., None]
  xg = x.reshape(g, s, d)
  xe = jnp.einsum("gsec,gsd->egcd", dispatch, xg)
  h = jax.nn.silu(jnp.einsum("egcd,edf->egcf", xe, p["w_gate"])) * jnp.einsum(
      "egcd,edf->egcf", xe, p["w_up"])
  ye = jnp.einsum("egcf,efd->egcd", h, p["w_down"])
  return jnp.einsum("gsec,egcd->gsd", combine, ye).reshape(t, d)


def layer_suite(shapes, variants_filter=None) -> dict:
  run, skipped = native_backends()
  out = {"conditions": conditions(), "shapes": {}}
  t, d = _TOKENS.value, _D_MODEL.value
  opts = {} if _TILE_M.value is None else {"tile_m": _TILE_M.value}
  for shape in shapes:
    e, k, f = (SHAPES[shape][n] for n in ("num_experts", "k", "f"))
    ks = jax.random.split(jax.random.PRNGKey(_SEED.value), 9)
    x = jax.random.normal(ks[0], (t, d), jnp.float32)
    cot = jax.random.normal(ks[1], (t, d), jnp.float32)
    routing = random_routing(ks[2], t, e, k)
    s_in, s_h = d ** -0.5, f ** -0.5
    moe_p = {"w_gate": jax.random.normal(ks[3], (e, d, f)) * s_in,
             "w_up": jax.random.normal(ks[4], (e, d, f)) * s_in,
             "w_down": jax.random.normal(ks[5], (e, f, d)) * s_h}
    dense_p = {"w_gate": jax.random.normal(ks[6], (d, k * f)) * s_in,
               "w_up": jax.random.normal(ks[7], (d, k * f)) * s_in,
               "w_down": jax.random.normal(ks[8], (k * f, d)) * (k * f) ** -0.5}
    ids, w = routing.expert_ids, routing.weights

    def routed(backend, **kw):
      def fn(p, x, w, ids):
        r = RoutingResult(expert_ids=ids, weights=w, valid=routing.valid,
                          probs=routing.probs, logits=routing.logits)
        return experts_lib.routed_experts(p, x, r, num_experts=e, activation="swiglu",
                                          backend=backend, **kw)
      return fn

    moe_fns = {}
    if "blocked" in run:
      moe_fns["blocked"] = routed("blocked", **opts)
      moe_fns["blocked_unfused"] = routed("blocked", fused=False, **opts)
    for name in run:
      if name not in ("blocked", "ragged_dot"):
        moe_fns[name] = routed(name)
    moe_fns["gshard"] = lambda p, x, w, ids: gshard_ffn(
        p, x, ids, w, num_experts=e, capacity_factor=_CF.value, group=_GSHARD_GROUP.value)
    if "ragged_dot" in run:
      moe_fns["ragged_dot"] = routed("ragged_dot")

    fns = {}
    if not variants_filter or "dense" in variants_filter:
      fwd = jax.jit(dense_ffn)
      fb = jax.jit(jax.grad(lambda p, x: jnp.vdot(dense_ffn(p, x), cot), (0, 1)))
      fns["dense/fwd"] = lambda fwd=fwd: fwd(dense_p, x)
      fns["dense/fwdbwd"] = lambda fb=fb: fb(dense_p, x)
    for name, fn in moe_fns.items():
      if variants_filter and name not in variants_filter:
        continue
      fwd = jax.jit(fn)
      fb = jax.jit(jax.grad(lambda p, x, w, ids, fn=fn: jnp.vdot(fn(p, x, w, ids), cot),
                            (0, 1, 2)))
      fns[f"{name}/fwd"] = lambda fwd=fwd: fwd(moe_p, x, w, ids)
      fns[f"{name}/fwdbwd"] = lambda fb=fb: fb(moe_p, x, w, ids)

    timed = time_round_robin(fns, _REPEATS.value, _SLOW_S.value, _SLOW_REPEATS.value)
    table = {}
    for key, res in timed.items():
      name, mode = key.split("/")
      table.setdefault(name, {})[mode] = res
    base = table.get("dense")
    for name, row in table.items():
      for mode in ("fwd", "fwdbwd"):
        if base and "median_s" in row.get(mode, {}) and "median_s" in base.get(mode, {}):
          row[mode]["ratio_to_dense"] = row[mode]["median_s"] / base[mode]["median_s"]
    flops_fwd = 2 * t * d * (k * f) * 3
    out["shapes"][shape] = {
        "T": t, "d": d, "E": e, "K": k, "f": f, "dense_width": k * f,
        "fwd_gflop": flops_fwd / 1e9, "capacity_factor": _CF.value,
        "gshard_group": _GSHARD_GROUP.value, "tile_m": _TILE_M.value,
        "variants": table, "skipped": skipped}
  out["conditions_after"] = {"load_avg_1_5_15": list(os.getloadavg())}
  return out


def print_layer_table(res: dict) -> None:
  for shape, s in res["shapes"].items():
    print(f"\n{shape}: T={s['T']} d={s['d']} E={s['E']} K={s['K']} f={s['f']} "
          f"(dense width {s['dense_width']}, {s['fwd_gflop']:.1f} GFLOP forward)")
    print(f"{'variant':<18}{'fwd s':>10}{'x dense':>9}{'fwd+bwd s':>11}{'x dense':>9}{'runs':>6}")
    for name, row in s["variants"].items():
      cells, notes = [], []
      for mode in ("fwd", "fwdbwd"):
        r = row.get(mode, {})
        if "median_s" in r:
          cells += [f"{r['median_s']:.3f}", f"{r.get('ratio_to_dense', float('nan')):.2f}"]
        else:
          cells += ["failed" if "error" in r else "-", "-"]
          if "error" in r:
            notes.append(f"{mode}: {r['error'][:90]}")
      runs = max((r.get("runs", 0) for r in row.values()), default=0)
      print(f"{name:<18}{cells[0]:>10}{cells[1]:>9}{cells[2]:>11}{cells[3]:>9}{runs:>6}"
            + (f"  ({'; '.join(notes)})" if notes else ""))
    for name, why in s["skipped"].items():
      print(f"{name:<18}skipped: {why}")


# --- Grouped-matmul suite. --------------------------------------------------

def uneven_group_sizes(key, m: int, groups: int) -> jax.Array:
  """Sizes summing to m, spread like a skewed router (Dirichlet(1)), one empty."""
  p = np.asarray(jax.random.dirichlet(key, jnp.ones((groups,))), np.float64)
  p[groups // 2] = 0.0
  sizes = np.floor(p / p.sum() * m).astype(np.int64)
  sizes[0] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


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
    fns[name] = lambda f=f: f(lhs, rhs, sizes)
  timed = time_round_robin(fns, _REPEATS.value, _SLOW_S.value, _SLOW_REPEATS.value)
  timed = {n: r for n, r in timed.items() if "median_s" in r}
  if _GMM_CHECK.value:
    for name, err in check_against_ragged_dot(lhs, rhs, sizes, list(timed)[1:]).items():
      timed[name]["max_rel_err_vs_ragged_dot"] = err
  flops = 2 * m * k * n
  for name, r in timed.items():
    r["tflops"] = flops / r["median_s"] / 1e12
    r["fraction_of_dense"] = r["tflops"] / (flops / timed["dense"]["median_s"] / 1e12)
  return {"conditions": conditions(), "m": m, "k": k, "n": n, "groups": g,
          "dtype": str(dt), "group_sizes": np.asarray(sizes).tolist(),
          "results": timed, "skipped": {b: w for b, w in skipped.items() if b not in backends}}


def check_against_ragged_dot(lhs, rhs, sizes, backends) -> dict[str, dict]:
  """Max |x - ref| / max |ref| of out, d_lhs, d_rhs per backend (f32 math)."""
  cot = jax.random.normal(jax.random.PRNGKey(1), (lhs.shape[0], rhs.shape[2]), jnp.float32)

  def run(name):
    f = jax.jit(lambda a, b: jax.vjp(lambda a, b: gmm_lib.gmm(
        a, b, sizes, backend=name, preferred_element_type=jnp.float32), a, b))
    out, vjp = f(lhs, rhs)
    return (out,) + tuple(vjp(cot))

  try:
    ref = [np.asarray(a, np.float32) for a in run("ragged_dot")]
  except Exception as e:  # noqa: BLE001 - e.g. ragged_dot out of memory on CPU
    logging.warning("no correctness check: ragged_dot failed: %s", e)
    return {}
  errs = {}
  for name in backends:
    try:
      got = ref if name == "ragged_dot" else [np.asarray(a, np.float32) for a in run(name)]
    except Exception as e:  # noqa: BLE001
      errs[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
      continue
    errs[name] = {k: float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), 1e-30))
                  for k, g, r in zip(("out", "d_lhs", "d_rhs"), got, ref)}
  return errs


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
  for name, why in res["skipped"].items():
    print(f"{name:<14}skipped: {why}")


def main(argv):
  del argv
  if _SUITE.value == "layer":
    unknown = set(_SHAPES.value) - set(SHAPES)
    if unknown:
      raise app.UsageError(f"--shapes: unknown {sorted(unknown)}; use {sorted(SHAPES)}")
    res = layer_suite(_SHAPES.value, _VARIANTS.value)
    print_layer_table(res)
  elif _SUITE.value == "ep":
    res = bench_ep.ep_suite(_REPEATS.value)
    bench_ep.print_ep_table(res)
  elif _SUITE.value == "step":
    res = bench_step.step_suite(conditions())
    bench_step.print_step_table(res)
  elif _SUITE.value == "serving":
    res = bench_serving.serving_suite(conditions())
    bench_serving.print_serving_table(res)
  else:
    res = gmm_suite()
    print_gmm_table(res)
  print(f"\nconditions: {json.dumps(res['conditions'])}")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  app.run(main)
