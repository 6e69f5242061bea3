"""Communication accounting: hand-counted bytes, device-side count == host analytic count."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax.execution import comm


def test_hand_counted_bytes():
  # 4 devices, 2 per node (nodes [0, 0, 1, 1]); device 0 sends 3 tokens, K = 2.
  # t0 -> devices (1, 1): 2 copies to one remote device, same node.
  # t1 -> devices (0, 3): 1 remote copy, crossing nodes.
  # t2 -> devices (2, 3), slot 1 dropped: 1 remote copy, crossing nodes.
  dest = jnp.array([[1, 1], [0, 3], [2, 3]], jnp.int32)
  sent = jnp.array([[True, True], [True, True], [True, False]])
  wire = jnp.array([5, 5, 5, 5], jnp.int32)  # [E_loc, C] buffers of 5 rows
  node_of = np.array([0, 0, 1, 1])
  got = comm.local_dispatch_bytes(dest, sent, wire, jnp.int32(0), node_of, row_bytes=10)
  want = {"wire": 150, "copies": 40, "min_device": 30, "min_node": 20,
          "wire_cross_node": 100, "copies_cross_node": 20}
  assert {k: float(v) for k, v in got.items()} == want
  # One group, one source device (index 0 = device 0); both directions.
  host = comm.analytic_bytes(np.asarray(dest)[None, None], np.asarray(sent)[None, None],
                             node_of, 10)
  for key in ("copies", "min_device", "min_node", "copies_cross_node"):
    assert host[key] == 2 * want[key], key
  total = comm.summarize(got, ())
  assert float(total["wire"]) == 300 and float(total["wire_max_device"]) == 300
  assert float(total["padding_waste"]) == pytest.approx(1 - 40 / 150)
  assert float(total["wire_over_min"]) == pytest.approx(5.0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 4]))
def test_device_count_equals_host_count(seed, per_node):
  rng = np.random.default_rng(seed)
  d, t, k = 4, 6, 3
  dest = rng.integers(0, d, size=(d, t, k))
  sent = rng.random((d, t, k)) < 0.8
  node_of = np.arange(d) // per_node
  host = comm.analytic_bytes(dest[None], sent[None], node_of, 1)
  dev = dict.fromkeys(host, 0.0)
  for me in range(d):
    out = comm.local_dispatch_bytes(jnp.asarray(dest[me]), jnp.asarray(sent[me]),
                                    jnp.zeros(d, jnp.int32), jnp.int32(me), node_of, 1)
    for key in dev:
      dev[key] += 2 * float(out[key])
  assert dev == host
  assert host["min_node"] <= host["min_device"] <= host["copies"]


def test_transfer_bytes_counts_remote_and_cross_node_rows():
  # Device 1 of 4 (nodes [0, 0, 1, 1]) sends rows (2, 0, 1, 3) in buckets of 4.
  got = comm.transfer_bytes(jnp.arange(4), jnp.array([2, 0, 1, 3]), jnp.full(4, 4),
                            jnp.int32(1), np.array([0, 0, 1, 1]), row_bytes=10)
  assert {k: float(v) for k, v in got.items()} == {
      "wire": 120, "copies": 60, "wire_cross_node": 80, "copies_cross_node": 40}


def test_analytic_rows_of_each_dispatch_unit():
  # 4 devices, 2 per node; source device 0 (node 0, index 0 in its node).
  # t0 -> devices (1, 1): per copy 2 rows; per token 1; node unit: 1 forward in node 0.
  # t1 -> devices (2, 3): per copy / per token 2 rows across nodes; node unit:
  #   1 row across (lands on device 2, the peer) + 1 forward to device 3.
  dest = np.array([[1, 1], [2, 3]])[None, None]
  sent = np.ones_like(dest, bool)
  node_of = np.array([0, 0, 1, 1])
  one_way = lambda unit: {k: v / 2 for k, v in comm.analytic_bytes(dest, sent, node_of, 1,
                                                                    unit).items()}
  assert one_way("copy") == {"copies": 4, "min_device": 3, "min_node": 1,
                             "copies_cross_node": 2}
  assert one_way("token") == {"copies": 3, "min_device": 3, "min_node": 1,
                              "copies_cross_node": 2}
  assert one_way("node") == {"copies": 3, "min_device": 3, "min_node": 1,
                             "copies_cross_node": 1}
