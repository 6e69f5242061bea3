"""One suite for every grouped-matmul backend, against jax.lax.ragged_dot.

Pallas backends run in interpret mode on CPU (slow: shapes stay tiny and
every case is one jitted call of forward + both gradients).
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import gmm as gmm_lib

# Per backend: the keyword arguments that make it run here, with tiles small
# enough that every case spans several tiles and straddled tiles.
BACKENDS = {
    "ragged_dot": {},
    "blocked": {"tile_m": 8, "tile_small": 3},  # 8-row tiles, remainders in 3s
    "pallas_tpu": {"interpret": True, "tiling": (8, 16, 16)},
    "pallas_gpu": {"interpret": True, "tiling": (64, 64, 64)},
    # Buckets of 4x the balanced group: every case fits one (the [G, C]
    # slots); test_shape_choice.py covers the tiled fallback.
    "whole_group": {"bucket_factors": (4.0,)},
}
# Pallas GPU interpretation simulates every warpgroup thread: its operands
# need wgmma-sized tiles (64), so it gets its own, larger shapes.
SHAPES = {"pallas_gpu": (100, 64, 64)}
DEFAULT_SHAPE = (40, 16, 24)  # m, k, n

# (name, group sizes as fractions of m -> computed per shape)
CASES = {
    # uneven groups, an empty group in the middle and one at the end, rows
    # past the sum (they must come out zero)
    "uneven_empty_tail": lambda m: [m // 4, 0, m // 2 + 3, 0, m // 8],
    "single_group": lambda m: [m],
    # a long last group whose final tile must be clamped back inside lhs:
    # it re-reads rows its previous tile owns (regression: counted twice)
    "clamped_last_tile": lambda m: [3, m - 4],
    "all_empty": lambda m: [0, 0, 0],
}
# pallas_gpu interpretation costs seconds per kernel: its suite keeps the
# case that exercises everything at once plus the degenerate ones forward.
GPU_CASES = ("uneven_empty_tail",)


def _operands(m, k, n, sizes, dtype=jnp.float32, seed=0):
  kl, kr, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
  lhs = jax.random.normal(kl, (m, k), jnp.float32).astype(dtype)
  rhs = jax.random.normal(kr, (len(sizes), k, n), jnp.float32).astype(dtype)
  cot = jax.random.normal(kg, (m, n), jnp.float32)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot


@functools.partial(jax.jit, static_argnames=("backend", "kw", "out_dtype"))
def _value_and_grads(lhs, rhs, gs, cot, *, backend, kw, out_dtype=None):
  def f(a, b):
    return gmm_lib.gmm(a, b, gs, backend=backend, preferred_element_type=out_dtype,
                       **dict(kw))
  out, vjp = jax.vjp(f, lhs, rhs)
  return (out,) + vjp(cot.astype(out.dtype))


def _kw(backend):
  return tuple(sorted(BACKENDS[backend].items()))


def _cases():
  for be in BACKENDS:
    for case in CASES:
      if be == "pallas_gpu" and case not in GPU_CASES:
        continue
      yield pytest.param(be, case, id=f"{be}-{case}")


@pytest.mark.parametrize("backend,case", list(_cases()))
def test_outputs_and_gradients_match_ragged_dot(backend, case):
  m, k, n = SHAPES.get(backend, DEFAULT_SHAPE)
  sizes = CASES[case](m)
  lhs, rhs, gs, cot = _operands(m, k, n, sizes)
  got = _value_and_grads(lhs, rhs, gs, cot, backend=backend, kw=_kw(backend))
  want = _value_and_grads(lhs, rhs, gs, cot, backend="ragged_dot", kw=())
  for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=f"{backend} {name}")
  # Rows past the groups are exactly zero, and so are their lhs gradients.
  used = int(sum(sizes))
  assert not np.any(np.asarray(got[0])[used:]), "rows past sum(group_sizes) must be 0"
  assert not np.any(np.asarray(got[1])[used:])
  # An empty group's rhs gradient is exactly zero.
  for g, size in enumerate(sizes):
    if size == 0:
      assert not np.any(np.asarray(got[2])[g])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bf16_inputs_accumulate_in_f32(backend):
  m, k, n = SHAPES.get(backend, DEFAULT_SHAPE)
  sizes = CASES["uneven_empty_tail"](m)
  lhs, rhs, gs, cot = _operands(m, k, n, sizes, dtype=jnp.bfloat16, seed=1)
  out = gmm_lib.gmm(lhs, rhs, gs, backend=backend, preferred_element_type=jnp.float32,
                    **BACKENDS[backend])
  assert out.dtype == jnp.float32
  # The exact product of the bf16 values, summed in float64: an f32
  # accumulator stays within f32 rounding of it, a bf16 one would not.
  exact = np.zeros((m, n))
  a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  start = 0
  for g, size in enumerate(sizes):
    exact[start:start + size] = a[start:start + size] @ b[g]
    start += size
  np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-4)
  if backend != "pallas_gpu":  # its gradients are covered in f32 above
    _, d_lhs, d_rhs = _value_and_grads(lhs, rhs, gs, cot, backend=backend,
                                       kw=_kw(backend), out_dtype=jnp.float32)
    _, w_lhs, w_rhs = _value_and_grads(lhs, rhs, gs, cot, backend="ragged_dot", kw=(),
                                       out_dtype=jnp.float32)
    assert d_lhs.dtype == jnp.bfloat16 and d_rhs.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(d_lhs, np.float32), np.asarray(w_lhs, np.float32),
                               rtol=2e-2, atol=0.1)
    np.testing.assert_allclose(np.asarray(d_rhs, np.float32), np.asarray(w_rhs, np.float32),
                               rtol=2e-2, atol=0.1)


@pytest.mark.parametrize("backend", ["blocked", "pallas_tpu"])
def test_transpose_rhs_and_tgmm_match_reference(backend):
  m, k, n = DEFAULT_SHAPE
  sizes = [7, 0, 20, 9]
  lhs, rhs, gs, cot = _operands(m, k, n, sizes, seed=2)
  kw = BACKENDS[backend]
  rhs_t = jnp.swapaxes(rhs, 1, 2)
  np.testing.assert_allclose(
      gmm_lib.gmm(lhs, rhs_t, gs, backend=backend, transpose_rhs=True, **kw),
      gmm_lib.gmm(lhs, rhs, gs, backend="ragged_dot"), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(
      gmm_lib.tgmm(lhs, cot, gs, backend=backend, **kw),
      gmm_lib.tgmm(lhs, cot, gs, backend="ragged_dot"), rtol=1e-5, atol=1e-4)


def test_tiny_hand_computed_case():
  lhs = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
  rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])  # group 0: identity, group 1: 2x
  gs = jnp.array([1, 1], jnp.int32)  # row 2 belongs to no group
  for backend in ("ragged_dot", "blocked"):
    out = gmm_lib.gmm(lhs, rhs, gs, backend=backend)
    np.testing.assert_array_equal(out, [[1.0, 2.0], [6.0, 8.0], [0.0, 0.0]])


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(sizes=st.lists(st.integers(0, 16), min_size=5, max_size=5),
                  tiles=st.sampled_from([(1, 1), (4, 4), (8, 3), (16, 16), (64, 5)]))
def test_blocked_equals_ragged_dot_for_any_sizes(sizes, tiles):
  # Fixed shapes (m = 5 * 16 covers every draw, the rest are rows past the
  # groups) so that only the sizes change and nothing recompiles.
  lhs, rhs, gs, cot = _operands(80, 3, 5, sizes, seed=3)
  kw = (("tile_m", tiles[0]), ("tile_small", tiles[1]))
  got = _value_and_grads(lhs, rhs, gs, cot, backend="blocked", kw=kw)
  want = _value_and_grads(lhs, rhs, gs, cot, backend="ragged_dot", kw=())
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_traced_overflowing_sizes_are_truncated_at_m():
  lhs, rhs, _, _ = _operands(6, 2, 2, [4, 4])
  gs = jnp.array([4, 4], jnp.int32)  # sums to 8 > m = 6
  out = jax.jit(lambda g: gmm_lib.gmm(lhs, rhs, g, backend="blocked", tile_m=4))(gs)
  want = gmm_lib.gmm(lhs, rhs, jnp.array([4, 2], jnp.int32), backend="ragged_dot")
  np.testing.assert_allclose(out, want, rtol=1e-6)


# --- Bad input: errors name the backend and the fix, before any compute. -----

def _bad(match, **kwargs):
  lhs = kwargs.pop("lhs", jnp.ones((4, 3)))
  rhs = kwargs.pop("rhs", jnp.ones((2, 3, 5)))
  gs = kwargs.pop("gs", jnp.array([2, 2], jnp.int32))
  with pytest.raises(gmm_lib.GmmError, match=match):
    gmm_lib.gmm(lhs, rhs, gs, **kwargs)


def test_unknown_backend_suggests_the_close_name():
  _bad(r"'blocks'.*did you mean 'blocked'", backend="blocks")


def test_pallas_backends_off_platform_need_interpret():
  platform = jax.default_backend()
  if platform != "tpu":
    _bad(r"'pallas_tpu'.*needs a TPU.*interpret=True", backend="pallas_tpu")
  if platform != "gpu":
    _bad(r"'pallas_gpu'.*Hopper GPU.*interpret=True", backend="pallas_gpu")


def test_interpret_on_a_non_pallas_backend_is_an_error():
  _bad(r"'blocked'.*no interpret mode", backend="blocked", interpret=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lhs=jnp.ones((4, 3), jnp.int32)), r"'blocked'.*lhs dtype int32"),
    (dict(gs=jnp.array([2.0, 2.0])), r"'blocked'.*group_sizes must be int32"),
    (dict(gs=jnp.array([3, 2], jnp.int32)), r"'blocked'.*sum to 5 > m=4"),
    (dict(gs=jnp.array([-1, 2], jnp.int32)), r"'blocked'.*negative"),
    (dict(rhs=jnp.ones((2, 4, 5))), r"'blocked'.*contraction mismatch"),
    (dict(rhs=jnp.ones((3, 3, 5))), r"'blocked'.*3 groups but group_sizes has 2"),
    (dict(rhs=jnp.ones((2, 3, 5), jnp.bfloat16)), r"'blocked'.*float32 != rhs dtype bfloat16"),
    (dict(lhs=jnp.ones((4,))), r"'blocked'.*lhs must be 2-D"),
])
def test_bad_inputs_raise_before_compute(kwargs, match):
  _bad(match, backend="blocked", **kwargs)


def test_bad_input_names_the_backend_it_was_given():
  _bad(r"'ragged_dot'.*sum to 5 > m=4", backend="ragged_dot",
       gs=jnp.array([3, 2], jnp.int32))
