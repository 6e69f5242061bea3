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


def moe(**kw):
  base = dict(num_experts=16, expert_width=8, router=dict(top_k=4))
  base.update(kw)
  return C.from_dict(C.MoEConfig, base)


def test_axis_sizes_infer_data_and_name_the_field_when_they_do_not_divide():
  assert M.ParallelConfig(expert=4).axis_sizes(8) == (2, 1, 4)
  assert M.ParallelConfig(data=2, fsdp=2, expert=2).axis_sizes(8) == (2, 2, 2)
  with pytest.raises(C.ConfigError, match=r"parallel.expert=3.*does not divide the 8"):
    M.ParallelConfig(expert=3).axis_sizes(8)
  with pytest.raises(C.ConfigError, match=r"parallel.data=2.*= 4 but there are 8 devices"):
    M.ParallelConfig(data=2, expert=2).axis_sizes(8)


def test_config_errors_name_field_value_and_fix():
  with pytest.raises(C.ConfigError, match=r"parallel.dispatch='ragid'.*did you mean 'ragged'"):
    M.ParallelConfig(dispatch="ragid")
  with pytest.raises(C.ConfigError, match=r"parallel.devices_per_node=3.*expert=4"):
    M.ParallelConfig(expert=4, devices_per_node=3)
  with pytest.raises(C.ConfigError, match=r"parallel.gmm_backend"):
    M.ParallelConfig(gmm_backend="cublas")
  with pytest.raises(C.ConfigError, match=r"parallel.expert=3: does not divide moe.num_experts=16"):
    M.check_experts(M.ParallelConfig(expert=3), moe())
  with pytest.raises(C.ConfigError, match="moe.kind='soft'"):
    M.check_experts(M.ParallelConfig(), C.MoEConfig(kind="soft"))
  with pytest.raises(C.ConfigError, match="unknown key.*did you mean 'expert'"):
    C.from_dict(M.ParallelConfig, {"experts": 4})


def test_make_mesh_on_this_process_devices():
  mesh = M.make_mesh(M.ParallelConfig(), cfg=moe())
  assert mesh.axis_names == M.AXES
  assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "expert": 1}
  assert M.batch_spec(mesh) == jax.sharding.PartitionSpec(M.AXES)
  np.testing.assert_array_equal(M.nodes_of_expert_axis(mesh, None), [0])
  with pytest.raises(C.ConfigError, match="parallel.expert"):
    M.make_mesh(M.ParallelConfig(expert=len(jax.devices()) + 1))


def test_param_specs_shard_experts_over_expert_and_d_over_fsdp():
  from moejax import layer as L
  cfg = moe(num_shared_experts=1)
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  mesh = M.make_mesh(M.ParallelConfig())
  specs = M.param_specs(params, mesh)
  P = jax.sharding.PartitionSpec
  assert specs["experts"] == {"w_gate": P("expert", "fsdp", None),
                              "w_up": P("expert", "fsdp", None),
                              "w_down": P("expert", None, "fsdp")}
  assert all(s == P() for s in jax.tree.leaves(specs["router"]) + jax.tree.leaves(
      specs["shared"], is_leaf=lambda s: isinstance(s, P)))


def test_limited_config_is_group_limited_routing_over_nodes_or_devices():
  cfg = moe(router=dict(top_k=4, score_fn="sigmoid", use_bias=True))
  nodes = M.limited_moe_config(cfg, M.ParallelConfig(
      expert=8, devices_per_node=2, route_limit="nodes", route_limit_count=2))
  assert (nodes.router.n_groups, nodes.router.topk_groups) == (4, 2)
  devices = M.limited_moe_config(cfg, M.ParallelConfig(
      expert=8, route_limit="devices", route_limit_count=3))
  assert (devices.router.n_groups, devices.router.topk_groups) == (8, 3)
  assert M.limited_moe_config(cfg, M.ParallelConfig(expert=8)) is cfg


@pytest.mark.parametrize("kw, pcfg, match", [
    (dict(zero_experts=1), dict(route_limit="devices"), "zero-computation"),
    (dict(router=dict(kind="hash", top_k=1)), dict(route_limit="devices"), "token-choice"),
    ({}, dict(route_limit="devices", route_limit_count=9), "exceeds the 8 devices"),
    ({}, dict(route_limit="devices", route_limit_count=1), "fewer than top_k=4"),
    (dict(router=dict(top_k=4, n_groups=2, topk_groups=1)), dict(route_limit="devices",
                                                                  route_limit_count=2),
     "conflicts"),
    ({}, dict(route_limit="nodes"), "devices_per_node"),
])
def test_limited_config_errors(kw, pcfg, match):
  with pytest.raises(C.ConfigError, match=match):
    M.limited_moe_config(moe(**kw), M.ParallelConfig(expert=8, **pcfg))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.sampled_from([1, 2, 4]))
def test_node_limited_topk_never_spans_more_than_m_nodes(seed, m, per_node):
  """The derived config, routed by the ordinary top-k router, respects the node bound."""
  cfg = moe(router=dict(top_k=4, score_fn="sigmoid", use_bias=True))
  m = min(max(m, -(-2 // per_node)), 8 // per_node)  # room for top-4 at 2 experts/device
  pcfg = M.ParallelConfig(expert=8, devices_per_node=per_node, route_limit="nodes",
                          route_limit_count=m)
  lcfg = M.limited_moe_config(cfg, pcfg)
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(12, 16)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(16,)) * 0.1, jnp.float32)
  ids = np.asarray(topk.select_topk(logits, bias, lcfg).expert_ids)
  node = ids // (2 * per_node)  # 2 experts per device
  assert max(len(set(row)) for row in node) <= pcfg.route_limit_count


def test_dispatch_resolution_and_native_refusal_on_cpu():
  cap, rag = M.ParallelConfig(), M.ParallelConfig(dispatch="ragged")
  assert EP.resolve_dispatch(cap, "cpu") == "capacity"
  assert EP.resolve_dispatch(rag, "cpu") == "ragged_emulated"
  assert EP.resolve_dispatch(rag, "gpu") == "ragged_native"
  assert EP.resolve_dispatch(M.ParallelConfig(dispatch="ragged", ragged_impl="emulated"),
                             "tpu") == "ragged_emulated"
  with pytest.raises(EP.RaggedUnsupportedError, match="not implemented on 'cpu'.*emulated"):
    EP.resolve_dispatch(M.ParallelConfig(dispatch="ragged", ragged_impl="native"), "cpu")


def test_layer_input_errors_before_compute():
  from moejax import layer as L
  cfg = moe()
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  mesh = M.make_mesh(M.ParallelConfig())
  with pytest.raises(ValueError, match=r"expected \[B, S, d\]"):
    EP.ep_moe_layer(params, jnp.zeros((4, 8)), None, cfg, mesh)
  with pytest.raises(ValueError, match="parallel.expert=2 but the mesh's 'expert' axis has 1"):
    EP.ep_moe_layer(params, jnp.zeros((2, 4, 8)), None, cfg, mesh, M.ParallelConfig(expert=2))
