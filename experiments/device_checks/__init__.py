"""The steps of ``python -m experiments.device_check``, one module per kind of check.

The binary (experiments/device_check.py) holds the flags, the plan of sizes
per platform and the step runner; each module here measures or checks one
thing from a :class:`~experiments.device_checks.common.Plan` and returns a
JSON-able dict.
"""
