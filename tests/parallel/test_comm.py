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
