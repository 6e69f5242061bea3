r"""``--suite=gmm``: the grouped matmul alone.

  python -m experiments.bench --suite=gmm --json_out=/tmp/gmm.json \
      --gmm_m=8192 --gmm_k=512 --gmm_n=384        # CPU-sized
  python -m experiments.bench --suite=gmm         # GPU: m=65536 k=2048 n=1408

Times the grouped matmul (uneven groups, ``--gmm_dtype``) for every native
backend and a dense [m, k] x [k, n] matmul of the same FLOPs, and reports
TFLOP/s (2 m k n / time for all of them, so ragged_dot's extra masked work on
CPU shows as a low rate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import record_blocks
from experiments.benchmarks import common
from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry
from moejax.execution import gmm as gmm_lib

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


def _fns(backends, lhs, rhs, sizes, dt) -> dict:
  dense_rhs = rhs[0]
  fns = {"dense": lambda f=jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                                   .astype(dt)): f(lhs, dense_rhs)}
  for name in backends:
    f = jax.jit(lambda a, b, s, name=name: gmm_lib.gmm(a, b, s, backend=name))
    fns[name] = (bench_lib.memory_checked(f, (lhs, rhs, sizes), f"{name} (its dense CPU "
                                          "fallback)")
                 if name == "ragged_dot" and jax.default_backend() == "cpu"
                 else lambda f=f: f(lhs, rhs, sizes))
  return fns


def gmm_suite() -> dict:
  conditions = bench_lib.conditions()
  run, skipped = bench_lib.native_backends()
  backends = _GMM_BACKENDS.value or run
  m, k, n, g = _GMM_M.value, _GMM_K.value, _GMM_N.value, _GMM_G.value
  dt = jnp.dtype(_GMM_DTYPE.value)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(common.SEED.value), 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dt)
  rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k ** -0.5).astype(dt)
  sizes = bench_lib.uneven_group_sizes(k3, m, g)
  fns = _fns(backends, lhs, rhs, sizes, dt)
  timed = bench_lib.time_round_robin(common.forced_failures(fns), common.repeats(),
                                     common.SLOW_S.value, common.SLOW_REPEATS.value)
  failed = {n: r for n, r in timed.items() if "median_s" not in r}  # rows saying why
  timed = {n: r for n, r in timed.items() if "median_s" in r}
  if _GMM_CHECK.value and "ragged_dot" not in failed:  # the reference: refused, no check
    checked = bench_lib.check_against_ragged_dot(lhs, rhs, sizes, list(timed)[1:])
    for name, err in checked.items():
      timed[name]["max_rel_err_vs_ragged_dot"] = err
  flops = 2 * m * k * n
  dense_s = timed["dense"]["median_s"] if "dense" in timed else float("nan")
  for name, r in timed.items():
    r["tflops"] = flops / r["median_s"] / 1e12
    r["fraction_of_dense"] = dense_s / r["median_s"]
  return {"conditions": conditions, "m": m, "k": k, "n": n, "groups": g,
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
    err_s = record_blocks.rel_errors(err) if err else ""
    print(f"{name:<14}{r['median_s']:>12.5f}{r['tflops']:>10.3f}{r['fraction_of_dense']:>9.2f}"
          f"  {err_s}")
  for name, r in res.get("failed", {}).items():
    print(f"{name:<14}{'failed' if 'error' in r else 'refused'}: "
          f"{r.get('error') or r.get('refused')}")
  for name, why in res["skipped"].items():
    print(f"{name:<14}skipped: {why}")


SUITE = registry.register(registry.Suite(
    "gmm", "the grouped matmul alone on uneven groups, in TFLOP/s", gmm_suite, print_gmm_table))
