"""The grouped matmul on the device: the kernels against ragged_dot, and their timings."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import lib as bench_lib
from experiments.device_checks.common import BF16, Plan, guarded
from moejax.execution import gmm as gmm_lib


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
