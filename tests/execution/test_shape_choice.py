"""auto's shape rule and the whole_group path: buckets, the choice, its record and report."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.execution import blocked
from moejax.execution import executor as executor_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn, parallel, shape_choice
from moejax.execution import whole_group as wg
from moejax.topology import experts as experts_lib
from tests.configs import moe_config


def test_buckets_are_multiples_of_the_balanced_group_rounded_to_the_grain():
  # M / E = 2048 (the layer suite's coarse shape): 1.03125 x 2048 = 2112, ...
  assert wg.bucket_sizes(16384, 8) == (2112, 2176, 2304, 2560, 3072)
  assert wg.bucket_sizes(40, 5, (1.0, 4.0)) == (8, 32)  # 8 rows each, 32: a multiple of 8
  assert wg.bucket_sizes(10, 1, (1.5,)) == (10,)  # never past the m rows
  with pytest.raises(ValueError, match="bucket_factors"):
    wg.bucket_sizes(16, 2, (0.0,))


@pytest.mark.parametrize("sizes, index", [([8, 8, 0], 0), ([9, 1, 1], 1), ([33, 0, 0], 2),
                                          ([0, 0, 0], 0)])
def test_the_first_bucket_holding_the_largest_group_runs(sizes, index):
  # Buckets of 8 and 32 rows; 2 (past the last) is the tiled fallback.
  assert int(wg.bucket_index(jnp.asarray(sizes, jnp.int32), (8, 32))) == index


def test_gmm_falls_back_to_the_tiled_path_when_no_bucket_holds_a_group():
  m, k, n = 40, 16, 24
  sizes = jnp.asarray([30, 0, 6, 4], jnp.int32)  # 30 rows > 1.5 x 10, the largest bucket
  assert int(wg.bucket_index(sizes, wg.bucket_sizes(m, 4))) == len(wg.bucket_sizes(m, 4))
  ka, kb, kc = jax.random.split(jax.random.PRNGKey(0), 3)
  lhs = jax.random.normal(ka, (m, k))
  rhs = jax.random.normal(kb, (4, k, n))
  cot = jax.random.normal(kc, (m, n))

  def run(backend):
    out, vjp = jax.vjp(lambda a, b: gmm_lib.gmm(a, b, sizes, backend=backend), lhs, rhs)
    return (out,) + vjp(cot)

  for got, want in zip(jax.jit(lambda: run("whole_group"))(), jax.jit(lambda: run("ragged_dot"))()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("factors", [(4.0,), (0.25,)])  # a bucket holds every group / none
def test_whole_group_forward_alone_equals_the_differentiated_one(activation, factors):
  t, d, e, k, f = 12, 8, 3, 2, 6
  ks = jax.random.split(jax.random.PRNGKey(3), 6)
  x = jax.random.normal(ks[0], (t, d))
  ids = jax.random.randint(ks[1], (t, k), 0, e)
  valid = jnp.ones((t, k), bool)
  w = jax.random.uniform(ks[2], (t, k))
  params = {"w_up": jax.random.normal(ks[3], (e, d, f)), "w_down": jax.random.normal(ks[4], (e, f, d))}
  if activation == "swiglu":
    params["w_gate"] = jax.random.normal(ks[5], (e, d, f))
  params = experts_lib.fused_layout(params)
  ffn = lambda p, x, w: grouped_ffn.routed_ffn(p, x, ids, valid, w, num_experts=e,
                                               activation=activation, backend="whole_group",
                                               bucket_factors=factors)
  y_alone = jax.jit(ffn)(params, x, w)
  y_diff, _ = jax.jit(lambda p, x, w: jax.vjp(ffn, p, x, w))(params, x, w)
  np.testing.assert_allclose(y_alone, y_diff, rtol=1e-6, atol=1e-6)
  y_tiled = grouped_ffn.routed_ffn(params, x, ids, valid, w, num_experts=e,
                                   activation=activation, backend="blocked")
  np.testing.assert_allclose(y_alone, y_tiled, rtol=1e-5, atol=1e-5)


def test_the_rule_picks_by_rows_per_expert():
  rule = shape_choice.ShapeRule("blocked", "whole_group", 2048)
  assert rule.pick(16384, 8) == "whole_group"  # exactly 2048 rows per expert
  assert rule.pick(16383, 8) == "blocked"
  assert rule.pick(65536, 64) == "blocked"  # 1024 rows per expert
  assert shape_choice.ShapeRule("blocked").pick(10 ** 6, 1) == "blocked"  # no rule
  # The layer suite prints this line for each shape (what auto runs there).
  plain = shape_choice.Decision(shape_choice.ShapeRule("blocked"), 8192, 2, 8, 512, 1024,
                                "blocked")
  assert plain.line() == ("execution: T=8192 K=2 E=8 d=512 f=1024: 2048 rows per expert "
                          "-> blocked (rule: blocked at every shape)")
  assert "whole_group where token copies / experts >= 2048, else blocked" == rule.describe()


def test_each_distinct_decision_is_reported_once(monkeypatch):
  lines = []
  monkeypatch.setattr(shape_choice, "REPORT", [lines.append])
  monkeypatch.setattr(shape_choice, "_SEEN", {})
  rule = shape_choice.ShapeRule("blocked", "whole_group", 4)
  for _ in range(3):  # training, then the same shape again (a recompile): one line
    assert shape_choice.choose(rule, 16, 2, 8, 32, 64) == "whole_group"
  assert shape_choice.choose(rule, 3, 2, 8, 32, 64) == "blocked"  # decoding: a new shape
  assert lines == [
      "execution: T=16 K=2 E=8 d=32 f=64: 4 rows per expert >= 4 -> whole_group "
      "(rule: whole_group where token copies / experts >= 4, else blocked)",
      "execution: T=3 K=2 E=8 d=32 f=64: 1 rows per expert < 4 -> blocked "
      "(rule: whole_group where token copies / experts >= 4, else blocked)"]
  assert [d.backend for d in shape_choice.decisions()] == ["whole_group", "blocked"]
  shape_choice.choose(shape_choice.ShapeRule("blocked"), 16, 2, 8, 32, 64)  # no rule: silent
  assert len(lines) == 2


def test_shipped_rules_are_the_measured_ones():
  # CPU: the layer suite found whole_group slower than the tiled loop at every shape
  # it measured, so no rule. GPU: auto's ragged_dot switches to whole_group from 1024
  # rows per expert, the smallest group the device check measured it fastest at. TPU: none.
  for platform in ("cpu", "tpu"):
    ex = executor_lib.resolve_execution(C.MoEConfig(), platform).execution
    assert (ex.large_group_backend, ex.large_group_rows) == ("", 0), platform
  gpu = executor_lib.resolve_execution(C.MoEConfig(), "gpu").execution
  assert (gpu.backend, gpu.large_group_backend, gpu.large_group_rows) == (
      "ragged_dot", "whole_group", 1024)
  rule = parallel.shape_rule_for(C.MoEConfig(), "gpu")
  assert rule.pick(16384 * 2, 8) == "whole_group"    # the measured coarse shape
  assert rule.pick(16384 * 8, 64) == "whole_group"   # the fine shape, 2048 rows per expert
  assert rule.pick(16384 * 2, 32) == "whole_group"   # 1024 rows per expert, the smallest measured
  assert rule.pick(16384 * 2, 64) == "ragged_dot"    # 512 rows per expert: unmeasured
  assert gmm_lib.get_backend("ragged_dot").large_groups_on("cpu") == ()
  assert gmm_lib.get_backend("blocked").large_groups_on("cpu") == ()


def test_a_rule_for_any_platform_applies_everywhere(swap_backend):
  swap_backend(dataclasses.replace(
      blocked.BACKEND, auto_large_groups=((gmm_lib.ANY_PLATFORM, "whole_group", 64),)))
  assert gmm_lib.get_backend("blocked").large_groups_on("cpu") == ("whole_group", 64)
  assert gmm_lib.get_backend("blocked").large_groups_on("tpu") == ("whole_group", 64)


def test_resolving_auto_records_the_chosen_backends_rule(swap_backend):
  swap_backend(dataclasses.replace(
      blocked.BACKEND, auto_large_groups=(("cpu", "whole_group", 2048),)))
  ex = executor_lib.resolve_execution(C.MoEConfig(), "cpu").execution
  assert (ex.backend, ex.derived_from) == ("blocked", "auto on cpu")
  assert (ex.large_group_backend, ex.large_group_rows) == ("whole_group", 2048)
  tpu = executor_lib.resolve_execution(C.MoEConfig(), "tpu").execution  # a cpu-only rule
  assert (tpu.large_group_backend, tpu.large_group_rows) == ("", 0)
  own = dataclasses.replace(C.MoEConfig(), execution=C.ExecutionConfig(
      large_group_backend="whole_group", large_group_rows=64))
  assert executor_lib.resolve_execution(own, "cpu").execution.large_group_rows == 64  # kept
  named = moe_config(num_experts=4, expert_width=6, backend="blocked")
  assert executor_lib.resolve_execution(named, "cpu") is named  # a named backend: no rule
  assert executor_lib.local_executor(named).rule == shape_choice.ShapeRule("blocked")
  assert executor_lib.local_executor(C.MoEConfig()).rule == shape_choice.ShapeRule(
      "blocked", "whole_group", 2048)
  # Expert parallelism: the shards' rule, with the gmm backend the shards run.
  assert parallel.shape_rule_for(C.MoEConfig(), "cpu") == shape_choice.ShapeRule(
      "blocked", "whole_group", 2048)
  ref = dataclasses.replace(C.MoEConfig(), execution=C.ExecutionConfig(backend="reference"))
  assert parallel.shape_rule_for(ref, "cpu") == shape_choice.ShapeRule("ragged_dot")


@pytest.mark.parametrize("fields, match", [
    (dict(large_group_rows=64), r"moe\.execution\.large_group_rows.*64.*needs both"),
    (dict(large_group_backend="whole_group"), r"large_group_rows.*0.*needs both"),
    (dict(large_group_backend="whole_grup", large_group_rows=8),
     r"moe\.execution\.large_group_backend.*whole_grup.*did you mean 'whole_group'"),
    (dict(large_group_backend="whole_group", large_group_rows=-1), r"large_group_rows"),
])
def test_a_bad_rule_is_one_error_naming_the_field(fields, match):
  with pytest.raises(C.ConfigError, match=match):
    C.ExecutionConfig(**fields)


def test_the_layer_runs_what_the_rule_picks_and_equals_the_oracle(monkeypatch):
  lines = []
  monkeypatch.setattr(shape_choice, "REPORT", [lines.append])
  monkeypatch.setattr(shape_choice, "_SEEN", {})
  # B*S = 18 tokens, K = 2, E = 4: 9 rows per expert; a threshold of 9 picks whole_group.
  cfg = moe_config(num_experts=4, expert_width=6, routing=dict(top_k=2),
                   execution=dict(backend="blocked", large_group_backend="whole_group",
                                  large_group_rows=9))
  ref = moe_config(num_experts=4, expert_width=6, routing=dict(top_k=2), backend="reference")
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, ref)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 8))

  def run(c, x):
    def loss(p, x):
      y, aux = L.moe_layer(p, x, None, c)
      return jnp.sum(jnp.sin(y)) + aux.losses["total"], y
    (_, y), g = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    return y, g

  y1, g1 = jax.jit(lambda x: run(cfg, x))(x)
  y0, g0 = jax.jit(lambda x: run(ref, x))(x)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert [d.backend for d in shape_choice.decisions()] == ["whole_group"]
  L.moe_layer(params, x[:1, :4], None, cfg)  # 4 tokens: 2 rows per expert, tiled
  assert [d.backend for d in shape_choice.decisions()] == ["whole_group", "blocked"]
  assert len(lines) == 2 and "-> blocked" in lines[1]
