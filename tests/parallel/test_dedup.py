"""Pieces of the deduplicating dispatch and the bucketed transport, by hand (no devices).

The dispatches themselves run on 8 simulated devices in test_ep.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import dedup, transport


def test_bucket_sizes_are_geometric_and_end_at_the_worst_case():
  # ceil(512 / 2^(i/3)) for i < 8: 512, 407, 323, 256, 204, 162, 128, 102.
  assert transport.bucket_sizes(512, 8) == (102, 128, 162, 204, 256, 323, 407, 512)
  assert transport.bucket_sizes(512, 1) == (512,)
  assert transport.bucket_sizes(3, 8) == (1, 2, 3)          # equal sizes merged
  with pytest.raises(ValueError, match="upper=0"):
    transport.bucket_sizes(0, 4)


def test_choose_bucket_takes_the_smallest_that_holds_the_count():
  sizes = (4, 6, 8)
  assert [int(transport.choose_bucket(jnp.int32(n), sizes, ())) for n in (0, 4, 5, 6, 7, 8)] \
      == [0, 0, 1, 1, 2, 2]


def test_expand_sends_a_row_once_per_member_with_its_slots():
  # 2 members of Q = 3 targets each (ids 0-2 on member 0, 3-5 on member 1).
  # Row 0: ids (1, 4, 2): member 0 gets local ids (1, 2), member 1 gets (1).
  # Row 1: ids (5, 3, 0) with slot 1 invalid: member 1 gets (2), member 0 gets (0).
  tgt = jnp.array([[1, 4, 2], [5, 3, 0]], jnp.int32)
  w = jnp.array([[0.5, 0.3, 0.2], [0.6, 0.1, 0.4]], jnp.float32)
  valid = jnp.array([[True, True, True], [True, False, True]])
  hit, ids, wts, lost = dedup._expand(tgt, w, valid, 2, 3)
  np.testing.assert_array_equal(hit, [[True, True], [True, True]])
  np.testing.assert_array_equal(ids, [[[1, 2, 3], [1, 3, 3]],       # 3 = Q: no slot
                                      [[0, 3, 3], [2, 3, 3]]])
  np.testing.assert_allclose(wts, [[[0.5, 0.2, 0], [0.3, 0, 0]],
                                   [[0.4, 0, 0], [0.6, 0, 0]]])
  assert int(lost) == 0


def test_expand_counts_a_repeated_expert_past_the_metadata_as_lost():
  # Kc = min(K, Q) = 1: a row naming member 0 twice cannot carry both slots.
  hit, ids, _, lost = dedup._expand(jnp.array([[0, 0]], jnp.int32), jnp.ones((1, 2)),
                                    jnp.array([[True, True]]), 2, 1)
  np.testing.assert_array_equal(hit, [[True, False]])
  np.testing.assert_array_equal(ids, [[[0], [1]]])
  assert int(lost) == 1


def test_hops_of_each_unit():
  # 8 devices, 2 slots each, 4 devices per node, T = 16 tokens, dropless.
  (one,) = dedup.token_hops(8, 2, 16, None)
  assert (one.members, one.targets, one.upper, one.groups) == (8, 2, 16, None)
  across, within = dedup.node_hops(8, 2, 4, 16, None)
  assert (across.members, across.targets, across.upper) == (2, 8, 16)
  assert across.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert (within.members, within.targets, within.upper) == (4, 2, 32)
  assert within.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  np.testing.assert_array_equal(across.positions(jnp.int32(6)), [2, 6])
  np.testing.assert_array_equal(within.positions(jnp.int32(6)), [4, 5, 6, 7])
  # One node (or nodes of one device): the node unit is the token unit.
  assert dedup.node_hops(8, 2, 8, 16, None) == (one,)
  assert dedup.node_hops(8, 2, 1, 16, None) == (one,)
  # A capacity C bounds the rows per member: Q * C from one source.
  (capped,) = dedup.token_hops(8, 2, 16, 3)
  assert capped.upper == 6
