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
