"""The routing context: what route() hands a router about its batch, and who gets it.

A batch split over a named axis is simulated in process with ``jax.vmap(...,
axis_name=...)`` (psum and all_gather work there as under shard_map); the
8-device ``ep_moe_layer`` checks are tests/plugins/test_batch_wide_plugin.py.
"""

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.routing import ROUTERS, RouterSpec, register, spec
from moejax.routing.router import route
from moejax.routing.topk import select_topk
from moejax.routing.types import RoutingContext
from tests.routing.util import identity_route_inputs, make_cfg, random_logits


def _doc_examples() -> list[str]:
  """The code blocks of moejax.routing.spec's docstring (the indented text after '::')."""
  blocks = re.findall(r"::\n\n((?:    .*\n|\n)+)", spec.__doc__)
  return [textwrap.dedent(b) for b in blocks]


def test_the_spec_docstring_examples_run_as_written():
  blocks = _doc_examples()
  assert len(blocks) == 2 and "Tempered" in blocks[0] and "context" in blocks[1]
  ns = {}
  try:
    for block in blocks:
      exec(compile(block, "moejax.routing.spec docstring", "exec"), ns)  # noqa: S102
    logits = random_logits(0, 6, 4)
    x, w = identity_route_inputs(logits)
    tempered = make_cfg(kind="tempered", top_k=2, temperature=0.5)
    np.testing.assert_array_equal(route({"w": w}, x, None, tempered).expert_ids,
                                  select_topk(logits / 0.5, None, tempered).expert_ids)
    centred = make_cfg(kind="centred", top_k=1)
    got = route({"w": w}, x, None, centred)
    want = select_topk(logits - jnp.mean(logits, axis=0), None, centred)
    np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-6)
    # Centring changes the decision here, so the example's context is really read.
    assert not np.array_equal(got.expert_ids, select_topk(logits, None, centred).expert_ids)
    with pytest.raises(C.ConfigError, match=r"options\.temperature=0.0: must be > 0"):
      make_cfg(kind="tempered", temperature=0.0)
  finally:
    for name in ("tempered", "centred"):
      ROUTERS.unregister(name)


def test_one_device_helpers_are_plain_reductions():
  ctx = RoutingContext.build(3, batch_shape=(1, 3), train=True)
  x = jnp.asarray([[1.0, -2.0], [3.0, 0.0], [2.0, 5.0]])
  assert (ctx.axis_names, ctx.num_tokens, ctx.local_tokens, ctx.num_shards, ctx.train) == (
      (), 3, 3, 1, True)
  np.testing.assert_array_equal(ctx.sum(x), [6.0, 3.0])
  np.testing.assert_array_equal(ctx.mean(x), [2.0, 1.0])
  np.testing.assert_array_equal(ctx.max(x), [3.0, 5.0])
  np.testing.assert_array_equal(ctx.gather(x), x)
  assert int(ctx.token_offset()) == 0 and ctx.psum(7.0) == 7.0
  with pytest.raises(ValueError, match=r"batch_shape=\(2, 2\) holds 4 tokens, not 3"):
    RoutingContext.build(3, batch_shape=(2, 2))


def test_helpers_over_a_named_axis_reduce_the_whole_batch():
  x = jnp.arange(12.0).reshape(4, 3, 1)  # 4 shards of 3 tokens; token t holds t

  def per_shard(xs):
    ctx = RoutingContext.build(3, "shard")
    return (ctx.num_tokens, ctx.num_shards), ctx.sum(xs), ctx.mean(xs), ctx.max(xs), \
        ctx.gather(xs), ctx.token_offset()

  (n, shards), s, m, mx, g, off = jax.vmap(per_shard, axis_name="shard")(x)
  assert int(n[0]) == 12 and int(shards[0]) == 4
  np.testing.assert_array_equal(s[:, 0], [66.0] * 4)
  np.testing.assert_array_equal(m[:, 0], [5.5] * 4)
  np.testing.assert_array_equal(mx[:, 0], [11.0] * 4)
  np.testing.assert_array_equal(g[2, :, 0], np.arange(12.0))
  np.testing.assert_array_equal(off, [0, 3, 6, 9])


class _Recorder(RouterSpec):
  """A batch-wide top-k that records the contexts it was handed."""

  name = "ctx_recorder"
  batch_wide = True
  seen: list = []

  def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
    self.seen.append(context)
    return select_topk(x @ params["w"], bias, cfg)


class _OldStyle(RouterSpec):
  """A plugin written before the context existed: no ``context`` parameter."""

  name = "ctx_old_style"

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return select_topk(x @ params["w"], bias, cfg)


class _BatchWideBlind(_OldStyle):
  """Declares itself batch-wide but takes no context: it cannot see the batch's split."""

  name = "ctx_blind"
  batch_wide = True


class _BatchWideLocalOnly(_Recorder):
  """Batch-wide and declares it cannot decide on a split batch."""

  name = "ctx_local_only"
  expert_parallel = False


@pytest.fixture(scope="module")
def plugins():
  specs = [_Recorder(), _OldStyle(), _BatchWideBlind(), _BatchWideLocalOnly()]
  for s in specs:
    register(s)
  yield {s.name: s for s in specs}
  for s in specs:
    ROUTERS.unregister(s.name)


def test_the_layer_hands_the_context_only_to_routers_that_take_it(plugins):
  assert plugins["ctx_recorder"].reads_context and not plugins["ctx_old_style"].reads_context
  assert not ROUTERS.get("topk").reads_context and ROUTERS.get("sbase").reads_context
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  _Recorder.seen.clear()
  outs = {}
  for kind in ("ctx_recorder", "ctx_old_style", "topk"):
    cfg = C.from_dict(C.MoEConfig, {"topology": {"num_experts": 4, "expert_width": 8},
                                    "routing": {"kind": kind, "top_k": 2}})
    params = L.init_moe_params(jax.random.key(1), 8, cfg)
    outs[kind] = L.moe_layer(params, x, None, cfg, train=True)[0]
  assert _Recorder.seen == [RoutingContext((), 10, 10, (2, 5), True)]
  # The same rule with and without the context: the old signature still routes.
  np.testing.assert_allclose(outs["ctx_recorder"], outs["ctx_old_style"], rtol=1e-6)
  np.testing.assert_allclose(outs["ctx_old_style"], outs["topk"], rtol=1e-6)


def test_a_batch_wide_router_that_cannot_see_the_split_is_refused_in_one_line(plugins):
  blind, local = plugins["ctx_blind"], plugins["ctx_local_only"]
  assert ROUTERS.get("topk").why_not_expert_parallel == ""
  assert ROUTERS.get("sbase").why_not_expert_parallel == ""
  assert "batch_wide=True but its route() takes no context" in blind.why_not_expert_parallel
  assert "declares expert_parallel=False" in local.why_not_expert_parallel
  for name, capability in (("ctx_blind", "batch_wide=True"),
                           ("ctx_local_only", "expert_parallel=False")):
    cfg = make_cfg(num_experts=4, kind=name, top_k=1)
    with pytest.raises(C.ConfigError) as err:  # the trainer and ep_moe_layer's check
      C.check_experts(C.ParallelConfig(expert=2), cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"moe.routing.kind={name!r}: ")
    assert capability in msg and "Fix: use parallel.expert=1" in msg
    # route() inside a split batch (any mesh axis, not only the expert one): refused at trace.
    params = {"w": jnp.zeros((8, 4))}
    calls = len(_Recorder.seen)
    with pytest.raises(ValueError, match=rf"^moe\.routing\.kind={name!r}: .*{re.escape(capability)}"
                                         r".*split over \('shard',\)\)\. Fix: "):
      jax.vmap(lambda xs: route(params, xs, None, cfg, context=RoutingContext.build(
          3, "shard")), axis_name="shard")(jnp.ones((2, 3, 8)))
    assert len(_Recorder.seen) == calls  # refused before the router ran
    route(params, jnp.ones((3, 8)), None, cfg)  # one device: both run


def test_route_refuses_a_context_that_does_not_describe_x():
  cfg = make_cfg(num_experts=4, top_k=1)
  params = {"w": jnp.zeros((8, 4))}
  with pytest.raises(ValueError, match=r"describes 4 tokens with train=False, but x has 3 "
                                       r"and train=True"):
    route(params, jnp.ones((3, 8)), None, cfg, train=True,
          context=RoutingContext.build(4))
  with pytest.raises(TypeError, match="context must be a RoutingContext, got dict"):
    route(params, jnp.ones((3, 8)), None, cfg, context={})
