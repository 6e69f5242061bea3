"""Child of test_consistency_ep.py: the expert-parallel perturbations on 8 simulated devices.

Run as ``JAX_NUM_CPU_DEVICES=8 python tests/serve/consistency_ep_child.py GROUP...``
(tests/parallel/children.py prints ``OK <group>`` / ``FAILED <group>``).

* ``hash``: hash routing flips nothing under ep1 / ep2 / ep8;
* ``topk``: top-k under ep1 / ep2 / ep8 keeps the first MoE layer's routing
  (its input, attention on replicated weights, is the same) and the flip
  rates of later layers are shares in [0, 1].
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from moejax.config import ModelConfig, RoutingConfig  # noqa: E402
from moejax.model import Transformer  # noqa: E402
from moejax.serve import routing_consistency as rc  # noqa: E402
from tests.configs import moe_config  # noqa: E402
from tests.parallel import children  # noqa: E402

NAMES = ("ep1", "ep2", "ep8")
TOKENS = np.asarray(jax.random.randint(jax.random.key(0), (8, 6), 0, 32, jnp.int32))


def _model(**routing):
  cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    dense_ff_width=64, moe=moe_config(num_experts=8, expert_width=16,
                                                      routing=RoutingConfig.build(**routing)))
  return Transformer(cfg, rngs=nnx.Rngs(0))


def group_hash():
  assert jax.device_count() == 8, jax.device_count()
  got = rc.measure(_model(kind="hash", top_k=2), TOKENS, NAMES)
  for name in NAMES:
    assert got[name]["flip_rate"] == 0.0 and got[name]["token_flip_share"] == 0.0, got
    print(f"  hash under {name}: no flip", flush=True)


def group_topk():
  got = rc.measure(_model(kind="topk", top_k=2), TOKENS, NAMES)
  for name in NAMES:
    row = got[name]
    assert row["layer_flip_rate"]["layer_0"] == 0.0, row
    assert 0.0 <= row["flip_rate"] <= 1.0 and 0.0 <= row["token_flip_share"] <= 1.0, row
    print(f"  top-k under {name}: flip rate {row['flip_rate']:.4f}", flush=True)


GROUPS = {"hash": group_hash, "topk": group_topk}

if __name__ == "__main__":
  sys.exit(children.run_groups(GROUPS, sys.argv[1:] or list(GROUPS)))
