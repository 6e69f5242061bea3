"""Child of test_remoe_ep.py: ReMoE under ``ep_moe_layer`` on 8 simulated devices.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/routing/remoe_ep_child.py GROUP...``
(tests/parallel/children.py prints ``OK <group>`` / ``FAILED <group>``).

* ``layer``: the expert-parallel layer equals the single-device layer on the
  whole batch: outputs, gradients, losses (the L1 penalty with lambda from
  the state), metrics (the realised active experts) and the observations.
* ``target``: lambda's update is per token: the same from one device, from
  8 devices, and from the batch seen as two halves (micro-batches) whose
  observations add up, and it moves lambda by exactly alpha**sign(a - k).
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
from moejax.routing import state as state_lib  # noqa: E402
from tests.configs import moe_config  # noqa: E402
from tests.parallel import children  # noqa: E402
from tests.parallel import ep_common as H  # noqa: E402

PCFG = C.ParallelConfig(data=2, expert=4)
K, ALPHA, LAMBDA0 = 2, 1.5, 0.01


def _cfg():
  return moe_config(num_experts=8, expert_width=8, backend="reference",
                    routing=dict(kind="remoe", top_k=K,
                                 options=dict(l1_init=LAMBDA0, alpha=ALPHA)),
                    balance=dict(extra_losses=(("remoe_l1", 1.0),)))


def _both(cfg):
  mesh = mesh_lib.make_mesh(PCFG, cfg=cfg)
  params, x, ids = H.inputs(cfg)
  state = L.init_router_state(cfg)
  ep = H.ep_fn(cfg, mesh, PCFG, train=True)(params, x, ids, state)
  one = H.full_fn(cfg, train=True)(params, x, ids, state)
  return params, x, ids, state, ep, one


def group_layer():
  cfg = _cfg()
  _, _, _, _, (y, _, aux, g), (y0, _, aux0, g0) = _both(cfg)
  H.close(y, y0, "y")
  H.close_tree(g, g0, "grads")
  H.close_tree(aux.losses, aux0.losses, "losses")
  H.close_tree(aux.metrics, aux0.metrics, "metrics")
  H.close_tree(aux.observed, aux0.observed, "observed")
  assert float(aux0.losses["remoe_l1"]) > 0
  print(f"  active experts per token {float(aux0.metrics.active_mean):.3f} on one device "
        f"and {float(aux.metrics.active_mean):.3f} on 8", flush=True)


def group_target():
  cfg = _cfg()
  params, x, ids, state, (_, _, aux, _), (_, _, aux0, _) = _both(cfg)
  tokens = x.shape[0] * x.shape[1]
  assert float(aux.observed["remoe"]["tokens"]) == tokens  # the batch's, not a device's
  halves = [L.moe_layer(params, x[i::2], state, cfg, token_ids=ids[i::2], train=True)[1]
            for i in (0, 1)]
  summed = jax.tree.map(jnp.add, halves[0].observed, halves[1].observed)
  a = float(aux0.observed["remoe"]["active"]) / tokens
  want = LAMBDA0 * ALPHA ** np.sign(a - K)
  for what, seen in (("8 devices", aux.observed), ("1 device", aux0.observed),
                     ("two halves", summed)):
    new = state_lib.update(cfg, state.ideas, seen)["remoe"]["coef"]
    np.testing.assert_allclose(float(new), want, rtol=1e-6, err_msg=what)
  H.close(a, aux.metrics.active_mean, "realised per token = the logged active experts")
  print(f"  a = {a:.3f} per token (k = {K}): lambda {LAMBDA0} -> {want:.4g} on 1 device, "
        "8 devices and two halves", flush=True)


GROUPS = {"layer": group_layer, "target": group_target}

if __name__ == "__main__":
  sys.exit(children.run_groups(GROUPS, sys.argv[1:] or list(GROUPS)))
