"""Benchmark suites of ``python -m experiments.bench``, one module each (registry.py)."""
