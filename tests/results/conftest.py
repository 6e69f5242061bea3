"""The results tool's tests read the same finished tiny suite as the runner's tests."""

from tests.ablation.conftest import tiny_suite_dir  # noqa: F401  (the shared fixture)
