"""The token gather on the device, and every Pallas kernel lowered for both platforms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import lib as bench_lib
from experiments.device_checks.common import BF16, Plan, guarded
from moejax.execution import gmm as gmm_lib
from moejax.execution import pallas_gather
from moejax.execution import permute as permute_lib


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
