"""Child of test_batch_wide_plugin.py: batch-wide routers under ``ep_moe_layer`` on 8 devices.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/plugins/batch_wide_child.py GROUP...``.
Groups (tests/parallel/children.py prints ``OK <group>`` / ``FAILED <group>``):

* ``plugin``: tests/plugins/sinkhorn_router.py's ``balanced_sinkhorn`` (a plugin,
  batch-wide through its RoutingContext) equals the single-device layer on
  the whole batch: outputs, loads, losses, metrics, routing and gradients;
  the same rule run on each device's share alone does not.
* ``sbase``: the shipped S-BASE router in training (Sinkhorn, batch-wide), the
  same way.
* ``expert_choice``: the shipped expert choice with ``scope='batch'`` (each
  expert's top C among every token of the batch) the same way; ``group``
  (per device) is tests/parallel/test_ep.py's per-shard case.
* ``refused``: ``balanced_sinkhorn_local`` declares ``expert_parallel=False``:
  ``ep_moe_layer`` refuses it in one line naming the router and the
  capability, before its route() ever runs.
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
from tests.configs import moe_config  # noqa: E402
from tests.parallel import children  # noqa: E402
from tests.parallel import ep_common as H  # noqa: E402
from tests.plugins import sinkhorn_router  # noqa: E402  (registers the kinds)

N = 8
PCFG = C.ParallelConfig(data=2, expert=4)


def _cfg(routing):
  return moe_config(num_experts=8, expert_width=8, backend="reference", routing=routing,
                    balance=dict(aux_loss_coef=1e-2, aux_loss_scope="global"))


def _equal_to_one_device(cfg, train, what):
  mesh = mesh_lib.make_mesh(PCFG, cfg=cfg)
  params, x, ids = H.inputs(cfg)
  state = L.init_router_state(cfg)
  y, _, aux, g = H.ep_fn(cfg, mesh, PCFG, train=train)(params, x, ids, state)
  y0, _, aux0, g0 = H.full_fn(cfg, train=train)(params, x, ids, state)
  H.close(y, y0, f"{what} y")
  H.close_tree(g, g0, f"{what} grads")
  H.close(aux.load, aux0.load, f"{what} load")
  H.close(aux.router_load, aux0.router_load, f"{what} router_load")
  H.close_tree(aux.losses, aux0.losses, f"{what} losses")
  H.close_tree(aux.metrics, aux0.metrics, f"{what} metrics")
  np.testing.assert_array_equal(aux.routing.expert_ids, aux0.routing.expert_ids, err_msg=what)
  return params, x, ids, state, y0, aux0


def _differs_per_shard(cfg, params, x, ids, state, y0, aux0, train, what):
  """Each device's share routed alone gives another decision (the check is not vacuous)."""
  def alone(xs, i):
    r = L.moe_layer(params, xs, state, cfg, token_ids=i, train=train)[1].routing
    return jnp.where(r.valid, r.expert_ids, -1)

  local = jax.jit(jax.vmap(alone))(x.reshape((N, -1) + x.shape[1:]), ids.reshape(N, -1))
  local = np.asarray(local).reshape(-1, local.shape[-1])
  whole = np.where(aux0.routing.valid, aux0.routing.expert_ids, -1)
  assert not np.array_equal(local, whole), what
  print(f"  {what}: {int((local != whole).sum())} slots differ when each device routes its "
        "share alone", flush=True)


def group_plugin():
  cfg = _cfg(dict(kind="balanced_sinkhorn", top_k=2, options=dict(iterations=6)))
  out = _equal_to_one_device(cfg, True, "balanced_sinkhorn")
  _differs_per_shard(cfg, *out, True, "balanced_sinkhorn")
  print("  ok balanced_sinkhorn (plugin)", flush=True)


def group_sbase():
  cfg = _cfg(dict(kind="sbase", top_k=2, gating="scores"))
  out = _equal_to_one_device(cfg, True, "sbase train")
  _differs_per_shard(cfg, *out, True, "sbase train")
  # (Evaluation is the greedy top-k, token-local: tests/routing/test_sbase.py.)
  print("  ok sbase (train: Sinkhorn over the batch)", flush=True)


def group_expert_choice():
  cfg = _cfg(dict(kind="expert_choice", options=dict(capacity=2.0, scope="batch")))
  out = _equal_to_one_device(cfg, True, "expert_choice batch")
  _differs_per_shard(cfg, *out, True, "expert_choice batch")
  print("  ok expert_choice scope=batch", flush=True)


def group_refused():
  cfg = _cfg(dict(kind="balanced_sinkhorn_local", top_k=2))
  mesh = mesh_lib.make_mesh(PCFG)  # without cfg: the layer itself must refuse
  params, x, ids = H.inputs(cfg)
  try:
    L.ep_moe_layer(params, x, None, cfg, mesh, PCFG, token_ids=ids, train=True)
  except C.ConfigError as err:
    msg = str(err)
  else:
    raise AssertionError("ep_moe_layer ran a router that declares expert_parallel=False")
  print("  refused:", msg, flush=True)
  assert "\n" not in msg, msg
  assert msg.startswith("moe.routing.kind='balanced_sinkhorn_local': batch-wide router "
                        "'balanced_sinkhorn_local' declares expert_parallel=False"), msg
  assert msg.endswith("Fix: use parallel.expert=1 or another router"), msg
  assert sinkhorn_router.BalancedSinkhornLocal.calls == 0


GROUPS = {"plugin": group_plugin, "sbase": group_sbase, "expert_choice": group_expert_choice,
          "refused": group_refused}

if __name__ == "__main__":
  sys.exit(children.run_groups(GROUPS, sys.argv[1:] or list(GROUPS)))
