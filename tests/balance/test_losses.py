"""Balance losses: hand-computed values, conventions, properties, the config bundle."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax.balance import losses as L
from tests.balance.helpers import make_result, uniform_probs
from tests.configs import moe_config

# T=4 tokens, E=3 experts, K=2 slots. P = mean probs = [0.425, 0.375, 0.2].
IDS = [[0, 1], [0, 2], [1, 0], [0, 1]]
PROBS = [[0.5, 0.3, 0.2],
         [0.6, 0.1, 0.3],
         [0.2, 0.7, 0.1],
         [0.4, 0.4, 0.2]]


def hand():
  return make_result(IDS, PROBS)


def test_switch_convention_counts_top1_only():
  # top-1 ids [0,0,1,0] -> frac [3/4, 1/4, 0]; 3 * (.75*.425 + .25*.375) = 1.2375
  got = L.load_balance_loss(hand(), convention="switch", num_experts=3)
  np.testing.assert_allclose(got, 1.2375, rtol=1e-6)


def test_topk_convention_counts_every_slot_deepseek_form():
  # counts [4,3,1] over K T = 8 slots; DeepSeek f = E/(KT) count = [1.5, 1.125, .375]
  # sum f P = .6375 + .421875 + .075 = 1.134375
  got = L.load_balance_loss(hand(), convention="topk", num_experts=3)
  np.testing.assert_allclose(got, 1.134375, rtol=1e-6)


def test_topk_invalid_slot_not_counted_but_denominator_stays_kt():
  valid = np.ones((4, 2), bool)
  valid[3, 1] = False  # token 3 loses its copy on expert 1: counts [4,2,1] / 8
  r = make_result(IDS, PROBS, valid=valid)
  got = L.load_balance_loss(r, convention="topk", num_experts=3)
  np.testing.assert_allclose(got, 3 * (0.5 * 0.425 + 0.25 * 0.375 + 0.125 * 0.2), rtol=1e-6)


def test_switch_convention_skips_invalid_top1_slot():
  valid = np.ones((4, 2), bool)
  valid[2, 0] = False  # token 2's top-1 (expert 1) is gone: counts [3,0,0] / T=4
  r = make_result(IDS, PROBS, valid=valid)
  got = L.load_balance_loss(r, convention="switch", num_experts=3)
  np.testing.assert_allclose(got, 3 * 0.75 * 0.425, rtol=1e-6)


def test_num_experts_below_outputs_ignores_zero_compute_columns():
  # Expert 2 as a zero-computation expert: counts [4,3] / 8, P = [.425, .375].
  got = L.load_balance_loss(hand(), convention="topk", num_experts=2)
  np.testing.assert_allclose(got, 2 * (0.5 * 0.425 + 0.375 * 0.375), rtol=1e-6)


def test_gradient_flows_through_probs_only():
  # d/dprobs[t, i] of E sum_i frac_i mean_t probs[t, i] = E frac_i / T.
  r = hand()
  g = jax.grad(lambda p: L.load_balance_loss(r.replace(probs=p), convention="topk",
                                             num_experts=3))(r.probs)
  frac = np.array([0.5, 0.375, 0.125])
  np.testing.assert_allclose(g, np.broadcast_to(3 * frac / 4, (4, 3)), rtol=1e-6)


def test_bad_arguments_fail_early():
  with pytest.raises(ValueError, match="convention='swtich'"):
    L.load_balance_loss(hand(), convention="swtich", num_experts=3)
  with pytest.raises(ValueError, match="num_experts=4 must be in"):
    L.load_balance_loss(hand(), convention="topk", num_experts=4)
  with pytest.raises(ValueError, match="B\\*S=6 but .* T=4"):
    L.sequence_balance_loss(hand(), batch_shape=(2, 3), num_experts=3)
  with pytest.raises(ValueError, match="num_devices=2 must be a positive divisor"):
    L.device_balance_loss(hand(), num_experts=3, num_devices=2)


def test_sequence_loss_is_mean_of_per_sequence_losses():
  # seq 0 = tokens 0,1: counts [2,1,1]/4, P [.55,.2,.25] -> 3*.3875 = 1.1625
  # seq 1 = tokens 2,3: counts [2,2,0]/4, P [.3,.55,.15] -> 3*.425  = 1.275
  got = L.sequence_balance_loss(hand(), batch_shape=(2, 2), convention="topk",
                                num_experts=3)
  np.testing.assert_allclose(got, (1.1625 + 1.275) / 2, rtol=1e-6)
  # One sequence of the whole batch is the batch loss.
  np.testing.assert_allclose(
      L.sequence_balance_loss(hand(), batch_shape=(1, 4), num_experts=3),
      L.load_balance_loss(hand(), convention="topk", num_experts=3), rtol=1e-6)


def test_z_loss_hand():
  # logsumexp([0,0]) = ln 2, logsumexp([ln2, ln2]) = 2 ln 2 -> mean(ln2^2, 4 ln2^2)
  logits = jnp.array([[0.0, 0.0], [math.log(2), math.log(2)]])
  np.testing.assert_allclose(L.z_loss(logits), 2.5 * math.log(2) ** 2, rtol=1e-6)


def test_entropy_loss_hand_and_finite_gradient_at_zero():
  probs = jnp.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
  np.testing.assert_allclose(L.entropy_loss(probs), math.log(2) / 2, rtol=1e-6)
  g = jax.grad(L.entropy_loss)(probs)
  assert np.all(np.isfinite(g))
  # d/dp (-p ln p) / T = (-ln p - 1) / 2 at p = 1/2.
  np.testing.assert_allclose(g[0, :2], (math.log(2) - 1) / 2, rtol=1e-6)


# DeepSeek-V2 losses: E=4 experts in D=2 devices {0,1} {2,3}, K=2, T=2.
DEV_IDS = [[0, 1], [0, 2]]
DEV_PROBS = [[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1]]


def test_device_balance_loss_hand():
  # counts [2,1,1,0], f = E/(KT) count = [2,1,1,0] -> f' = [1.5, .5]
  # P = [.45,.2,.25,.1] -> P' = [.65, .35]; 1.5*.65 + .5*.35 = 1.15
  r = make_result(DEV_IDS, DEV_PROBS)
  np.testing.assert_allclose(L.device_balance_loss(r, num_experts=4, num_devices=2),
                             1.15, rtol=1e-6)


def test_comm_balance_loss_counts_each_device_once_per_token():
  # token 0 -> experts 0,1 both on device 0: sent [1,0]; token 1 -> [1,1].
  # M=2: f'' = D/(M T) [2,1] = [1, .5] -> .65 + .5*.35 = .825
  r = make_result(DEV_IDS, DEV_PROBS)
  np.testing.assert_allclose(
      L.comm_balance_loss(r, num_experts=4, num_devices=2, max_devices=2), 0.825, rtol=1e-6)
  # M=1: f'' = [2, 1] -> 1.3 + .35
  np.testing.assert_allclose(
      L.comm_balance_loss(r, num_experts=4, num_devices=2, max_devices=1), 1.65, rtol=1e-6)
  with pytest.raises(ValueError, match="max_devices=3"):
    L.comm_balance_loss(r, num_experts=4, num_devices=2, max_devices=3)


def test_device_losses_ignore_zero_compute_slots():
  # A 5th router output (id 4) is a zero-computation expert: no device, no count.
  probs = [[0.4, 0.3, 0.2, 0.0, 0.1], [0.5, 0.1, 0.2, 0.1, 0.1]]
  r = make_result([[0, 4], [0, 2]], probs)
  # counts [2,0,1,0], f = 4/4 count -> f' = [1, .5]
  # P = [.45, .2, .2, .05] (column 4 ignored) -> P' = [.65, .25]
  np.testing.assert_allclose(L.device_balance_loss(r, num_experts=4, num_devices=2),
                             0.65 + 0.5 * 0.25, rtol=1e-6)


# -- properties ---------------------------------------------------------------
# Shapes come from a few fixed choices and the losses are jitted, so examples
# vary content without recompiling every op.

lb_loss = jax.jit(L.load_balance_loss, static_argnames=("convention", "num_experts"))
dev_loss = jax.jit(L.device_balance_loss, static_argnames=("num_experts", "num_devices"))
comm_loss = jax.jit(L.comm_balance_loss,
                    static_argnames=("num_experts", "num_devices", "max_devices"))


def _random_probs(seed, t, e):
  logits = np.random.default_rng(seed).normal(size=(t, e)) * 3
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(e=st.sampled_from([1, 4]), k=st.sampled_from([1, 2]),
                  seed=st.integers(0, 10_000), convention=st.sampled_from(["switch", "topk"]))
def test_uniform_counts_give_exactly_one_for_any_probs(e, k, seed, convention):
  k = min(k, e)
  t = 8
  perm = np.random.default_rng(seed).permutation(e)
  ids = [[perm[(i + j) % e] for j in range(k)] for i in range(t)]  # every slot uniform
  r = make_result(ids, _random_probs(seed, t, e))
  np.testing.assert_allclose(lb_loss(r, convention=convention, num_experts=e), 1.0,
                             rtol=1e-5)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(e=st.sampled_from([2, 5]), seed=st.integers(0, 10_000),
                  convention=st.sampled_from(["switch", "topk"]))
def test_uniform_probs_give_exactly_one_for_any_routing(e, seed, convention):
  ids = np.random.default_rng(seed).integers(0, e, size=(6, 2))
  r = make_result(ids, uniform_probs(6, e))
  np.testing.assert_allclose(lb_loss(r, convention=convention, num_experts=e), 1.0,
                             rtol=1e-5)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 10_000))
def test_loss_between_zero_and_e_and_e_at_collapse(seed):
  t, e = 6, 4
  rng = np.random.default_rng(seed)
  r = make_result(rng.integers(0, e, size=(t, 2)), _random_probs(seed, t, e))
  for conv in ("switch", "topk"):
    v = float(lb_loss(r, convention=conv, num_experts=e))
    assert 0.0 <= v <= e + 1e-5
  collapse = np.zeros((t, e), np.float32)
  collapse[:, rng.integers(e)] = 1.0
  r = make_result(np.argmax(collapse, -1)[:, None], collapse)
  np.testing.assert_allclose(lb_loss(r, convention="switch", num_experts=e), e, rtol=1e-6)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(d=st.sampled_from([1, 2, 3]), seed=st.integers(0, 10_000))
def test_device_and_comm_losses_are_one_when_balanced(d, seed):
  e, t = 6, 12
  perm = np.random.default_rng(seed).permutation(t)
  # Token i uses expert perm[i] % e only (K=1): every device gets t/d tokens, M=1.
  r = make_result([[perm[i] % e] for i in range(t)], _random_probs(seed, t, e))
  np.testing.assert_allclose(dev_loss(r, num_experts=e, num_devices=d), 1.0, rtol=1e-5)
  np.testing.assert_allclose(comm_loss(r, num_experts=e, num_devices=d, max_devices=1), 1.0,
                             rtol=1e-5)


# -- the config bundle ---------------------------------------------------------

def cfg(num_experts=3, zero_experts=0, top_k=2, **balance):
  return moe_config(num_experts=num_experts, zero_experts=zero_experts,
                     routing=C.RoutingConfig(top_k=top_k),
                     balance=C.BalanceConfig(**balance))


def test_balance_losses_multiplies_coefficients_and_sums():
  r = hand()
  out = L.balance_losses(r, cfg(aux_loss_coef=0.01, z_loss_coef=0.001,
                                entropy_loss_coef=0.1), batch_shape=(2, 2))
  assert set(out) == {"aux_loss", "z_loss", "device_loss", "comm_loss", "entropy_loss",
                      "total"}
  np.testing.assert_allclose(out["aux_loss"], 0.01 * 1.134375, rtol=1e-6)
  np.testing.assert_allclose(out["z_loss"], 0.001 * L.z_loss(r.logits), rtol=1e-6)
  np.testing.assert_allclose(out["entropy_loss"], 0.1 * L.entropy_loss(r.probs), rtol=1e-6)
  assert float(out["device_loss"]) == 0.0 and float(out["comm_loss"]) == 0.0
  np.testing.assert_allclose(
      out["total"], out["aux_loss"] + out["z_loss"] + out["entropy_loss"], rtol=1e-6)


def test_balance_losses_scope_and_convention():
  r = hand()
  seq = L.balance_losses(r, cfg(aux_loss_coef=1.0, aux_loss_scope="sequence"),
                         batch_shape=(2, 2))
  np.testing.assert_allclose(seq["aux_loss"], (1.1625 + 1.275) / 2, rtol=1e-6)
  sw = L.balance_losses(r, cfg(aux_loss_coef=1.0, aux_loss_convention="switch",
                               aux_loss_scope="global"), batch_shape=(4, 1))
  np.testing.assert_allclose(sw["aux_loss"], 1.2375, rtol=1e-6)  # no axes: the batch


def test_balance_losses_device_and_comm_use_ffn_experts_and_groups():
  c = moe_config(num_experts=4, routing=C.RoutingConfig(top_k=2),
                  balance=C.BalanceConfig(device_loss_coef=0.05, comm_loss_coef=0.02,
                                          loss_num_devices=2))
  out = L.balance_losses(make_result(DEV_IDS, DEV_PROBS), c, batch_shape=(1, 2))
  np.testing.assert_allclose(out["device_loss"], 0.05 * 1.15, rtol=1e-6)
  np.testing.assert_allclose(out["comm_loss"], 0.02 * 0.825, rtol=1e-6)  # M=min(K,D)=2
  grouped = moe_config(num_experts=4, routing=C.RoutingConfig(top_k=2, n_groups=2,
                                                              topk_groups=1),
                        balance=c.balance)
  assert L.comm_max_devices(grouped, 2) == 1  # device-limited routing's M


def test_balance_losses_zero_compute_experts_in_aux_not_in_device_loss():
  c = cfg(num_experts=2, zero_experts=1, aux_loss_coef=1.0, device_loss_coef=1.0,
          loss_num_devices=2)
  out = L.balance_losses(hand(), c, batch_shape=(1, 4))
  np.testing.assert_allclose(out["aux_loss"], 1.134375, rtol=1e-6)  # all 3 outputs
  # FFN experts 0,1 on their own devices: counts [4,3], f = 2/8 count = [1, .75]
  np.testing.assert_allclose(out["device_loss"], 1 * 0.425 + 0.75 * 0.375, rtol=1e-6)


def test_balance_losses_zero_coefficient_is_not_computed(monkeypatch):
  def boom(*a, **k):
    raise AssertionError("computed a loss whose coefficient is 0")
  for name in ("load_balance_loss", "sequence_balance_loss", "z_loss", "entropy_loss",
               "device_balance_loss", "comm_balance_loss"):
    monkeypatch.setattr(L, name, boom)
  out = L.balance_losses(hand(), cfg(), batch_shape=(2, 2))
  assert all(float(v) == 0.0 for v in out.values())


def test_balance_losses_checks_inputs():
  with pytest.raises(ValueError, match="cfg.num_routed=4"):
    L.balance_losses(hand(), cfg(num_experts=4), batch_shape=(2, 2))
  with pytest.raises(ValueError, match="batch_shape"):
    L.balance_losses(hand(), cfg(), batch_shape=(3, 2))


def test_balance_losses_jits_with_static_config():
  c = cfg(aux_loss_coef=0.01, z_loss_coef=0.001)
  f = jax.jit(lambda r: L.balance_losses(r, c, batch_shape=(2, 2))["total"])
  eager = L.balance_losses(hand(), c, batch_shape=(2, 2))["total"]
  np.testing.assert_allclose(f(hand()), eager, rtol=1e-6)
