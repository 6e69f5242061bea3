"""Grouped matmuls with the dispatch permutation folded into their row loads and stores.

Legend: T tokens (rows of the token-side operand), k contraction width, n
output width, G groups (experts), m rows of the grouped layout (M = T * K
token copies sorted by expert, ``permute.sort_by_expert``).

    out[m, n] = gather_gmm(x[T, k], rows int32[m], rhs[G, k, n], group_sizes)
        out[r] = x[rows[r]] @ rhs[g(r)]             (= gmm(permute(x), rhs))
    y[T, n] = scatter_gmm(h[m, k], rhs[G, k, n], group_sizes, rows, w f32[m], T)
        y[t] = sum_{r: rows[r] = t} w[r] * h[r] @ rhs[g(r)]   (= unpermute(gmm(h, rhs)))

Composing permute -> gmm -> unpermute writes an [m, k] copy of x and reads
an [m, n] output back for the combine; here the backend gathers x's rows
inside each tile's load and scatter-adds each tile's output rows (times the
combine weight) into [T, n] in its store (MegaBlocks and tokamax do the
same on GPU). Contract, on top of :mod:`moejax.execution.gmm`'s:

* ``rows[r]`` outside [0, T) is an *absent* row: it gathers a zero row and
  scatters nowhere; so do the rows past ``sum(group_sizes)`` whatever
  ``rows`` says there (the entry points map both to T before the kernel);
* the gathered gmm's rows past the groups are zero; the scatter gmm
  accumulates in float32 and rounds once, to ``preferred_element_type``
  (default ``h.dtype``);
* gradients are folded again (custom VJPs, cotangents in the input dtype,
  float32 accumulation):

  - gather_gmm: dx = scatter_gmm(dout, rhs^T, rows, w=1) (the row gradients
    scatter-added into [T, k]), d_rhs = tgmm over the gathered rows of x;
  - scatter_gmm: with dh_u[r] = dy[rows[r]] @ rhs[g]^T (a gathered gmm),
    dh = w * dh_u, d_w[r] = <h[r], dh_u[r]> (= <h[r] @ rhs[g], dy[rows[r]]>
    at k instead of n width), d_rhs = tgmm(h, w * dy[rows]) with the gather
    in the tile loads.

Only backends whose :attr:`~moejax.execution.gmm.Backend.folds_permute` is
True have these kernels (``blocked``; ``pallas_tpu`` and ``pallas_gpu``, run in
interpret mode and lowered only); for the others (``ragged_dot``) the routed
FFN keeps permute -> gmm -> unpermute.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling


@dataclasses.dataclass(frozen=True)
class _Static(gmm_lib._Static):  # pylint: disable=protected-access
  """gmm's hashable non-array arguments, plus the scatter output's rows."""

  num_out: int = 0  # T: rows of the scatter output

  def kw(self, **over):
    kw = dict(out_dtype=self.out_dtype, transpose_rhs=self.transpose_rhs,
              interpret=self.interpret, **dict(self.options))
    kw.update(over)
    return kw


def folding_backend(name: str, interpret: bool = False) -> gmm_lib.Backend:
  """The backend ``name``, checked to run here and to fold the permutation."""
  be = gmm_lib.check_available(name, interpret)
  if not be.folds_permute:
    folding = [n for n in gmm_lib.backend_names() if gmm_lib.get_backend(n).folds_permute]
    raise gmm_lib.GmmError(name, "has no folded (gather / scatter) grouped matmul",
                           f"use one of {', '.join(folding)}, or compose permute.permute "
                           "-> gmm.gmm -> permute.unpermute")
  return be


def _clean_rows(rows, group_sizes, num_out: int):
  """rows with every absent row (outside [0, T), or past the groups) set to T."""
  r = jnp.arange(rows.shape[0], dtype=jnp.int32)
  live = (rows >= 0) & (rows < num_out) & (r < jnp.sum(group_sizes))
  return jnp.where(live, rows, num_out).astype(jnp.int32)


def _d_rhs(be, st, a, a_rows, b: tuple, b_rows, b_scale, group_sizes, dtypes) -> tuple:
  """Per-group a(r)^T b_i(r), [G, k, n_i] each; [G, n_i, k] (swapped) for a
  transposed rhs."""
  kw = dict(interpret=st.interpret, **dict(st.options))
  outs = be.gather_tgmm(a, b, group_sizes, lhs_rows=a_rows, grad_rows=b_rows,
                        grad_scale=b_scale, out_dtype=jnp.float32, **kw)
  nonempty = (group_sizes > 0)[:, None, None]
  outs = [jnp.where(nonempty, o, 0).astype(dt) for o, dt in zip(outs, dtypes)]
  return tuple(jnp.swapaxes(o, 1, 2) if st.transpose_rhs else o for o in outs)


# --- The gathered gmm. -------------------------------------------------------

def _gather_impl(st, x, rows, rhs: tuple, group_sizes) -> tuple:
  be = gmm_lib.get_backend(st.backend)
  outs = be.gather_gmm(x, rows, rhs, group_sizes, row_scale=None, **st.kw())
  return tuple(jnp.where((rows < x.shape[0])[:, None], o, 0) for o in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_vjp(st, x, rows, rhs, group_sizes):
  return _gather_impl(st, x, rows, rhs, group_sizes)


def _gather_fwd(st, x, rows, rhs, group_sizes):
  return _gather_impl(st, x, rows, rhs, group_sizes), (x, rows, rhs, group_sizes)


def _gather_bwd(st, res, dout):
  x, rows, rhs, group_sizes = res
  be = gmm_lib.get_backend(st.backend)
  dout = tuple(d.astype(x.dtype) for d in dout)
  # dx[t] = sum_{r: rows[r] = t} sum_i dout_i[r] @ rhs_i[g]^T: one scatter gmm, weight 1.
  dx = be.scatter_gmm(dout, rhs, group_sizes, rows, None, x.shape[0],
                      **st.kw(out_dtype=x.dtype, transpose_rhs=not st.transpose_rhs))
  # d_rhs_i[g] = x[rows_g]^T dout_i,g (x's tile gathered once for every i).
  d_rhs = _d_rhs(be, st, x, rows, dout, None, None, group_sizes, [r.dtype for r in rhs])
  return dx, None, d_rhs, None


_gather_vjp.defvjp(_gather_fwd, _gather_bwd)


# --- The scatter gmm. --------------------------------------------------------

def _scatter_impl(st, h, rhs, group_sizes, rows, w):
  be = gmm_lib.get_backend(st.backend)
  return be.scatter_gmm((h,), (rhs,), group_sizes, rows, w.astype(jnp.float32), st.num_out,
                        **st.kw())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter_vjp(st, h, rhs, group_sizes, rows, w):
  return _scatter_impl(st, h, rhs, group_sizes, rows, w)


def _scatter_fwd(st, h, rhs, group_sizes, rows, w):
  return _scatter_impl(st, h, rhs, group_sizes, rows, w), (h, rhs, group_sizes, rows, w)


def _scatter_bwd(st, res, dy):
  h, rhs, group_sizes, rows, w = res
  be = gmm_lib.get_backend(st.backend)
  dy = dy.astype(h.dtype)
  # dh_u[r] = dy[rows[r]] @ rhs[g]^T (the gather folded into the loads), in
  # float32 so that the weight gradient <h, dh_u> is not rounded first.
  dh_u, = be.gather_gmm(dy, rows, (rhs,), group_sizes, row_scale=None,
                        **st.kw(out_dtype=jnp.float32, transpose_rhs=not st.transpose_rhs))
  dh_u = jnp.where((rows < st.num_out)[:, None], dh_u, 0)
  d_w = jnp.sum(h.astype(jnp.float32) * dh_u, axis=1)
  dh = (dh_u * w.astype(jnp.float32)[:, None]).astype(h.dtype)
  # d_rhs[g] = h_g^T (w dy[rows_g]), the gather and the weight in the tile loads.
  d_rhs, = _d_rhs(be, st, h, None, (dy,), rows, w.astype(jnp.float32), group_sizes,
                  [rhs.dtype])
  return dh, d_rhs, None, None, d_w.astype(w.dtype)


_scatter_vjp.defvjp(_scatter_fwd, _scatter_bwd)


# --- Entry points. -----------------------------------------------------------

def _check(name, width: int, dtype, rhs, group_sizes, rows, transpose_rhs) -> None:
  """gmm's operand checks for a layout of len(rows) rows of ``width`` columns."""
  if rows.ndim != 1 or rows.dtype != jnp.int32:
    raise gmm_lib.GmmError(name, f"rows must be int32[m], got {rows.dtype}{list(rows.shape)}",
                           "pass the layout's src_token (permute.sort_by_expert)")
  layout = jax.ShapeDtypeStruct((rows.shape[0], width), dtype)  # the [m, k] never built
  gmm_lib._check_operands(name, layout, rhs, group_sizes, transpose_rhs)
  if rhs.ndim != 3:
    raise gmm_lib.GmmError(name, f"rhs must be 3-D [G, k, n], got shape {rhs.shape}",
                           "stack the per-group matrices on a leading axis")
  k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if width != k_rhs:
    raise gmm_lib.GmmError(name, f"contraction mismatch: lhs width {width} vs rhs "
                           f"{rhs.shape}" + (" (transpose_rhs)" if transpose_rhs else ""),
                           "the lhs width must equal rhs.shape[1] (rhs.shape[2] when "
                           "transposed)")
  if rhs.shape[0] != group_sizes.shape[0]:
    raise gmm_lib.GmmError(name, f"rhs has {rhs.shape[0]} groups but group_sizes has "
                           f"{group_sizes.shape[0]}", "give one size per rhs group")


def gather_gmm(x: jax.Array, rows: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               backend: str = gmm_lib.DEFAULT_BACKEND, preferred_element_type=None,
               transpose_rhs: bool = False, interpret: bool = False,
               **options) -> jax.Array:
  """out[m, n] = gmm(x[rows], rhs, group_sizes) without materialising x[rows].

  Args:
    x: [T, k] token rows.
    rows: int32[m] the token of each layout row (``Dispatch.src_token``);
      out of [0, T): a zero row.
    rhs: [G, k, n] (or [G, n, k] with ``transpose_rhs``), or a tuple of them
      (one [m, n_i] output each; a tile's rows are gathered once for all,
      so gate and up share one gather, forward and backward).
    group_sizes: int32[G] layout rows per group, summing to at most m.
    backend: a backend whose ``folds_permute`` is True.
    preferred_element_type, transpose_rhs, interpret, **options: as
      :func:`moejax.execution.gmm.gmm`.
  """
  be = folding_backend(backend, interpret)
  if x.ndim != 2:
    raise gmm_lib.GmmError(backend, f"x must be 2-D [T, k], got shape {x.shape}",
                           "flatten the tokens to [T, k]")
  several = isinstance(rhs, (tuple, list))
  rhs = tuple(rhs) if several else (rhs,)
  if not rhs:
    raise gmm_lib.GmmError(backend, "rhs is an empty tuple", "pass at least one [G, k, n]")
  for r in rhs:
    _check(backend, x.shape[1], x.dtype, r, group_sizes, rows, transpose_rhs)
  group_sizes = tiling.clamp_group_sizes(group_sizes, rows.shape[0])
  st = _Static(be.name, jnp.dtype(preferred_element_type or x.dtype), transpose_rhs,
               bool(interpret), tuple(sorted(options.items())))
  outs = _gather_vjp(st, x, _clean_rows(rows, group_sizes, x.shape[0]), rhs, group_sizes)
  return outs if several else outs[0]


def scatter_gmm(h: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rows: jax.Array,
                weights: jax.Array, num_out: int, *, backend: str = gmm_lib.DEFAULT_BACKEND,
                preferred_element_type=None, transpose_rhs: bool = False,
                interpret: bool = False, **options) -> jax.Array:
  """y[T, n] with y[rows[r]] += weights[r] * (h[r] @ rhs[g(r)]); the combine in the stores.

  Args:
    h: [m, k] layout rows sorted by group.
    rhs: [G, k, n] (or [G, n, k] with ``transpose_rhs``).
    group_sizes: int32[G], summing to at most m.
    rows: int32[m] output row of each layout row; out of [0, T): dropped.
    weights: [m] float per-row combine weight (differentiable).
    num_out: T, the rows of the output.
    backend, preferred_element_type (default h.dtype), transpose_rhs,
      interpret, **options: as :func:`moejax.execution.gmm.gmm`.
  """
  be = folding_backend(backend, interpret)
  if h.ndim != 2 or h.shape[0] != rows.shape[0]:
    raise gmm_lib.GmmError(backend, f"h must be [m={rows.shape[0]}, k], got {h.shape}",
                           "pass one row per entry of rows")
  _check(backend, h.shape[1], h.dtype, rhs, group_sizes, rows, transpose_rhs)
  if weights.shape != rows.shape or weights.dtype not in gmm_lib.FLOAT_DTYPES:
    raise gmm_lib.GmmError(backend, f"weights must be float[m={rows.shape[0]}], got "
                           f"{weights.dtype}{list(weights.shape)}",
                           "pass one combine weight per layout row")
  if int(num_out) < 0:
    raise gmm_lib.GmmError(backend, f"num_out={num_out} must be >= 0", "pass T")
  group_sizes = tiling.clamp_group_sizes(group_sizes, h.shape[0])
  st = _Static(be.name, jnp.dtype(preferred_element_type or h.dtype), transpose_rhs,
               bool(interpret), tuple(sorted(options.items())), num_out=int(num_out))
  return _scatter_vjp(st, h, rhs, group_sizes, _clean_rows(rows, group_sizes, st.num_out),
                      weights)
