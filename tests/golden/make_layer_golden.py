"""How layer_before_redesign.npz was recorded (kept as a record; it uses the old API).

Run at commit d1bf42e (before the one-composer redesign: flat MoEConfig, the
bias controller inside the layer, losses after capacity) as
``python tests/golden/make_layer_golden.py tests/golden/layer_before_redesign.npz``.
It no longer runs against the current package; tests/test_layer_golden.py
rebuilds the same layers in the sectioned config and compares.
"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from moejax import config as C
from moejax import layer as L

D = 8
CASES = {
  "mixtral": dict(router=dict(top_k=2, gating="topk_softmax")),
  "switch_cap": dict(capacity_factor=1.0, router=dict(top_k=1, gating="scores"),
                     balance=dict(aux_loss_coef=1e-2, aux_loss_convention="switch")),
  "qwen": dict(router=dict(top_k=2, gating="scores"), balance=dict(aux_loss_coef=1e-2, z_loss_coef=1e-3)),
  "deepseek_v3": dict(num_experts=8, router=dict(top_k=2, score_fn="sigmoid", use_bias=True, n_groups=4,
                      topk_groups=2, routed_scaling_factor=2.5),
                      balance=dict(bias_update="sign", bias_rate=1e-2, aux_loss_coef=1e-4, aux_loss_scope="sequence")),
  "sqrtsoftplus": dict(router=dict(top_k=2, score_fn="sqrtsoftplus")),
  "expert_choice": dict(router=dict(kind="expert_choice", options=dict(capacity=2.0)), balance=dict(z_loss_coef=1e-3)),
  "hash": dict(router=dict(kind="hash", top_k=1)),
  "top_p": dict(router=dict(kind="top_p", top_k=3, options=dict(top_p=0.5)), balance=dict(entropy_loss_coef=1e-2)),
  "hierarchical": dict(num_experts=8, router=dict(kind="hierarchical", options=dict(n_families=2, top_k_families=1), top_k=2)),
  "gelu": dict(activation="gelu"),
  "heterogeneous": dict(expert_widths=(2, 6, 4, 6)),
  "shared_zero": dict(num_shared_experts=1, shared_expert_gate=True, zero_experts=1, copy_experts=1,
                      constant_experts=1, router=dict(top_k=2), balance=dict(aux_loss_coef=1e-2)),
  "capacity_score": dict(capacity_factor=1.25, drop_priority="score", router=dict(top_k=2),
                         balance=dict(aux_loss_coef=1e-2, aux_loss_scope="global")),
  "devices_losses": dict(num_experts=8, router=dict(top_k=2),
                         balance=dict(device_loss_coef=0.05, comm_loss_coef=0.02, loss_num_devices=4)),
  "noise": dict(router=dict(top_k=2, input_jitter=0.01, logit_noise=0.5)),
  "blocked": dict(backend="blocked", router=dict(top_k=2), balance=dict(aux_loss_coef=1e-2)),
  "soft": dict(kind="soft", slots_per_expert=2),
  "peer": dict(kind="peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=4),
}

def make(spec):
  spec = dict(spec)
  router = spec.pop("router", {}); balance = spec.pop("balance", {})
  base = dict(num_experts=4, expert_width=6); base.update(spec)
  return C.from_dict(C.MoEConfig, {**base, "router": router, "balance": balance})

out = {}
for name, spec in CASES.items():
  cfg = make(spec)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, D))
  ids = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 0, 256)
  r = jax.random.normal(jax.random.PRNGKey(3), (2, 6, D))
  rng = jax.random.PRNGKey(4)
  state = L.init_router_state(cfg)
  if cfg.kind == "sparse":
    state = state.replace(bias=jnp.linspace(-0.1, 0.1, cfg.num_routed))
  def f(p, xx):
    y, ns, aux = L.moe_layer(p, xx, state, cfg, token_ids=ids, rng=rng, train=True)
    return jnp.sum(y * r), (y, aux, ns)
  def g(p, xx):
    y, ns, aux = L.moe_layer(p, xx, state, cfg, token_ids=ids, rng=rng, train=True)
    return aux["losses"]["total"]
  (_, (y, aux, ns)), (gp, gx) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
  lp, lx = jax.grad(g, argnums=(0, 1))(params, x)
  rec = {"y": y, "gx": gx, "loss": aux["losses"]["total"], "lx": lx}
  for path, leaf in jax.tree_util.tree_flatten_with_path(gp)[0]:
    rec["gp/" + "/".join(str(getattr(k, "key", k)) for k in path)] = leaf
  for path, leaf in jax.tree_util.tree_flatten_with_path(lp)[0]:
    rec["lp/" + "/".join(str(getattr(k, "key", k)) for k in path)] = leaf
  for k, v in aux.get("losses", {}).items():
    rec["losses/" + k] = v
  if "load" in aux: rec["load"] = aux["load"]
  if cfg.kind == "sparse":
    rec["bias"] = ns.bias
    rec["expert_ids"] = aux["routing"].expert_ids
    rec["valid"] = aux["routing"].valid
  for k, v in rec.items():
    out[f"{name}|{k}"] = np.asarray(v)
  print(name, float(aux["losses"]["total"]), float(jnp.abs(y).sum()))
np.savez_compressed(sys.argv[1], **out)
json.dump(CASES, open(sys.argv[1] + ".cases.json", "w"), indent=1)
