"""Equal-budget ablation suites: definition, budget check, runner, summaries.

``python -m experiments.ablate --config=configs/ablations/<suite>.py --workdir=DIR``;
see docs/ablations.md.
"""
