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
  # Class 0 (2 rows): groups 0 and 2; class 1 (4 rows): group 3; group 1 last.
  np.testing.assert_array_equal(t.by_class, [0, 2, 3, 1])
  np.testing.assert_array_equal(t.class_start, [0, 2, 3])
  # Groups with full tiles first: 0 and 2.
  np.testing.assert_array_equal(t.with_full[:2], [0, 2])
  assert int(t.num_with_full) == 2
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
  np.testing.assert_array_equal(t.class_start, [0, 4, 7])
  np.testing.assert_array_equal(t.by_class[:7], [1, 2, 3, 4, 5, 6, 7])
  assert int(t.num_with_full) == 0


def test_expert_tiles_refuses_bad_sizes():
  with pytest.raises(ValueError, match="grain=8, tm=4"):
    tiling.expert_tiles(jnp.array([4], jnp.int32), 4, 4, 8)


def test_fused_tiles_grow_with_the_balanced_group_size():
  # (m, G) -> (tm, grain): 512-row tiles up to groups of 1023 rows, the
  # largest power of two <= m / G above that, capped at 2048; grain tm / 16
  # once that exceeds 64.
  assert tiling.fused_tiles(65536, 512) == (512, 64)    # E=512, K=8, T=8192
  assert tiling.fused_tiles(65536, 128) == (512, 64)    # groups of 512
  assert tiling.fused_tiles(65536, 64) == (1024, 64)    # groups of 1024
  assert tiling.fused_tiles(65535, 64) == (512, 64)     # groups just under 1024
  assert tiling.fused_tiles(16384, 8) == (2048, 128)    # E=8, K=2
  assert tiling.fused_tiles(65536, 8) == (2048, 128)    # capped
  # Small operands keep tm <= m; given sizes win over the rule.
  assert tiling.fused_tiles(40, 4) == (40, 40)
  assert tiling.fused_tiles(16384, 8, tile_m=512) == (512, 64)
  assert tiling.fused_tiles(16384, 8, tile_small=32) == (2048, 32)


def test_remainder_sizes_add_fine_steps_near_the_balanced_size():
  # 65536 rows over 512 groups: balanced groups of 128 rows, all remainders
  # (tm = 512). The grain gives 64, 128, ..., 512; the fine step adds 112,
  # 144 and 160 (128 is already a grain size).
  assert tiling.remainder_sizes(65536, 512, 512, 64, 16) == (
      64, 112, 128, 144, 160, 192, 256, 320, 384, 448, 512)
  # 1024-row groups: remainders near 0 (mod 512), so the fine sizes sit
  # around 512 and above it (528, 544: the fold sizes).
  assert tiling.remainder_sizes(65536, 64, 512, 64, 16) == (
      64, 128, 192, 256, 320, 384, 448, 496, 512, 528, 544)
  # No fine sizes without a step, with a step >= the grain, or for a small
  # operand (its compile time dominates).
  grain_only = tuple(range(64, 513, 64))
  assert tiling.remainder_sizes(65536, 512, 512, 64, 0) == grain_only
  assert tiling.remainder_sizes(65536, 512, 512, 64, 64) == grain_only
  assert tiling.remainder_sizes(1024, 8, 512, 64, 16) == grain_only


def test_expert_tiles_fine_sizes_cut_the_padding():
  # Groups of 117..139 rows (balanced E=512 routing) pick the next size:
  # 128 -> 128, 129 -> 144, 139 -> 144, 117 -> 128; without the fine step
  # every group above 128 ran as a 192-row tile.
  sizes = jnp.array([128, 129, 139, 117] + [128] * 508, jnp.int32)
  t = tiling.expert_tiles(sizes, 65536, 512, 64, 16)
  picked = np.asarray(t.sizes)[np.asarray(t.size_class)[:4]]
  np.testing.assert_array_equal(picked, [128, 144, 144, 128])
  coarse = tiling.expert_tiles(sizes, 65536, 512, 64)
  np.testing.assert_array_equal(np.asarray(coarse.sizes)[np.asarray(coarse.size_class)[:4]],
                                [128, 192, 192, 128])


def test_expert_tiles_fold_a_few_rows_past_a_full_tile_into_one_tile():
  # tm = 8, grain 4, fine 2; groups of ~8 rows (m = 2048 over 256 groups) put
  # the fine sizes around 8: 6, 10, 12 (X = 12 - 8 = 4 rows can fold). A group
  # of 10 rows runs one 10-row tile, not an 8-row tile plus a 2-row one.
  assert tiling.remainder_sizes(2048, 256, 8, 4, 2) == (4, 6, 8, 10, 12)
  groups = [10, 26, 7, 8, 13, 12]
  t = tiling.expert_tiles(jnp.array(groups + [0] * 250, jnp.int32), 2048, 8, 4, 2)
  # 26 = 2 full + 10 folded; 7: one 8-row tile; 8: one full tile, no
  # remainder; 13 = 8 + 5 (5 > X: not folded, a 6-row tile); 12 = 8 + 4 folded.
  np.testing.assert_array_equal(t.full[:6], [0, 2, 0, 1, 1, 0])
  cls = np.asarray(t.size_class[:6])
  assert cls[3] == -1
  np.testing.assert_array_equal(np.asarray(t.sizes)[cls[[0, 1, 2, 4, 5]]], [10, 10, 8, 6, 12])
  np.testing.assert_array_equal(t.rest_lo[:6], [0, 26, 36, 51, 59, 64])
  r0, keep = t.rest_tile(1, 10)  # group 1: rows 10..35; its tile covers 26..35
  assert int(r0) == 26 and bool(keep.all())
  assert int(t.num_with_full) == 3


def test_pow2_at_least():
  assert [tiling.pow2_at_least(n) for n in (1, 2, 3, 16, 17, 1000)] == [
      1, 2, 4, 16, 32, 1024]
