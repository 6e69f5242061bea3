"""Grouped matrix multiplication: one entry point, backends chosen by name.

Legend: m rows of lhs (token copies sorted by expert), k contraction width,
n output width, G groups (experts).

    out[m, n] = gmm(lhs[m, k], rhs[G, k, n], group_sizes int32[G], backend=...)

Group g owns the contiguous lhs rows ``[sum(group_sizes[:g]),
sum(group_sizes[:g+1]))`` and multiplies them by ``rhs[g]``. Contract kept by
every backend:

* rows past ``sum(group_sizes)`` are **zero** in the output (megablox leaves
  them uninitialised; we mask them so callers never see garbage);
* a sum past m is an error when ``group_sizes`` is concrete; under ``jit`` it
  cannot raise, so the groups are truncated at row m (see
  :func:`moejax.execution.tiling.clamp_group_sizes`);
* the matmul accumulates in float32; the output dtype is
  ``preferred_element_type`` (default ``lhs.dtype``);
* gradients: d_lhs = gmm(grad, rhs^T), d_rhs = tgmm(lhs^T, grad). Backends
  other than ``ragged_dot`` implement both with their own kernels under one
  ``jax.custom_vjp``; the cotangent enters those kernels in the input dtype
  (bf16 in, bf16 cotangent, f32 accumulation), as megablox does.

``tgmm(lhs[m, k], grad[m, n], group_sizes) -> [G, k, n]`` is exposed too
(per-group lhs^T @ grad; empty groups give zeros).

Backends (``BACKENDS``):

=============  ==============================================================
``ragged_dot`` ``jax.lax.ragged_dot``: the reference. On CPU it lowers to a
               dense masked matmul over all G groups (G times the FLOPs).
``blocked``    Portable XLA, the fast CPU path (``gmm``'s default, ``auto``'s
               choice on CPU): a loop over
               row tiles that start at group boundaries, one dense
               [tm, k] x [k, n] matmul per tile. Dropless and exact.
``pallas_tpu`` Megablox-style Pallas TPU kernels (scalar-prefetched group
               metadata, f32 accumulator); ``interpret=True`` on other
               platforms.
``pallas_gpu`` Pallas Mosaic GPU kernels (Hopper: TMA + wgmma);
               ``interpret=True`` on other platforms (Mosaic GPU
               interpreter).
=============  ==============================================================

and ``whole_group``: one batched matmul over [G, C] slots, C the smallest
capacity bucket holding the largest group, else the ``blocked`` loop
(:mod:`moejax.execution.whole_group`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import AUTO_BACKEND, check_choice
from moejax.config import registry as config_registry
from moejax.execution import registry, tiling

# The names live in moejax.config.registry (importable without JAX, for
# config validation), re-exported by moejax.execution.registry.
BACKENDS = registry.GMM_BACKENDS
DEFAULT_BACKEND = registry.DEFAULT_GMM_BACKEND

# The registry of Backend objects (moejax.config.registry.GMM_KERNELS): reading
# it imports the shipped backends' modules, each of which registers its BACKEND.
KERNELS = config_registry.GMM_KERNELS


def register_backend(backend: "Backend") -> "Backend":
  """Registers a grouped-matmul backend under ``backend.name``: a kernel of your own is
  one module that builds a :class:`Backend` and calls this; configs then name it in
  ``moe.execution.backend``. Returns ``backend``."""
  if not isinstance(backend, Backend):
    raise config_registry.RegistryError(
        f"register_backend takes a moejax.execution.gmm.Backend, got {type(backend).__name__}. "
        "Fix: wrap your kernels in Backend(name=..., gmm=..., tgmm=...)")
  # A Backend's class is this module's: the idea comes from where its kernels are defined.
  return KERNELS.register(backend, module=getattr(backend.gmm, "__module__", "") or "")


def backend_names() -> tuple:
  """Every registered backend: the shipped ones (``BACKENDS``' order), then plugins."""
  return config_registry.gmm_backend_names()


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class GmmError(ValueError):
  """Bad input for a grouped-matmul backend; names the backend and the fix."""

  def __init__(self, backend: str, problem: str, fix: str):
    self.backend = backend
    super().__init__(f"gmm backend {backend!r}: {problem}. Fix: {fix}")


@dataclasses.dataclass(frozen=True)
class Backend:
  """One grouped-matmul implementation.

  Attributes:
    name: registry name.
    gmm: (lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, interpret,
      **options) -> [m, n]; rows past the groups may hold anything (the entry
      point masks them). ``transpose_rhs`` means rhs is [G, n, k].
    tgmm: (lhs, grad, group_sizes, *, out_dtype, interpret, **options)
      -> [G, k, n]; groups without rows may hold anything (masked too).
    platforms: platforms where it compiles natively; () means all.
    interpretable: whether interpret=True runs it elsewhere.
    needs: one line on what it requires, for error messages.
    custom_vjp: False for the reference, whose gradient is JAX's own.
    auto_on: platforms (``jax.default_backend()`` names) where
      ``backend='auto'`` picks it: measured fastest there and checked
      correct on that hardware (:func:`resolve_backend`); ``("*",)`` is the
      fallback for every platform.

  Folding the permutation into the row loads and stores (optional; all
  three or none, see :attr:`folds_permute` and
  :mod:`moejax.execution.folded_gmm`). Legend: T rows of the token-side
  operand, m = len(rows) rows of the grouped layout. ``rows`` reaches them
  already cleaned by the entry point: every entry in [0, T], T (out of
  range) for rows past the groups and for out-of-range requests, so a
  kernel gathers zeros and scatters nothing there without checking.

    gather_gmm: (x[T, k], rows int32[m], rhs tuple of [G, k, n_i],
      group_sizes, *, out_dtype, transpose_rhs, row_scale: f32[m] or None,
      interpret, **options) -> tuple of [m, n_i], out_i[r] = scale[r] *
      x[rows[r]] @ rhs_i[g(r)]: the lhs rows are gathered in the tile loads
      (no [m, k] copy of x), once for all rhs_i; rows past the groups may
      hold anything (masked).
    scatter_gmm: (h tuple of [m, k_i], rhs tuple of [G, k_i, n],
      group_sizes, rows int32[m], row_scale f32[m] or None, num_out T, *,
      out_dtype, transpose_rhs, interpret, **options) -> [T, n],
      y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)], accumulated in
      float32 and scatter-added in the tile stores; rows mapped to T add
      nothing.
    gather_tgmm: (lhs, grad tuple, group_sizes, *, lhs_rows, grad_rows,
      grad_scale, out_dtype, interpret, **options) -> tuple of [G, k, n_i],
      per group sum_r lhs(r)^T grad_i(r) where lhs(r) = lhs[lhs_rows[r]]
      when lhs_rows is given (lhs [T, k]) else lhs[r] (lhs [m, k]), the same
      for the grads, each scaled by grad_scale[r]; empty groups may hold
      anything.
    fused_ffn: (params, x[T, d], weights f32[T, K], plan, *, activation,
      **options) -> [T, d]: the whole routed FFN in one loop (the
      ``blocked`` backend's :func:`moejax.execution.fused.blocked_ffn`);
      ``routed_ffn(fused=True)`` uses it when present.
    auto_large_groups: (platform, backend, rows) triples: when ``auto``
      resolves to this backend on ``platform`` (or on any, ``ANY_PLATFORM``),
      calls whose balanced group (token copies / experts) has at least
      ``rows`` rows run ``backend`` instead: the shape rule the resolved
      config records (:mod:`moejax.execution.shape_choice`;
      :meth:`large_groups_on`).
  """

  name: str
  gmm: Callable[..., jax.Array]
  tgmm: Callable[..., jax.Array]
  platforms: tuple = ()
  interpretable: bool = False
  needs: str = ""
  custom_vjp: bool = True
  availability: Optional[Callable[[], Optional[str]]] = None
  auto_on: tuple = ()
  gather_gmm: Optional[Callable[..., jax.Array]] = None
  scatter_gmm: Optional[Callable[..., jax.Array]] = None
  gather_tgmm: Optional[Callable[..., jax.Array]] = None
  fused_ffn: Optional[Callable[..., jax.Array]] = None
  auto_large_groups: tuple = ()

  def large_groups_on(self, platform: str) -> tuple:
    """(backend, rows) of this backend's shape rule on ``platform``, or ()."""
    for where, backend, rows in self.auto_large_groups:
      if where in (platform, ANY_PLATFORM):
        return (backend, rows)
    return ()

  @property
  def folds_permute(self) -> bool:
    """Whether the gather / scatter of the dispatch fold into this backend's
    row loads and stores (every one of the three folded kernels is set)."""
    return None not in (self.gather_gmm, self.scatter_gmm, self.gather_tgmm)


# What backend='auto' tries, first to last: the first whose ``auto_on`` names
# the platform wins. The platform kernels come first (fastest where verified),
# ``ragged_dot`` last: it runs everywhere (``auto_on=("*",)``).
AUTO_ORDER = ("pallas_gpu", "pallas_tpu", "blocked", "ragged_dot")
ANY_PLATFORM = "*"


def resolve_backend(name: str, platform: Optional[str] = None) -> str:
  """The backend ``name`` means on ``platform`` (default: JAX's): ``auto`` resolved.

  ``auto`` becomes the first backend of :data:`AUTO_ORDER` whose
  ``auto_on`` lists ``platform`` (``blocked`` on ``cpu``; ``ragged_dot`` on
  any other platform until a kernel is verified there) and, on the platform
  JAX runs on, whose ``availability`` does not object (a pre-Hopper GPU for
  ``pallas_gpu``); every other valid name (``reference`` included) is
  returned as it is. A bad name is a ConfigError on ``moe.execution.backend``
  listing the valid ones.
  """
  check_choice("moe.execution.backend", name, config_registry.expert_backend_names())
  if name != AUTO_BACKEND:
    return name
  platform = jax.default_backend() if platform is None else platform
  for candidate in AUTO_ORDER:
    be = get_backend(candidate)
    if platform not in be.auto_on and ANY_PLATFORM not in be.auto_on:
      continue
    here = be.availability is not None and platform == jax.default_backend()
    if not (here and be.availability()):
      return candidate
  raise AssertionError(f"no backend in {AUTO_ORDER} has auto_on={ANY_PLATFORM!r}")


def get_backend(name: str) -> Backend:
  """The registered backend called ``name``; a clear error otherwise."""
  names = backend_names()
  if name not in names:
    close = difflib.get_close_matches(str(name), names, n=1)
    fix = f"use one of {', '.join(names)}, or register yours (gmm.register_backend)"
    if close:
      fix = f"did you mean {close[0]!r}? ({fix})"
    raise GmmError(str(name), "unknown backend", fix)
  return KERNELS.get(name)


def check_available(name: str, interpret: bool = False) -> Backend:
  """Raises GmmError when ``name`` cannot run on this platform as asked."""
  be = get_backend(name)
  platform = jax.default_backend()
  if be.platforms and platform not in be.platforms:
    if not interpret:
      fix = (f"run it on {' or '.join(be.platforms)}, pick backend='blocked' or "
             "'ragged_dot'")
      if be.interpretable:
        fix += ", or pass interpret=True (Pallas interpreter: slow, tests only)"
      raise GmmError(name, f"needs {be.needs}; this platform is {platform!r}", fix)
  elif not interpret and be.availability is not None:
    why = be.availability()
    if why:
      raise GmmError(name, f"needs {be.needs}; {why}",
                     "pick backend='blocked' or 'ragged_dot', or pass interpret=True")
  if interpret and not be.interpretable:
    raise GmmError(name, "has no interpret mode",
                   "drop interpret=True (it only applies to the Pallas backends)")
  return be


def _check_operands(name: str, lhs, rhs, group_sizes, transpose_rhs: bool,
                    what: str = "rhs") -> None:
  """Shape and dtype checks shared by gmm and tgmm, before any compute."""
  if lhs.ndim != 2:
    raise GmmError(name, f"lhs must be 2-D [m, k], got shape {lhs.shape}",
                   "flatten the token copies to [m, k]")
  if group_sizes.ndim != 1:
    raise GmmError(name, f"group_sizes must be 1-D [G], got shape {group_sizes.shape}",
                   "pass one size per group")
  if group_sizes.dtype != jnp.int32:
    raise GmmError(name, f"group_sizes must be int32, got {group_sizes.dtype}",
                   "cast with group_sizes.astype(jnp.int32)")
  for label, a in (("lhs", lhs), (what, rhs)):
    if a.dtype not in FLOAT_DTYPES:
      raise GmmError(name, f"{label} dtype {a.dtype} is not supported",
                     "use float32, bfloat16 or float16")
  if lhs.dtype != rhs.dtype:
    raise GmmError(name, f"lhs dtype {lhs.dtype} != {what} dtype {rhs.dtype}",
                   "cast both to one dtype (accumulation is float32 regardless)")
  if not isinstance(group_sizes, jax.core.Tracer):
    gs = np.asarray(group_sizes)
    if (gs < 0).any():
      raise GmmError(name, f"group_sizes has negative entries {gs.tolist()}",
                     "group sizes count rows and must be >= 0")
    if gs.sum() > lhs.shape[0]:
      raise GmmError(name, f"group_sizes sum to {int(gs.sum())} > m={lhs.shape[0]} "
                     "rows of lhs", "make the groups cover at most the rows of lhs")


def _row_mask(group_sizes: jax.Array, m: int) -> jax.Array:
  return jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable non-array arguments of one gmm call."""

  backend: str
  out_dtype: Any
  transpose_rhs: bool
  interpret: bool
  options: tuple  # sorted (key, value) pairs


def _raw_gmm(st: _Static, lhs, rhs, group_sizes, out_dtype=None, transpose_rhs=None):
  be = get_backend(st.backend)
  out = be.gmm(lhs, rhs, group_sizes,
               out_dtype=st.out_dtype if out_dtype is None else out_dtype,
               transpose_rhs=st.transpose_rhs if transpose_rhs is None else transpose_rhs,
               interpret=st.interpret, **dict(st.options))
  return jnp.where(_row_mask(group_sizes, lhs.shape[0])[:, None], out, 0)


def _raw_tgmm(st: _Static, lhs, grad, group_sizes, out_dtype):
  be = get_backend(st.backend)
  out = be.tgmm(lhs, grad, group_sizes, out_dtype=out_dtype,
                interpret=st.interpret, **dict(st.options))
  return jnp.where((group_sizes > 0)[:, None, None], out, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_vjp(st: _Static, lhs, rhs, group_sizes):
  return _raw_gmm(st, lhs, rhs, group_sizes)


def _gmm_fwd(st, lhs, rhs, group_sizes):
  return _raw_gmm(st, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(st, res, grad):
  lhs, rhs, group_sizes = res
  # Cotangent in the input dtype; the kernels accumulate in float32.
  grad = grad.astype(lhs.dtype)
  d_lhs = _raw_gmm(st, grad, rhs, group_sizes, out_dtype=lhs.dtype,
                   transpose_rhs=not st.transpose_rhs)
  if st.transpose_rhs:  # rhs is [G, n, k]: d_rhs[g] = grad_g^T lhs_g
    d_rhs = _raw_tgmm(st, grad, lhs, group_sizes, rhs.dtype)
  else:
    d_rhs = _raw_tgmm(st, lhs, grad, group_sizes, rhs.dtype)
  return d_lhs, d_rhs, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
        backend: str = DEFAULT_BACKEND, preferred_element_type=None,
        transpose_rhs: bool = False, interpret: bool = False,
        **options) -> jax.Array:
  """Grouped matmul out[m, n]; see the module docstring for the contract.

  Args:
    lhs: [m, k] rows sorted by group.
    rhs: [G, k, n] (or [G, n, k] with ``transpose_rhs``).
    group_sizes: int32[G] rows per group, summing to at most m.
    backend: a name in ``BACKENDS``.
    preferred_element_type: output dtype (default lhs.dtype); the
      accumulation is float32 in every backend.
    transpose_rhs: multiply by rhs[g]^T without materialising it.
    interpret: run a Pallas backend through its interpreter (CPU tests).
    **options: backend tiling knobs (``tile_m`` for blocked, ``tiling`` =
      (tm, tk, tn) for the Pallas kernels).
  """
  be = check_available(backend, interpret)
  _check_operands(backend, lhs, rhs, group_sizes, transpose_rhs)
  if rhs.ndim != 3:
    raise GmmError(backend, f"rhs must be 3-D [G, k, n], got shape {rhs.shape}",
                   "stack the per-group matrices on a leading axis")
  k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if lhs.shape[1] != k_rhs:
    raise GmmError(backend, f"contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape}"
                   + (" (transpose_rhs)" if transpose_rhs else ""),
                   "lhs.shape[1] must equal rhs.shape[1] (rhs.shape[2] when transposed)")
  if rhs.shape[0] != group_sizes.shape[0]:
    raise GmmError(backend, f"rhs has {rhs.shape[0]} groups but group_sizes has "
                   f"{group_sizes.shape[0]}", "give one size per rhs group")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  group_sizes = tiling.clamp_group_sizes(group_sizes, lhs.shape[0])
  if not be.custom_vjp:
    out = be.gmm(lhs, rhs, group_sizes, out_dtype=out_dtype,
                 transpose_rhs=transpose_rhs, interpret=interpret, **options)
    return jnp.where(_row_mask(group_sizes, lhs.shape[0])[:, None], out, 0)
  st = _Static(backend, out_dtype, transpose_rhs, bool(interpret),
               tuple(sorted(options.items())))
  return _gmm_vjp(st, lhs, rhs, group_sizes)


def tgmm(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *,
         backend: str = DEFAULT_BACKEND, preferred_element_type=None,
         interpret: bool = False, **options) -> jax.Array:
  """out[G, k, n] = per-group lhs[rows_g]^T @ grad[rows_g] (zeros if empty).

  The rhs gradient of :func:`gmm`; exposed for weight-gradient kernels and
  tests. Not differentiable itself.
  """
  be = check_available(backend, interpret)
  _check_operands(backend, lhs, grad, group_sizes, False, what="grad")
  if grad.ndim != 2 or grad.shape[0] != lhs.shape[0]:
    raise GmmError(backend, f"grad must be [m={lhs.shape[0]}, n], got {grad.shape}",
                   "pass the cotangent of the gmm output")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  group_sizes = tiling.clamp_group_sizes(group_sizes, lhs.shape[0])
  st = _Static(be.name, out_dtype, False, bool(interpret), tuple(sorted(options.items())))
  return _raw_tgmm(st, lhs, grad, group_sizes, out_dtype)


# --- The reference backend: jax.lax.ragged_dot and JAX's own gradient. ------

def _ragged_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, interpret):
  del interpret
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                            preferred_element_type=jnp.float32).astype(out_dtype)


def _ragged_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret):
  del interpret
  # The rhs cotangent of ragged_dot is exactly the per-group lhs^T grad.
  zeros = jnp.zeros((group_sizes.shape[0], lhs.shape[1], grad.shape[1]), lhs.dtype)
  _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(
      lhs, w, group_sizes, preferred_element_type=jnp.float32), zeros)
  return vjp(grad.astype(jnp.float32))[0].astype(out_dtype)


BACKEND = Backend(name="ragged_dot", gmm=_ragged_gmm, tgmm=_ragged_tgmm,
                  needs="nothing (any platform)", custom_vjp=False,
                  auto_on=(ANY_PLATFORM,),  # correct everywhere: auto's fallback
                  # The threshold is the smallest group at which the GPU device check
                  # (docs/benchmarks.md) found whole_group the fastest layer path;
                  # smaller groups were not measured.
                  auto_large_groups=(("gpu", "whole_group", 1024),))
register_backend(BACKEND)
