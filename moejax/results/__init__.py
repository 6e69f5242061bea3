"""The results tool: RESULTS.md, the notebooks and the re-check of committed blocks.

It reads what the ablation runner wrote (suite summaries, result records) and
renders it: ``python -m experiments.report`` (moejax.results.report, .images,
.claims, .trend, .notebooks) and ``python -m experiments.recheck``
(moejax.results.recheck). The runner never imports it; see docs/ablations.md.
"""
