"""tpu_blocks: the (8, 128)-aligned block shapes both Pallas TPU modules use."""

import jax.numpy as jnp
import numpy as np

from moejax.execution import tpu_blocks


def test_fit_pads_a_small_dim_to_the_alignment_and_a_large_one_to_whole_tiles():
  assert tpu_blocks.fit(5, 128, 8) == (8, 8)        # one block, sublane-aligned
  assert tpu_blocks.fit(0, 128, 8) == (8, 8)        # never an empty block
  assert tpu_blocks.fit(128, 128, 128) == (128, 128)
  assert tpu_blocks.fit(300, 128, 128) == (128, 384)
  assert tpu_blocks.fit(20, 128, 1) == (20, 20)     # interpret mode: no alignment


def test_pad2_zero_pads_the_last_two_dims_only():
  a = jnp.arange(6.0).reshape(1, 2, 3)
  p = tpu_blocks.pad2(a, 4, 5)
  assert p.shape == (1, 4, 5)
  np.testing.assert_array_equal(p[0, :2, :3], a[0])
  assert float(jnp.abs(p).sum()) == float(a.sum())
  assert tpu_blocks.pad2(a, 2, 3) is a


def test_row_mask_marks_the_rows_of_group_g_inside_the_tile():
  offsets = jnp.array([0, 3, 3, 10], jnp.int32)  # groups of 3, 0 and 7 rows
  got = tpu_blocks.row_mask(offsets, 2, 0, 4)[:, 0]  # tile 0 = rows 0..3
  np.testing.assert_array_equal(got, [False, False, False, True])
  assert not bool(tpu_blocks.row_mask(offsets, 1, 0, 4).any())  # the empty group
  np.testing.assert_array_equal(tpu_blocks.row_mask(offsets, 2, 2, 4)[:, 0],
                                [True, True, False, False])  # rows 8..11, group ends at 10
