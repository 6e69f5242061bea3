"""Row-tile metadata shared by the blocked gmm and the fused FFN."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import tiling


def test_group_tiles_two_sizes_hand_computed():
  # Groups of 5, 0, 9 rows in m = 16; 4-row tiles, remainders in 2-row tiles.
  (tm, big), (ts, small) = tiling.group_tiles(jnp.array([5, 0, 9], jnp.int32), 16, 4, 2)
  assert (tm, ts) == (4, 2)
  assert int(big.num_tiles) == 3 and int(small.num_tiles) == 2
  np.testing.assert_array_equal(big.offsets, [0, 1, 1, 3])     # group 2 owns tiles 1, 2
  np.testing.assert_array_equal(big.group[:3], [0, 2, 2])
  np.testing.assert_array_equal(big.lo[:3], [0, 5, 9])
  np.testing.assert_array_equal(small.offsets, [0, 1, 1, 2])
  np.testing.assert_array_equal(small.lo[:2], [4, 13])
  np.testing.assert_array_equal(small.row[:2], [4, 13])
  # The last small tile reads rows 13, 14 and owns only row 13 (group 2 ends at 14).
  np.testing.assert_array_equal(small.owned(1, 2), [True, False])


def test_clamped_tile_owns_only_its_new_rows():
  # One group of 7 rows in m = 7 with 4-row tiles: the second tile starts at
  # row 4, is clamped back to row 3 and must not own row 3 again.
  ((tm, t),) = tiling.group_tiles(jnp.array([7], jnp.int32), 7, 4)
  np.testing.assert_array_equal(t.row[:2], [0, 3])
  np.testing.assert_array_equal(t.owned(1, 4), [False, True, True, True])


def test_fit_tiles_defaults_and_clamping():
  assert tiling.fit_tiles(10_000) == (tiling.DEFAULT_TILE_M, tiling.DEFAULT_TILE_SMALL)
  assert tiling.fit_tiles(10, 256, 64) == (10, 10)
  assert tiling.fit_tiles(100, 32, 64) == (32, 32)
  assert tiling.fit_tiles(0) == (1, 1)


def test_tile_larger_than_operand_is_refused():
  with pytest.raises(ValueError, match="row tile tm=8 exceeds m=4"):
    tiling.group_tiles(jnp.array([4], jnp.int32), 4, 8)


def test_expert_tiles_hand_computed():
  # Groups of 5, 0, 9, 3 rows in m = 20; 4-row full tiles, remainders in one
  # tile of 2 or 4 rows (grain 2).
  t = tiling.expert_tiles(jnp.array([5, 0, 9, 3], jnp.int32), 20, 4, 2)
  assert t.sizes == (2, 4) and t.tm == 4
  np.testing.assert_array_equal(t.full, [1, 0, 2, 0])
  np.testing.assert_array_equal(t.rest_lo, [4, 5, 13, 14])
  np.testing.assert_array_equal(t.size_class, [0, -1, 0, 1])  # group 1: no tile
  np.testing.assert_array_equal(t.offsets, [[0, 1, 1, 2, 2], [0, 0, 0, 0, 1]])
  r0, keep = t.rest_tile(3, 4)  # rows 14..17, group 3 ends at 17
  assert int(r0) == 14
  np.testing.assert_array_equal(keep, [True, True, True, False])


def test_expert_tiles_clamped_remainder_and_uneven_grain():
  # The last group ends at m = 17: its 4-row remainder tile is clamped back
  # to row 13 and owns only rows 14..16. tm = 5 with grain 2: sizes 2, 4, 5.
  t = tiling.expert_tiles(jnp.array([5, 9, 3], jnp.int32), 17, 5, 2)
  assert t.sizes == (2, 4, 5)
  np.testing.assert_array_equal(t.full, [1, 1, 0])
  np.testing.assert_array_equal(t.size_class, [-1, 1, 1])
  r0, keep = t.rest_tile(2, 4)
  assert int(r0) == 13
  np.testing.assert_array_equal(keep, [False, True, True, True])


def test_expert_tiles_many_small_experts_one_tile_each():
  # 8 experts of 0..7 rows and tm = 8: no full tiles, one tile per non-empty
  # expert, rounded up to the grain of 4 (waste < 4 rows each).
  sizes = jnp.arange(8, dtype=jnp.int32)
  t = tiling.expert_tiles(sizes, 28, 8, 4)
  assert t.sizes == (4, 8)
  np.testing.assert_array_equal(t.full, np.zeros(8))
  np.testing.assert_array_equal(t.size_class, [-1, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(np.diff(t.offsets, axis=1).sum(0), [0, 1, 1, 1, 1, 1, 1, 1])


def test_expert_tiles_refuses_bad_sizes():
  with pytest.raises(ValueError, match="grain=8, tm=4"):
    tiling.expert_tiles(jnp.array([4], jnp.int32), 4, 4, 8)


def test_fused_tile_defaults():
  assert tiling.fit_tiles(10_000, defaults=(tiling.FUSED_TILE_M, tiling.FUSED_TILE_GRAIN)) \
      == (512, 64)
