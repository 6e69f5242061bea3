"""Parallel config validation, meshes, node-limited routing configs, dispatch resolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax import config as C
from moejax.execution import mesh as M
from moejax.execution import parallel as EP
from moejax.routing import topk
from tests.configs import moe_config


def moe(**kw):
  base = dict(num_experts=16, expert_width=8, routing=dict(top_k=4))
  base.update(kw)
  return moe_config(**base)


def test_axis_sizes_infer_data_and_name_the_field_when_they_do_not_divide():
  assert C.ParallelConfig(expert=4).axis_sizes(8) == (2, 1, 4)
  assert C.ParallelConfig(data=2, fsdp=2, expert=2).axis_sizes(8) == (2, 2, 2)
  with pytest.raises(C.ConfigError, match=r"parallel.expert=3.*does not divide the 8"):
    C.ParallelConfig(expert=3).axis_sizes(8)
  with pytest.raises(C.ConfigError, match=r"parallel.data=2.*= 4 but there are 8 devices"):
    C.ParallelConfig(data=2, expert=2).axis_sizes(8)


def test_config_errors_name_field_value_and_fix():
  with pytest.raises(C.ConfigError, match=r"parallel.dispatch='ragid'.*did you mean 'ragged'"):
    C.ParallelConfig(dispatch="ragid")
  with pytest.raises(C.ConfigError, match=r"parallel.devices_per_node=3.*expert=4"):
    C.ParallelConfig(expert=4, devices_per_node=3)
  with pytest.raises(C.ConfigError, match=r"parallel.gmm_backend.*moved to model.moe.execution"):
    C.from_dict(C.ParallelConfig, {"gmm_backend": "blocked"}, "parallel")
  with pytest.raises(C.ConfigError, match=r"parallel.devices_per_node=None.*node-limited"):
    C.ParallelConfig(expert=8, route_limit="nodes")
  with pytest.raises(C.ConfigError,
                     match=r"parallel.expert=3: does not divide moe.topology.num_experts=16"):
    C.check_experts(C.ParallelConfig(expert=3), moe())
  with pytest.raises(C.ConfigError, match="moe.kind='soft'"):
    C.check_experts(C.ParallelConfig(), moe_config(kind="soft"))
  with pytest.raises(C.ConfigError, match="unknown key.*did you mean 'expert'"):
    C.from_dict(C.ParallelConfig, {"experts": 4})
  with pytest.raises(C.ConfigError, match=r"parallel.dispatch_unit='tokens'.*'token'"):
    C.ParallelConfig(dispatch_unit="tokens")
  with pytest.raises(C.ConfigError, match=r"parallel.capacity_buckets=0"):
    C.ParallelConfig(capacity_buckets=0)
  assert C.ParallelConfig().dispatch_unit == "token"


def test_node_dispatch_needs_equal_contiguous_nodes():
  assert EP.node_size(np.array([0, 0, 1, 1])) == 2
  assert EP.node_size(np.array([0, 0, 0, 0])) == 4
  with pytest.raises(ValueError, match=r"dispatch_unit='node'.*\[0, 1, 0, 1\].*devices_per_node"):
    EP.node_size(np.array([0, 1, 0, 1]))
  with pytest.raises(ValueError, match=r"dispatch_unit='node'"):
    EP.node_size(np.array([0, 0, 0, 1, 1, 2]))


def test_make_mesh_on_this_process_devices():
  mesh = M.make_mesh(C.ParallelConfig(), cfg=moe())
  assert mesh.axis_names == M.AXES
  assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "expert": 1}
  assert M.batch_spec(mesh) == jax.sharding.PartitionSpec(M.AXES)
  np.testing.assert_array_equal(M.nodes_of_expert_axis(mesh, None), [0])
  with pytest.raises(C.ConfigError, match="parallel.expert"):
    M.make_mesh(C.ParallelConfig(expert=len(jax.devices()) + 1))


def test_param_specs_shard_experts_over_expert_and_d_over_fsdp():
  from moejax import layer as L
  cfg = moe(num_shared_experts=1)
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  mesh = M.make_mesh(C.ParallelConfig())
  specs = M.param_specs(params, mesh)
  P = jax.sharding.PartitionSpec
  assert specs["experts"] == {"w_gate_up": P("expert", "fsdp", None),
                              "w_down": P("expert", None, "fsdp")}
  assert all(s == P() for s in jax.tree.leaves(specs["router"]) + jax.tree.leaves(
      specs["shared"], is_leaf=lambda s: isinstance(s, P)))


def test_limited_config_is_group_limited_routing_over_nodes_or_devices():
  cfg = moe(routing=dict(top_k=4, score_fn="sigmoid", use_bias=True))
  nodes = C.resolve_route_limit(cfg, C.ParallelConfig(
      expert=8, devices_per_node=2, route_limit="nodes", route_limit_count=2))
  assert (nodes.routing.n_groups, nodes.routing.topk_groups) == (4, 2)
  devices = C.resolve_route_limit(cfg, C.ParallelConfig(
      expert=8, route_limit="devices", route_limit_count=3))
  assert (devices.routing.n_groups, devices.routing.topk_groups) == (8, 3)
  assert C.resolve_route_limit(cfg, C.ParallelConfig(expert=8)) is cfg
  assert C.resolve_route_limit(devices, C.ParallelConfig(
      expert=8, route_limit="devices", route_limit_count=3)) == devices  # idempotent


@pytest.mark.parametrize("kw, pcfg, match", [
    (dict(zero_experts=1), dict(route_limit="devices"), "zero-computation"),
    (dict(routing=dict(kind="hash", top_k=1)), dict(route_limit="devices"), "token-choice"),
    ({}, dict(route_limit="devices", route_limit_count=9), "exceeds the 8 devices"),
    ({}, dict(route_limit="devices", route_limit_count=1), "fewer than top_k=4"),
    (dict(routing=dict(top_k=4, n_groups=2, topk_groups=1)), dict(route_limit="devices",
                                                                  route_limit_count=2),
     "conflicts"),
])
def test_limited_config_errors(kw, pcfg, match):
  with pytest.raises(C.ConfigError, match=match):
    C.resolve_route_limit(moe(**kw), C.ParallelConfig(expert=8, **pcfg))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.sampled_from([1, 2, 4]))
def test_node_limited_topk_never_spans_more_than_m_nodes(seed, m, per_node):
  """The derived config, routed by the ordinary top-k router, respects the node bound."""
  cfg = moe(routing=dict(top_k=4, score_fn="sigmoid", use_bias=True))
  m = min(max(m, -(-2 // per_node)), 8 // per_node)  # room for top-4 at 2 experts/device
  pcfg = C.ParallelConfig(expert=8, devices_per_node=per_node, route_limit="nodes",
                          route_limit_count=m)
  lcfg = C.resolve_route_limit(cfg, pcfg)
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(12, 16)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(16,)) * 0.1, jnp.float32)
  ids = np.asarray(topk.select_topk(logits, bias, lcfg).expert_ids)
  node = ids // (2 * per_node)  # 2 experts per device
  assert max(len(set(row)) for row in node) <= pcfg.route_limit_count


def test_dispatch_resolution_and_native_refusal_on_cpu():
  cap, rag = C.ParallelConfig(), C.ParallelConfig(dispatch="ragged")
  assert EP.resolve_dispatch(cap, "cpu") == "capacity"
  assert EP.resolve_dispatch(rag, "cpu") == "ragged_emulated"
  assert EP.resolve_dispatch(rag, "gpu") == "ragged_native"
  assert EP.resolve_dispatch(C.ParallelConfig(dispatch="ragged", ragged_impl="emulated"),
                             "tpu") == "ragged_emulated"
  with pytest.raises(EP.RaggedUnsupportedError, match="not implemented on 'cpu'.*emulated"):
    EP.resolve_dispatch(C.ParallelConfig(dispatch="ragged", ragged_impl="native"), "cpu")


def test_layer_input_errors_before_compute():
  from moejax import layer as L
  cfg = moe()
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  mesh = M.make_mesh(C.ParallelConfig())
  with pytest.raises(ValueError, match=r"expected \[B, S, d\]"):
    L.ep_moe_layer(params, jnp.zeros((4, 8)), None, cfg, mesh)
  with pytest.raises(ValueError, match="parallel.expert=2 but the mesh's 'expert' axis has 1"):
    L.ep_moe_layer(params, jnp.zeros((2, 4, 8)), None, cfg, mesh, C.ParallelConfig(expert=2))
  # The layer routes by its own config: an unresolved routing limit is refused, not rewritten.
  limited = C.ParallelConfig(expert=8, route_limit="devices", route_limit_count=3)
  with pytest.raises(ValueError, match="resolve_route_limit"):
    C.check_route_limit(cfg, limited)
  C.check_route_limit(C.resolve_route_limit(cfg, limited), limited)
