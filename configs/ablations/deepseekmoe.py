"""Reproduction: DeepSeekMoE Table 1 ordering at equal total and active parameters.

Dai et al. (2401.06066), 2B total / 0.3B active, 100B tokens, Pile loss:
Hash 1.932 > Switch 1.881 > GShard 1.867 > DeepSeekMoE 1.808 (dense 0.2B: 2.060).

Arms on the small suite model (d=64, 2 MoE layers; every arm 2048 expert
hidden units per layer in total and 256 active per token), 300 steps x 16 x 64:

- ``hash``: 4 experts of width 256, top-1, balanced hash of the token id
  (Roller et al. 2106.04426), no router, no aux loss;
- ``switch``: 4 experts of width 256, top-1, softmax gate, aux loss 1e-2;
- ``gshard``: 8 experts of width 128, top-2, aux loss 1e-2;
- ``deepseekmoe``: GShard segmented m=4 with 1 shared expert isolated: 1
  shared + 31 routed experts of width 32, top-7, aux loss 1e-2
  (``topology.granularity=4, isolate_shared=1`` on the GShard layer).

Routers differ (hash has none, DeepSeekMoE's is 31 wide): total and active
parameters agree within 3% (DeepSeekMoE 2.6% above Hash in active).
Size: 4 arms x 3 seeds, about 8-18 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/deepseekmoe.py --workdir=/tmp/abl/deepseekmoe

On subword tokens (``:bpe``, a 1024-entry byte-level BPE trained once on the
train split; moejax/data/bpe.py): hash routing then hashes subwords, not
byte values, so its fixed per-byte expert prior is gone. The embedding and
output tables grow with the vocabulary alike in every arm; compare arms by
``val loss`` within the suite, and with the byte suite only per byte.

  python -m experiments.ablate --config=configs/ablations/deepseekmoe.py:bpe --workdir=/tmp/abl/deepseekmoe_bpe
  python -m experiments.report deepseekmoe@bpe=/tmp/abl/deepseekmoe_bpe --out RESULTS.md
"""

from moejax.ablation.bases import small_experiment, suite_config

_AUX = dict(aux_loss_coef=1e-2, aux_loss_scope="batch")
TOKENS = ("bytes", "bpe")
BPE_VOCAB_SIZE = 1024


def _moe(n, width, k, kind="topk", aux=True, **topology):
  return dict(topology=dict(num_experts=n, expert_width=width, **topology),
              execution=dict(backend="blocked"),
              routing=dict(kind=kind, top_k=k, score_fn="softmax",
                           gating="scores" if k == 1 else "normalized"),
              balance=_AUX if aux else dict(aux_loss_coef=0.0))


def get_config(tokens: str = "bytes"):
  """``tokens``: the config-file argument (``deepseekmoe.py:bpe``), ``bytes`` or ``bpe``."""
  if tokens not in TOKENS:
    raise ValueError(f"configs/ablations/deepseekmoe.py:{tokens}: unknown tokens; use one of "
                     f"{', '.join(TOKENS)} (e.g. --config=configs/ablations/deepseekmoe.py:bpe)")
  gshard = _moe(8, 128, 2)
  base = small_experiment(gshard)
  if tokens == "bpe":
    base["model"]["vocab_size"] = BPE_VOCAB_SIZE
    base["data"].update(tokenizer="bpe", bpe_vocab_size=BPE_VOCAB_SIZE)
  return suite_config(
      name="deepseekmoe",
      description=__doc__,
      base=base,
      arms={
          "hash": dict(model=dict(moe=_moe(4, 256, 1, kind="hash", aux=False))),
          "switch": dict(model=dict(moe=_moe(4, 256, 1))),
          "gshard": dict(model=dict(moe=gshard)),
          "deepseekmoe": dict(model=dict(moe=_moe(8, 128, 2, granularity=4,
                                                  isolate_shared=1))),
      },
      fixed=dict(total=0.03, active=0.03, flops_per_token=0.03, tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="gshard",  # GShard, the paper's main comparison
      reproduction=True,
      effects=dict(val_loss=dict(
          size=0.014, source="Dai et al. 2401.06066, Table 1 (2B, Pile loss): Switch 1.881 vs "
          "GShard 1.867, the smallest published gap to the baseline (Hash +0.065, DeepSeekMoE "
          "-0.059)")),
      analysis=dict(comm_devices=8),
  )
