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
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common_flags
from experiments.benchmarks import lib as bench_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import pallas_gather
from moejax.execution import permute as permute_lib
from moejax.train import mfu as mfu_lib

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

BF16 = jnp.bfloat16
# Dense bf16 peak FLOP/s by device kind: the trainer's table (moejax.train.mfu.PEAK_BF16,
# vendor data sheets), so this script and the train rows' MFU use the same peak.
# Config fields this script sets, in one place (field paths move with the
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
# Boolean results that make a step's status 'check_failed' when False.
CHECK_KEYS = ("all_lowered", "all_kernels_passed", "all_exact")
STEPS = ("environment", "lowering", "gmm_correctness", "gmm_timing", "gather", "layer", "train")


@dataclasses.dataclass
class Plan:
  """What runs where, and at which sizes."""

  platform: str
  dry_run: bool
  kernels: tuple[str, ...]              # moejax gmm backends checked
  options: dict[str, dict]              # their keyword arguments (tiling, interpret)
  peers: tuple[str, ...]                # megablox / tokamax / jax_mgpu
  gathers: tuple[str, ...]              # permute gather backends besides xla
  repeats: int
  inner: int                            # calls per timed repeat
  check_m: int
  check_kn: tuple[int, int]
  gmm_shape: tuple[int, int, int, int]  # m, k, n, G
  sweep: tuple[tuple[int, int, int], ...]
  gather_shape: tuple[int, int, int]    # T, K, d
  layer_td: tuple[int, int]
  layer_shapes: dict[str, dict]
  train_steps: int
  train_small: dict                     # overrides of the default config
  train_backend: str


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

def failure(e: BaseException) -> dict:
  """The error and the last frames of its traceback, for the JSON."""
  frames = traceback.format_exception(type(e), e, e.__traceback__)
  tail = "".join(frames).strip().splitlines()[-12:]
  return {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:500]}",
          "traceback": tail}


def guarded(fn: Callable[[], Any]) -> Any:
  """fn() or a failure record: one failing variant does not end its step."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 - recorded, the step goes on
    return failure(e)


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


# --- Grouped matmul: callables per variant. ---------------------------------

def peer_gmm(name: str, plan: Plan) -> Callable:
  """(lhs, rhs, group_sizes) -> out f32 for a peer implementation."""
  if name == "tokamax":
    import tokamax  # the ``kernels`` extra; an ImportError is recorded
    return lambda a, b, s: tokamax.ragged_dot(a, b, s, preferred_element_type=jnp.float32)
  if name == "megablox":
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
    tiling = (32, 64, 64) if plan.dry_run else (512, 1024, 1024)
    # Positional: its custom_vjp keeps preferred type, tiling, transpose_rhs
    # and interpret as non-differentiable arguments.
    return lambda a, b, s: megablox.gmm(a, b, s, jnp.float32, tiling, None, None, False,
                                        plan.dry_run)
  if name == "jax_mgpu":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return lambda a, b, s: ragged_dot_mgpu.ragged_dot(
        a, b, group_sizes=s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
        grid_block_n=1).astype(jnp.float32)
  raise ValueError(f"unknown peer {name!r}")


def moejax_gmm(backend: str, plan: Plan, **extra) -> Callable:
  kw = dict(plan.options.get(backend, {}), **extra)
  return lambda a, b, s: gmm_lib.gmm(a, b, s, backend=backend,
                                     preferred_element_type=jnp.float32, **kw)


def _value_and_grads(fn, lhs, rhs, sizes, cot):
  out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
  return (out,) + tuple(vjp(cot.astype(out.dtype)))


def gmm_cases(m: int, dry_run: bool) -> dict[str, list[int]]:
  """Group sizes per case; the dry run keeps G = 4 everywhere (one compile each)."""
  if dry_run:
    return {"ragged_empty_tail": [m // 4, 0, m // 2 + 3, m // 8],
            "one_group": [0, m, 0, 0], "all_empty": [0, 0, 0, 0]}
  rng = np.random.default_rng(0)
  ragged = rng.multinomial(m - 37, rng.dirichlet(np.ones(16))).tolist()
  ragged[5] = ragged[11] = 0  # empty groups; 37 + those rows lie past the groups
  return {"ragged_empty_tail": ragged, "one_group": [m],
          "empty_groups": [0, m // 3, 0, 0, m - m // 3, 0], "all_empty": [0, 0, 0]}


def gmm_correctness(plan: Plan) -> dict:
  k, n = plan.check_kn
  m = plan.check_m
  key = jax.random.PRNGKey(0)
  out, ok = {}, True
  variants = {b: moejax_gmm(b, plan) for b in plan.kernels}
  variants.update({p: p for p in plan.peers})
  # One jitted function per variant (group sizes are an argument): a case
  # with the same shapes reuses its compile, which the interpreters need.
  jitted = {}

  def compiled(name):
    if name not in jitted:
      fn = variants[name]
      f = peer_gmm(fn, plan) if isinstance(fn, str) else fn
      if name == "jax_mgpu":  # forward only
        jitted[name] = jax.jit(lambda a, b, gs, c: (f(a, b, gs),))
      else:
        jitted[name] = jax.jit(lambda a, b, gs, c: _value_and_grads(f, a, b, gs, c))
    return jitted[name]

  ref_fn = lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32)
  ref_jit = jax.jit(lambda a, b, gs, c: _value_and_grads(ref_fn, a, b, gs, c))
  tgmm_jit = {b: jax.jit(lambda a, c, gs, b=b: gmm_lib.tgmm(
      a, c, gs, backend=b, preferred_element_type=jnp.float32, **plan.options[b]))
              for b in plan.kernels}
  for case, sizes in gmm_cases(m, plan.dry_run).items():
    g = len(sizes)
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, g), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(BF16)
    rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k ** -0.5).astype(BF16)
    cot = jax.random.normal(k3, (m, n), jnp.float32).astype(BF16)
    gs = jnp.asarray(sizes, jnp.int32)
    used = int(sum(sizes))
    # The reference in f32 on the same bf16 values, bf16-rounded cotangent.
    f32 = lambda a: a.astype(jnp.float32)
    ref = ref_jit(f32(lhs), f32(rhs), gs, f32(cot))
    rows = {}
    for name in variants:
      def one(name=name):
        got = compiled(name)(lhs, rhs, gs, cot)
        # megablox leaves rows past the groups uninitialised: compare the groups' rows.
        lim = used if name == "megablox" else m
        errs = {"out": bench_lib.rel_err(got[0][:lim], ref[0][:lim])}
        if len(got) == 3:
          errs["d_lhs"] = bench_lib.rel_err(got[1][:lim], ref[1][:lim])
          errs["d_rhs"] = bench_lib.rel_err(got[2], ref[2])
        res = {"max_rel_err": errs, "tol": 2e-2,
               "passed": all(v <= 2e-2 for v in errs.values())}
        if name in plan.kernels:  # moejax's contract: exact zeros
          res["rows_past_groups_zero"] = bool(np.all(np.asarray(got[0][used:]) == 0))
          empty = np.asarray(sizes) == 0
          res["empty_group_grad_zero"] = bool(np.all(np.asarray(got[2])[empty] == 0))
          res["passed"] &= res["rows_past_groups_zero"] and res["empty_group_grad_zero"]
        return res
      rows[name] = guarded(one)
      ok &= rows[name].get("passed", False) or name in plan.peers
    # tgmm directly: the weight-gradient kernel as its own entry point.
    for b in plan.kernels:
      def tg(b=b):
        err = bench_lib.rel_err(tgmm_jit[b](lhs, cot, gs), ref[2])
        return {"max_rel_err": err, "passed": err <= 2e-2}
      rows[f"{b}_tgmm"] = guarded(tg)
      ok &= rows[f"{b}_tgmm"].get("passed", False)
    out[case] = {"sizes": sizes, "m": m, "k": k, "n": n, "variants": rows}
  return {"cases": out, "all_kernels_passed": bool(ok), "dtype": "bfloat16",
          "reference": "jax.lax.ragged_dot in f32 on the same bf16 values"}


def gmm_timing(plan: Plan) -> dict:
  m, k, n, g = plan.gmm_shape
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(BF16)
  rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k ** -0.5).astype(BF16)
  cot = jax.random.normal(k4, (m, n), jnp.float32).astype(BF16)
  sizes = bench_lib.uneven_group_sizes(k3, m, g)
  fwd = {"dense": lambda a, b, s: jnp.dot(a, b[0], preferred_element_type=jnp.float32),
         "ragged_dot": moejax_gmm("ragged_dot", plan)}
  for b in plan.kernels:
    fwd[b] = moejax_gmm(b, plan)
  if "pallas_gpu" in plan.kernels:
    for tiling in plan.sweep:
      fwd[f"pallas_gpu{tiling}"] = moejax_gmm("pallas_gpu", plan, tiling=tiling)
  peers = {}
  for p in plan.peers:
    peers[p] = guarded(lambda p=p: peer_gmm(p, plan))
    if callable(peers[p]):
      fwd[p] = peers[p]
  fns = {}
  for name, f in fwd.items():
    jf = jax.jit(f)
    fns[f"{name}/fwd"] = lambda jf=jf: jf(lhs, rhs, sizes)
    fwd_only = ("dense", "jax_mgpu") + (plan.peers if plan.dry_run else ())
    if name not in fwd_only and not name.startswith("pallas_gpu("):
      jb = jax.jit(lambda a, b, c, f=f: _value_and_grads(f, a, b, sizes, c))
      fns[f"{name}/fwdbwd"] = lambda jb=jb: jb(lhs, rhs, cot)
  timed = bench_lib.time_round_robin(fns, plan.repeats, inner=plan.inner)
  table = bench_lib.split_modes(timed)
  flops = {"fwd": 2.0 * m * k * n, "fwdbwd": 6.0 * m * k * n}
  dense = table.get("dense", {}).get("fwd", {}).get("median_s")
  for row in table.values():
    for mode, r in row.items():
      if "median_s" in r:
        r["tflops"] = flops[mode] / r["median_s"] / 1e12
        if dense:
          r["fraction_of_dense"] = r["tflops"] / (flops["fwd"] / dense / 1e12)
  out = {"m": m, "k": k, "n": n, "groups": g, "dtype": "bfloat16",
         "group_sizes": np.asarray(sizes).tolist(), "variants": table,
         "peers_unavailable": {p: v for p, v in peers.items() if not callable(v)}}
  if "pallas_gpu" in plan.kernels and not plan.dry_run:
    best = max((r["fwd"]["fraction_of_dense"], name) for name, r in table.items()
               if name.startswith("pallas_gpu") and "fraction_of_dense" in r.get("fwd", {}))
    rd = table.get("ragged_dot", {}).get("fwd", {}).get("median_s", float("inf"))
    out["target"] = {"what": ">= 0.70 of dense TFLOP/s and faster than ragged_dot",
                     "best_variant": best[1], "fraction_of_dense": best[0],
                     "faster_than_ragged_dot": table[best[1]]["fwd"]["median_s"] < rd,
                     "met": best[0] >= 0.70 and table[best[1]]["fwd"]["median_s"] < rd}
  return out


# --- Gather. ----------------------------------------------------------------

def gather(plan: Plan) -> dict:
  t, k, d = plan.gather_shape
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (t, d), jnp.float32).astype(BF16)
  ids = jax.random.randint(jax.random.fold_in(key, 1), (t, k), 0, 64)
  valid = jax.random.uniform(jax.random.fold_in(key, 2), (t, k)) > 0.1
  disp = permute_lib.sort_by_expert(ids.astype(jnp.int32), valid, 64)
  idx = disp.src_token  # R = T K rows, sentinel T for the dropped tenth
  want = jnp.take(x, idx, axis=0, mode="fill", fill_value=0)
  kernels = {"pallas_gpu": pallas_gather.gather_rows_gpu,
             "pallas_tpu": pallas_gather.gather_rows}
  fns = {"xla": jax.jit(lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=0))}
  exact = {}
  for name in plan.gathers:
    fns[name] = jax.jit(lambda x, i, fn=kernels[name]: fn(x, i, interpret=plan.dry_run))
    exact[name] = guarded(lambda name=name: bool(np.array_equal(
        np.asarray(fns[name](x, idx), np.float32), np.asarray(want, np.float32))))
    # End to end: permute + unpermute with this gather equals the xla one, grads too.
    w = jnp.where(valid, 0.5, 0.0)

    def e2e(backend):
      kw = dict(backend=backend, interpret=plan.dry_run and backend != "xla")
      f = lambda x, w: jnp.sum(permute_lib.unpermute(
          permute_lib.permute(x, disp, **kw) * 2, disp, w.astype(BF16), **kw).astype(
              jnp.float32) ** 2)
      return jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)

    exact[f"{name}_permute_unpermute"] = guarded(lambda name=name: bool(all(
        np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)
        for a, b in zip(jax.tree.leaves(e2e(name)), jax.tree.leaves(e2e("xla"))))))
  timed = bench_lib.time_round_robin({n: (lambda f=f: f(x, idx)) for n, f in fns.items()},
                                     plan.repeats, inner=plan.inner)
  nbytes = 2 * idx.shape[0] * d * 2  # read + write of R bf16 rows
  for r in timed.values():
    if "median_s" in r:
      r["gb_per_s"] = nbytes / r["median_s"] / 1e9
  return {"T": t, "K": k, "d": d, "rows": int(idx.shape[0]), "exact": exact,
          "all_exact": all(v is True for v in exact.values()), "variants": timed}


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


# --- Training. --------------------------------------------------------------

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


# --- Environment and lowering. ----------------------------------------------

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


def _folded_kernels(be) -> dict:
  """{name: (fn, specs)} for the backend's three folded kernels (rows [256]
  into x [100, 128]; absent rows are 100)."""
  s = jax.ShapeDtypeStruct
  x, rows, gs = s((100, 128), BF16), s((256,), jnp.int32), s((4,), jnp.int32)
  rhs, h, scale = s((4, 128, 192), BF16), s((256, 128), BF16), s((256,), jnp.float32)
  grad = s((256, 192), BF16)
  return {
      "gather_gmm": (lambda a, r, b, g, w: be.gather_gmm(
          a, r, (b,), g, out_dtype=BF16, transpose_rhs=False, row_scale=w,
          interpret=False), (x, rows, rhs, gs, scale)),
      "scatter_gmm": (lambda a, b, g, r, w: be.scatter_gmm(
          (a,), (b,), g, r, w, 100, out_dtype=BF16, transpose_rhs=False,
          interpret=False), (h, rhs, gs, rows, scale)),
      "gather_tgmm": (lambda a, c, g, r, w: be.gather_tgmm(
          a, (c,), g, out_dtype=jnp.float32, lhs_rows=r, grad_rows=None, grad_scale=w,
          interpret=False), (x, grad, gs, rows, scale))}


def lowering(plan: Plan) -> dict:
  del plan
  s = jax.ShapeDtypeStruct
  lhs, gs = s((256, 128), BF16), s((4,), jnp.int32)
  rhs, rhs_t, grad = s((4, 128, 192), BF16), s((4, 192, 128), BF16), s((256, 192), BF16)
  out = {}
  for backend, platform in (("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")):
    be = gmm_lib.get_backend(backend)
    kernels = {
        "gmm": (lambda a, b, g: be.gmm(a, b, g, out_dtype=BF16, transpose_rhs=False,
                                       interpret=False), (lhs, rhs, gs)),
        "gmm_rhs_t": (lambda a, b, g: be.gmm(a, b, g, out_dtype=BF16, transpose_rhs=True,
                                             interpret=False), (lhs, rhs_t, gs)),
        "tgmm": (lambda a, c, g: be.tgmm(a, c, g, out_dtype=jnp.float32, interpret=False),
                 (lhs, grad, gs))}
    gather_fn = (pallas_gather.gather_rows_gpu if backend == "pallas_gpu"
                 else pallas_gather.gather_rows)
    kernels["gather"] = (lambda x, i: gather_fn(x, i), (s((100, 256), BF16),
                                                         s((512,), jnp.int32)))
    kernels.update(_folded_kernels(be))
    for name, (fn, specs) in kernels.items():
      out[f"{backend}/{name}@{platform}"] = guarded(lambda fn=fn, specs=specs: {
          "lowered": "custom_call" in jax.jit(fn).trace(*specs).lower(
              lowering_platforms=(platform,)).as_text()})
  return {"kernels": out, "all_lowered": all(v.get("lowered") for v in out.values())}


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
      tmp = _JSON.value + ".tmp"
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
  app.run(main)
