"""Reproduction: expert choice leaks future tokens in a causal LM (Wang et al. 2408.15664, Sec. 5.2).

Expert choice (Zhou et al. 2202.09368) lets each expert pick its top tokens
over a chunk; in a causal LM the chunk contains future tokens, so the
teacher-forced loss can drop for the wrong reason. Wang et al. saw an
abnormal ~10% loss drop on a 2B model when the chunk shrank 8192 -> 512.

Arms on the small suite model (d=64, 2 MoE layers of 8 experts, softmax),
300 steps x 16 x 64 tokens (the chunk is the 1024-token step batch):
``topk`` (top-2, batch aux loss 1e-2) and ``expert_choice`` (capacity c = 2:
2 experts per token on average, balanced by construction, no aux loss).
Both have the same total and expected active parameters.

The causal probe (moejax.ablation.analysis.causal_probe) recomputes the loss
at positions S/8, S/4, S/2 and S-1 from the prefix alone and reports
``leak gap`` = (prefix loss - teacher-forced loss) / prefix loss. A causal
router gives 0 (up to float noise); a positive gap is loss bought with
future information.
Size: 2 arms x 3 seeds, about 9-12 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/expert_choice_leak.py --workdir=/tmp/abl/expert_choice_leak
"""

from moejax.ablation.bases import small_experiment, suite_config


def _moe(kind, aux):
  return dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
              routing=dict(kind=kind, top_k=2, score_fn="softmax",
                           gating="normalized" if kind == "topk" else "scores",
                           **(dict(options=dict(capacity=2.0)) if kind == "expert_choice"
                              else {})),
              balance=dict(aux_loss_coef=aux, aux_loss_scope="batch"))


def get_config():
  return suite_config(
      name="expert_choice_leak",
      description=__doc__,
      base=small_experiment(_moe("topk", 1e-2)),
      arms={
          "topk": dict(model=dict(moe=_moe("topk", 1e-2))),
          "expert_choice": dict(model=dict(moe=_moe("expert_choice", 0.0))),
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="topk",  # the causal top-k router
      reproduction=True,
      effects=dict(probe_leak_gap=dict(
          size=0.1, source="the published leak: an abnormal ~10% loss drop on a 2B causal model "
          "when the expert-choice chunk shrank from 8192 to 512 tokens")),
      analysis=dict(comm_devices=8, causal_probe=True),
  )
