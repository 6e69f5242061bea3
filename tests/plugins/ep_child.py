"""Child of test_plugin_router.py: the plugin cosine router under ``ep_moe_layer``.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/plugins/ep_child.py``. The
expert-parallel layer (8 devices on the expert axis, token dispatch) must
equal the single-device reference layer on the whole batch: outputs,
gradients and the bias controller's update. Prints ``OK cosine``.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax.numpy as jnp  # noqa: E402

from moejax import config as C  # noqa: E402
from moejax import layer as L  # noqa: E402
from moejax.execution import mesh as mesh_lib  # noqa: E402
from tests.configs import moe_config  # noqa: E402
from tests.parallel import ep_common as H  # noqa: E402
from tests.plugins import cosine_router  # noqa: E402,F401  (registers 'cosine')


def main():
  cfg = moe_config(num_experts=8, expert_width=8, backend="reference",
                   routing=dict(kind="cosine", top_k=2, use_bias=True,
                                options=dict(proj_dim=4, temperature=0.2)),
                   balance=dict(aux_loss_coef=1e-2, aux_loss_scope="global",
                                bias_update="sign", bias_rate=1e-2))
  pcfg = C.ParallelConfig(expert=8)
  mesh = mesh_lib.make_mesh(pcfg, cfg=cfg)
  params, x, ids = H.inputs(cfg)
  state = L.init_router_state(cfg)
  state = state.replace(bias=jnp.linspace(-0.2, 0.2, cfg.num_routed))
  y, st, _, g = H.ep_fn(cfg, mesh, pcfg, train=True)(params, x, ids, state)
  y0, st0, _, g0 = H.full_fn(cfg, train=True)(params, x, ids, state)
  H.close(y, y0, "y")
  H.close_tree(g, g0, "grads")
  H.close(st.bias, st0.bias, "controller bias")
  print("OK cosine")


if __name__ == "__main__":
  main()
