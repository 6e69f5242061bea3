"""``pallas_gpu``: grouped matmul kernels for Hopper GPUs (Pallas Mosaic GPU).

Legend: m rows (ragged, sorted by group), k contraction width, n output
width, G groups; (bm, bk, bn) the tile.

Written with ``plgpu.kernel`` (``pl.pallas_call`` for Mosaic GPU is
deprecated since jax 0.10) in warpgroup lowering semantics, after JAX's
own Hopper ragged dot (jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py):

* ``gmm``: a persistent loop over (row tile, n tile) pairs, where the row
  tiles are laid on a fixed bm grid and a tile that straddles groups is
  visited once per group (at most m / bm + G - 1 row visits). Each visit
  pipelines (bm, bk) lhs and (bk, bn) rhs[g] blocks through shared memory
  with TMA (``emit_pipeline``) into a wgmma f32 accumulator, then stores only
  the group's own rows with a ladder of power-of-two TMA stores.
* ``tgmm``: one (bk, bn) output tile of one group per visit; pipelines the
  group's row blocks of lhs^T and grad, zeroing the rows of neighbouring
  groups in the first and last block (shared-memory rewrite), wgmma
  accumulate, one TMA store.

Interpretability switch. ``interpret=True`` runs the same kernels through
the Mosaic GPU interpreter (``InterpretGPUParams``: simulated SMEM, TMA,
barriers and wgmma) on any platform; that is how the shared test suite
checks them on CPU. Two Hopper-only forms the interpreter lacks sit behind
``interpret``: a transposed shared-memory view (``transpose_ref``) for
``transpose_rhs`` and the WGMMA layout cast of the masking iota. In
interpret mode rhs^T is materialised by XLA instead; the kernel code is
otherwise the same. **No GPU was available when this was written: only the
interpret path has been run.** On hardware only 16-bit operands (bf16, f16)
are accepted (wgmma has no plain f32 path).

The folded kernels of this backend (``gather_gmm``, ``scatter_gmm``,
``gather_tgmm``: the dispatch gather / combine scatter inside the row loads
and stores) are Pallas **Triton** kernels in :mod:`moejax.execution.
pallas_gpu_folded` (pointer-array row gathers, atomic scatter-adds; f32
operands accepted); ``routed_ffn`` takes that folded path for this backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from moejax.execution import gmm as gmm_lib
from moejax.execution import pallas_gpu_folded as folded

try:  # jax >= 0.10 ships Mosaic GPU; import lazily-safe for odd builds.
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

DEFAULT_TILING = (128, 64, 128)  # (bm, bk, bn)
MAX_CONCURRENT_STEPS = 4
INTERPRET_SMS = 2  # simulated SMs in interpret mode (each one is a thread)


def _interpret_params():
  """The Mosaic GPU interpreter's params class (public in newer jax)."""
  for mod, name in ((plgpu, "InterpretParams"), (plgpu, "InterpretGPUParams")):
    if mod is not None and hasattr(mod, name):
      return getattr(mod, name)()
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _num_sms() -> int:
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 132)


def _availability():
  if plgpu is None:
    return "this jax build has no Mosaic GPU (jax.experimental.pallas.mosaic_gpu)"
  if jax.default_backend() != "gpu":
    return f"this platform is {jax.default_backend()!r}"
  cc = getattr(jax.devices()[0], "compute_capability", "0")
  if float(cc) < 9.0:
    return f"the GPU has compute capability {cc} (Hopper 9.0+ needed for wgmma)"
  return None


def _pad_to(a, axis: int, multiple: int):
  size = a.shape[axis]
  target = -(-size // multiple) * multiple
  if target == size:
    return a
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, target - size)
  return jnp.pad(a, pad)


def _group_visit(group_sizes_ref, num_groups: int, bm: int, visit):
  """Group, row block and own-row range of row visit ``visit``.

  Visits enumerate, group by group, the bm-blocks each group touches; the
  loop over groups is unrolled (G is small) with selects, as in JAX's
  ragged_dot_mgpu.
  """
  zero = jnp.int32(0)
  end = block = group = g_start = g_end = zero
  tile = jnp.int32(bm)
  for i in range(num_groups):
    start = end
    end = start + group_sizes_ref[i]
    first_block = lax.div(start, tile)
    last_block = lax.div(jnp.maximum(end - 1, start), tile)
    begin = first_block + i
    stop = jnp.where(end > start, last_block + 1 + i, begin)  # empty: no visit
    hit = (begin <= visit) & (visit < stop)
    block = lax.select(hit, visit - begin + first_block, block)
    group = lax.select(hit, jnp.int32(i), group)
    g_start = lax.select(hit, start, g_start)
    g_end = lax.select(hit, end, g_end)
  block_start = block * bm
  own_start = jnp.maximum(g_start, block_start)
  own_end = jnp.minimum(g_end, block_start + bm)
  return group, block, block_start, own_start - block_start, jnp.maximum(own_end - own_start, 0)


def _kernel_params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _gmm_call(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, interpret, tiling):
  bm, bk, bn = tiling
  m, k = lhs.shape
  num_groups = group_sizes.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  grid_m = m // bm + num_groups - 1
  grid_n = n // bn
  steps = max(1, min(MAX_CONCURRENT_STEPS, k // bk))

  def body(gs_gmem, lhs_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _(info):
      mi = lax.div(info.index[0], jnp.int32(grid_n))
      ni = lax.rem(info.index[0], jnp.int32(grid_n))
      g, block, block_start, own_off, own_rows = _group_visit(gs_gmem, num_groups, bm, mi)

      def acc_scope(acc_ref):
        def step(_, lhs_smem, rhs_smem):
          rhs_view = plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem
          plgpu.wgmma(acc_ref, lhs_smem, rhs_view)

        rhs_block = (bn, bk) if transpose_rhs else (bk, bn)
        plgpu.emit_pipeline(
            step, grid=(k // bk,),
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (block, kk),
                                delay_release=1 if steps > 1 else 0),
                plgpu.BlockSpec(rhs_block,
                                (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                delay_release=1 if steps > 1 else 0),
            ],
            max_concurrent_steps=steps,
        )(lhs_gmem, rhs_gmem.at[g])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        # TMA stores need static row counts: store the group's own rows with
        # a ladder of power-of-two copies (bm, bm/2, ..., 1).
        start = own_off
        size = bm
        while size >= 1:
          @pl.when((own_rows & size) != 0)
          def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(start, size)],
                o_gmem.at[pl.ds(block_start + start, size), pl.ds(ni * bn, bn)])
          start = start + (own_rows & size)
          size //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(INTERPRET_SMS if interpret else _num_sms(),), grid_names=("sm",),
      compiler_params=_kernel_params(),
      **({"interpret": _interpret_params()} if interpret else {}))
  return kernel(group_sizes, lhs, rhs)


def gpu_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False,
            interpret=False, tiling=None):
  """out[m, n] per group; rows past the groups are left for the caller."""
  bm, bk, bn = tiling or DEFAULT_TILING
  _check_hw_dtype(lhs, interpret)
  m, n = lhs.shape[0], (rhs.shape[1] if transpose_rhs else rhs.shape[2])
  if transpose_rhs and interpret:
    # The interpreter has no transposed SMEM view: materialise rhs^T.
    rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
  lhs = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
  rhs = _pad_to(_pad_to(rhs, 1, bn if transpose_rhs else bk), 2, bk if transpose_rhs else bn)
  out = _gmm_call(lhs, rhs, group_sizes, out_dtype=out_dtype,
                  transpose_rhs=transpose_rhs, interpret=interpret, tiling=(bm, bk, bn))
  return out[:m, :n]


def _tgmm_call(lhs_t, grad, group_sizes, *, out_dtype, interpret, tiling):
  """out[G, k, n] from lhs_t[k, m] (rows of k, ragged columns) and grad[m, n]."""
  bm, bk, bn = tiling  # bm: ragged block, bk x bn: output tile
  k, m = lhs_t.shape
  n = grad.shape[1]
  num_groups = group_sizes.shape[0]
  grid_k, grid_n = k // bk, n // bn
  ends = jnp.cumsum(group_sizes).astype(jnp.int32)
  starts = ends - group_sizes
  first_block = starts // bm
  num_blocks = jnp.where(group_sizes > 0, (ends + bm - 1) // bm - first_block, 0)
  steps = MAX_CONCURRENT_STEPS

  def body(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, grad_gmem, o_gmem):
    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
    def _(info):
      g = info.index[0]
      ki = lax.div(info.index[1], jnp.int32(grid_n))
      ni = lax.rem(info.index[1], jnp.int32(grid_n))
      g_start, g_end = starts_gmem[g], ends_gmem[g]
      block0 = first_gmem[g]
      nblocks = nblocks_gmem[g]

      def acc_scope(acc_ref):
        def step(idx, a_smem, b_smem):
          r0 = (block0 + idx[0]) * bm

          @pl.when((r0 < g_start) | (r0 + bm > g_end))
          def _():
            # Boundary block: zero the grad rows owned by other groups.
            rows = lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
            if not interpret:
              rows = plgpu.layout_cast(rows, plgpu.Layout.WGMMA)
            keep = ((rows + r0 >= g_start) & (rows + r0 < g_end)).astype(b_smem.dtype)
            b_smem[...] = b_smem[...] * keep
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, a_smem, b_smem)
          plgpu.wgmma_wait(0)

        @pl.when(nblocks > 0)
        def _():
          plgpu.emit_pipeline(
              step, grid=(nblocks,),
              in_specs=[plgpu.BlockSpec((bk, bm), lambda r: (ki, r)),
                        plgpu.BlockSpec((bm, bn), lambda r: (r, ni))],
              max_concurrent_steps=steps,
          )(lhs_gmem.at[:, pl.ds(block0 * bm, m)], grad_gmem.at[pl.ds(block0 * bm, m), :])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bk, bn), dtype=o_gmem.dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  # The pipelined slices start at the group's first block and span m rows;
  # pad so that window never leaves the (padded) operand.
  lhs_t = _pad_to(lhs_t, 1, 2 * m)
  grad = _pad_to(grad, 0, 2 * m)
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid=(INTERPRET_SMS if interpret else _num_sms(),), grid_names=("sm",),
      compiler_params=_kernel_params(),
      **({"interpret": _interpret_params()} if interpret else {}))
  return kernel(starts, ends, first_block, num_blocks, lhs_t, grad)


def gpu_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret=False, tiling=None):
  """out[G, k, n] = lhs_g^T grad_g; empty groups are left for the caller."""
  bm, bk, bn = tiling or DEFAULT_TILING
  _check_hw_dtype(lhs, interpret)
  m, k = lhs.shape
  n = grad.shape[1]
  lhs_t = _pad_to(_pad_to(lhs, 0, bm), 1, bk).T  # [k, m]: ragged axis minor
  grad = _pad_to(_pad_to(grad, 0, bm), 1, bn)
  out = _tgmm_call(lhs_t, grad, group_sizes, out_dtype=out_dtype,
                   interpret=interpret, tiling=(bm, bk, bn))
  return out[:, :k, :n]


def _check_hw_dtype(lhs, interpret):
  if not interpret and lhs.dtype not in (jnp.bfloat16, jnp.float16):
    raise gmm_lib.GmmError(
        "pallas_gpu", f"operands are {lhs.dtype}; Hopper wgmma takes 16-bit operands",
        "cast lhs and rhs to bfloat16 (accumulation stays float32)")


BACKEND = gmm_lib.Backend(
    name="pallas_gpu", gmm=gpu_gmm, tgmm=gpu_tgmm, platforms=("gpu",),
    interpretable=plgpu is not None, availability=_availability,
    needs="an NVIDIA Hopper GPU (Pallas Mosaic GPU: TMA + wgmma)",
    # Not auto's choice anywhere yet: on a Hopper GPU its device check passes
    # gmm_correctness but not gmm_timing's target (docs/benchmarks.md). Add
    # "gpu" once `python -m experiments.device_check` reports the target met.
    auto_on=(),
    # The dispatch folded into the row loads / stores: Pallas Triton kernels
    # (pointer-array row gathers, atomic scatter-add), not Mosaic GPU; they
    # also take f32 operands on hardware (pallas_gpu_folded.py says why).
    gather_gmm=folded.gpu_gather_gmm, scatter_gmm=folded.gpu_scatter_gmm,
    gather_tgmm=folded.gpu_gather_tgmm)

gmm_lib.register_backend(BACKEND)
