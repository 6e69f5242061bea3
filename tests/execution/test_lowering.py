"""The accelerator kernels lower for their platforms on this CPU machine.

``jax.jit(...).trace(...).lower(lowering_platforms=...)`` runs the Pallas
Mosaic GPU / Triton / Mosaic TPU lowerings without the device: a kernel that
uses a construct its real lowering rejects (unlike the interpreter, which
runs almost anything) fails here, before anyone has an H200 or a TPU.
"""

import jax
import jax.numpy as jnp
import pytest

from moejax.execution import gmm as gmm_lib
from moejax.execution import pallas_gather

S = jax.ShapeDtypeStruct
M, K, N, G = 256, 128, 192, 4
LHS, GS = S((M, K), jnp.bfloat16), S((G,), jnp.int32)
RHS, RHS_T, GRAD = S((G, K, N), jnp.bfloat16), S((G, N, K), jnp.bfloat16), S((M, N), jnp.bfloat16)


def _lower(fn, platform, *specs) -> str:
  return jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("backend,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
def test_gmm_kernels_lower(backend, platform):
  be = gmm_lib.get_backend(backend)
  kw = dict(interpret=False)
  # The three kernels of a forward + backward: gmm, gmm with rhs^T (d_lhs), tgmm (d_rhs).
  for fn, specs in (
      (lambda a, b, s: be.gmm(a, b, s, out_dtype=jnp.bfloat16, transpose_rhs=False, **kw),
       (LHS, RHS, GS)),
      (lambda a, b, s: be.gmm(a, b, s, out_dtype=jnp.bfloat16, transpose_rhs=True, **kw),
       (LHS, RHS_T, GS)),
      (lambda a, g, s: be.tgmm(a, g, s, out_dtype=jnp.float32, **kw), (LHS, GRAD, GS))):
    text = _lower(fn, platform, *specs)
    assert "custom_call" in text  # the kernel, not an XLA fallback


@pytest.mark.parametrize("fn,platform", [(pallas_gather.gather_rows_gpu, "cuda"),
                                         (pallas_gather.gather_rows, "tpu")])
def test_gathers_lower(fn, platform):
  text = _lower(lambda x, i: fn(x, i), platform, S((100, 256), jnp.bfloat16),
                S((512,), jnp.int32))
  assert "custom_call" in text
