"""Child of test_replay_ep.py: routing replay under ``ep_moe_layer`` on 8 simulated devices.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/routing/replay_ep_child.py GROUP...``
(tests/parallel/children.py prints ``OK <group>`` / ``FAILED <group>``).

* ``equal``: replaying a selection the router would not make, the
  expert-parallel layer equals the single-device layer on the whole batch:
  outputs, gradients (the router's through the recomputed weights), losses,
  loads and the selection itself;
* ``own``: the expert-parallel layer's own selection (``aux.selection``, in
  global token order) replays its forward bit for bit.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moejax import config as C  # noqa: E402
from moejax import layer as L  # noqa: E402
from moejax.execution import mesh as mesh_lib  # noqa: E402
from moejax.routing.replay import RoutingReplay  # noqa: E402
from tests.parallel import children  # noqa: E402
from tests.parallel import ep_common as H  # noqa: E402

PCFG = C.ParallelConfig(data=2, expert=4)
CASES = ("mixtral", "deepseek_v3")


def _lowest(params, x, cfg):
  """Each token's K lowest-logit experts: a selection the router would not make."""
  logits = jnp.einsum("bsd,de->bse", x, params["router"]["w"])
  ids = jnp.argsort(logits, axis=-1)[..., :cfg.routing.top_k].astype(jnp.int32)
  return RoutingReplay(ids, jnp.ones(ids.shape, bool))


def _fns(cfg, mesh, state, ids):
  def ep(params, x, replay):
    def loss(p, x):
      y, aux = L.ep_moe_layer(p, x, state, cfg, mesh, PCFG, token_ids=ids, train=True,
                              replay=replay)
      return jnp.sum(jnp.sin(y)) + aux.losses["total"], (y, aux)
    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)

  def one(params, x, replay):
    def loss(p, x):
      y, aux = L.moe_layer(p, x, state, cfg, token_ids=ids, train=True, replay=replay)
      return jnp.sum(jnp.sin(y)) + aux.losses["total"], (y, aux)
    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
  return jax.jit(ep), jax.jit(one)


def group_equal():
  for name in CASES:
    cfg = H.make_cfg(name)
    mesh = mesh_lib.make_mesh(PCFG, cfg=cfg)
    params, x, ids = H.inputs(cfg)
    state = L.init_router_state(cfg)
    replay = _lowest(params, x, cfg)
    ep, one = _fns(cfg, mesh, state, ids)
    (_, (y, aux)), g = ep(params, x, replay)
    (_, (y0, aux0)), g0 = one(params, x, replay)
    want = np.asarray(replay.expert_ids).reshape(-1, cfg.routing.top_k)
    np.testing.assert_array_equal(np.asarray(aux.selection.expert_ids), want)
    np.testing.assert_array_equal(np.asarray(aux0.selection.expert_ids), want)
    H.close(y, y0, f"{name} y")
    H.close_tree(g, g0, f"{name} grads")
    assert np.abs(np.asarray(g[0]["router"]["w"])).max() > 0
    H.close_tree(aux.losses, aux0.losses, f"{name} losses")
    H.close(aux.router_load, aux0.router_load, f"{name} router_load", tol=0)
    print(f"  {name}: replay on 8 devices = replay on one", flush=True)


def group_own():
  for name in CASES:
    cfg = H.make_cfg(name)
    mesh = mesh_lib.make_mesh(PCFG, cfg=cfg)
    params, x, ids = H.inputs(cfg)
    state = L.init_router_state(cfg)
    run = jax.jit(lambda p, x, r: L.ep_moe_layer(p, x, state, cfg, mesh, PCFG, token_ids=ids,
                                                  replay=r))
    y, aux = run(params, x, None)
    y2, aux2 = run(params, x, aux.selection.reshape(*x.shape[:2]))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    jax.tree.map(np.testing.assert_array_equal, aux2.losses, aux.losses)
    print(f"  {name}: the expert-parallel layer's own selection replays it bit for bit",
          flush=True)


GROUPS = {"equal": group_equal, "own": group_own}

if __name__ == "__main__":
  sys.exit(children.run_groups(GROUPS, sys.argv[1:] or list(GROUPS)))
