"""EPLB-style placement: hand-computed packings, replication, node confinement, errors."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax.execution import placement as P
from tests.configs import moe_config


def test_identity_placement_is_the_contiguous_layout():
  plc = P.identity_placement(8, 4)
  np.testing.assert_array_equal(plc.phys_to_logical, np.arange(8))
  np.testing.assert_array_equal(plc.replicas[:, 0], np.arange(8))
  assert plc.slots_per_device == 2 and plc.num_devices == 4
  np.testing.assert_array_equal(plc.device_loads([1, 2, 3, 4, 5, 6, 7, 8]), [3, 7, 11, 15])


def test_packing_without_spare_slots_by_hand():
  # Heaviest first onto the least-loaded device with room: 0 -> d0, 1 -> d1,
  # 2 -> d1 (4 < 8), 3 -> d0 (d1 full). Contiguous: [12, 4]; packed: [10, 6].
  plc = P.compute_placement([8, 4, 2, 2], 2)
  np.testing.assert_array_equal(plc.phys_to_logical, [0, 3, 1, 2])
  np.testing.assert_array_equal(plc.device_loads([8, 4, 2, 2]), [10, 6])


def test_replication_of_the_hot_expert_by_hand():
  # Two spare slots both go to expert 0 (6/1 > 1, then 6/2 = 3 > 1): three
  # replicas of load 2. Packing: 0 -> d0, 0 -> d1 (prefers a device without
  # expert 0), 0 -> d0 (tie), 1 -> d1, 2 -> d1, 3 -> d0.
  load = [6, 1, 1, 0]
  plc = P.compute_placement(load, 2, slots_per_device=3)
  np.testing.assert_array_equal(plc.num_replicas, [3, 1, 1, 1])
  np.testing.assert_array_equal(plc.phys_to_logical, [0, 0, 3, 0, 1, 2])
  np.testing.assert_array_equal(plc.device_loads(load), [4, 4])
  assert P.identity_placement(4, 2).device_loads(load).max() == 7
  np.testing.assert_array_equal(plc.replicas[0], [0, 1, 3])


def test_keep_nodes_confines_every_replica_to_its_home_node():
  load = np.array([50, 1, 1, 1, 1, 1, 1, 30], float)
  plc = P.compute_placement(load, 4, slots_per_device=3, devices_per_node=2, keep_nodes=True)
  home_node = (np.arange(8) // 2) // 2
  slot_node = plc.device_of_slot() // 2
  np.testing.assert_array_equal(home_node[plc.phys_to_logical], slot_node)
  assert plc.num_replicas[0] > 1 and plc.num_replicas[7] > 1
  free = P.compute_placement(load, 4, slots_per_device=3)
  assert free.device_loads(load).max() <= plc.device_loads(load).max()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=8, max_size=8), st.sampled_from([1, 2, 4, 8]),
       st.integers(0, 3))
def test_placement_invariants(load, devices, spare):
  s = 8 // devices + spare
  plc = P.compute_placement(load, devices, slots_per_device=s)
  assert len(plc.phys_to_logical) == devices * s
  assert (plc.num_replicas >= 1).all() and plc.num_replicas.sum() == devices * s
  for e in range(8):
    reps = plc.replicas[e][: plc.num_replicas[e]]
    np.testing.assert_array_equal(plc.phys_to_logical[reps], e)
  np.testing.assert_allclose(plc.device_loads(load).sum(), sum(load), rtol=1e-9, atol=1e-9)
  if spare and max(load) > 0:  # spare slots always go to a hottest expert first
    assert plc.num_replicas[int(np.argmax(load))] > 1


def test_errors():
  with pytest.raises(ValueError, match="slots_per_device=1 x 4 devices < 8 experts"):
    P.compute_placement(np.ones(8), 4, slots_per_device=1)
  with pytest.raises(ValueError, match="does not divide"):
    P.compute_placement(np.ones(8), 3)
  with pytest.raises(ValueError, match="without a physical slot"):
    P.from_phys_to_logical([0, 0, 1, 1], 3, 2)
  with pytest.raises(ValueError, match="keep_nodes needs devices_per_node"):
    P.compute_placement(np.ones(8), 4, keep_nodes=True)


def test_layer_refuses_placements_that_break_a_routing_limit():
  from moejax import config as C
  from moejax.execution import mesh as M
  from moejax.execution.parallel import check_placement
  cfg = moe_config(num_experts=8, routing=C.RoutingConfig(top_k=2))
  node_of = np.arange(4) // 2
  load = np.array([50, 1, 1, 1, 1, 1, 1, 30], float)
  kept = P.compute_placement(load, 4, slots_per_device=3, devices_per_node=2, keep_nodes=True)
  moved = P.compute_placement(load, 4, slots_per_device=3)
  nodes = C.ParallelConfig(expert=4, devices_per_node=2, route_limit="nodes",
                           route_limit_count=1)
  check_placement(kept, cfg, nodes, node_of)
  check_placement(moved, cfg, C.ParallelConfig(expert=4), node_of)
  with pytest.raises(ValueError, match="off their node.*keep_nodes=True"):
    check_placement(moved, cfg, nodes, node_of)
  with pytest.raises(ValueError, match="off their device"):
    check_placement(kept, cfg, C.ParallelConfig(expert=4, route_limit="devices",
                                                route_limit_count=2), node_of)
  with pytest.raises(ValueError, match="placement covers 8 experts on 4 devices"):
    check_placement(kept, cfg, C.ParallelConfig(expert=2), node_of)
