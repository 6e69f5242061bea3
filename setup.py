"""moejax: a JAX/Flax research codebase for Mixture-of-Experts language models."""
from setuptools import find_packages, setup

setup(
    name="moejax",
    version="0.1.0",
    description="Mixture-of-Experts research in JAX/Flax: routing, balance, topology, execution.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["moejax", "moejax.*", "experiments", "experiments.*"]),
    install_requires=[
        # CPU-only JAX by default: the plain `jax` wheel pulls jaxlib for CPU.
        "jax>=0.10.0",
        "jaxlib>=0.10.0",
        "flax>=0.12.0",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.11.0",
        "tensorflow-datasets>=4.9.9",
        "absl-py>=2.1.0",
        "ml_collections>=1.0.0",
        # TensorBoard event files without TensorFlow (training metrics).
        "tensorboardX>=2.6",
        "chex>=0.1.90",
        "numpy>=1.26",
        # Ablation statistics: Student t quantiles, Welch intervals, the bootstrap
        # (moejax.ablation.stats; `rng=` of scipy.stats.bootstrap needs 1.15).
        "scipy>=1.15",
        # tensorflow-datasets 4.9.10 imports it but does not declare it on Python 3.9+.
        "importlib_resources",
        # Ablation summaries write PNG plots (experiments.ablate).
        "matplotlib>=3.8",
        # data.tokenizer='bpe': byte-level BPE trained on the corpus (moejax/data/bpe.py).
        "tokenizers>=0.21",
        # Weight-only int8 / int4 expert quantisation for serving (moejax.serve.quantize).
        "qwix>=0.1.8",
    ],
    extras_require={
        # pytest.ini runs the tests on two pytest-xdist workers; the expensive shared
        # fixtures are built once per run under a file lock (tests/shared_dirs.py).
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "filelock>=3.12", "hypothesis>=6.100",
                 # tests/ablation executes the notebooks.
                 "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"],
        # Checkpoint interop (moejax.interop). torch pinned exactly: a CPU build
        # of that version is what the machines here have; an unpinned torch
        # pulls a multi-GB CUDA build. transformers >= 5.24 has the Mixtral,
        # Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 blocks the parity tests use.
        "interop": ["torch==2.13.0", "transformers>=5.24,<6", "safetensors>=0.6",
                    "matplotlib>=3.8"],
        # The grouped-matmul peer of experiments.device_check (tokamax's ragged
        # dot; on CPU it falls back to XLA). 0.0.12 is the last release for
        # Python 3.11.
        "kernels": ["tokamax>=0.0.12"],
        # Jupyter's command line for notebooks/: `jupyter nbconvert --execute` (nbconvert,
        # jupyter_core's `jupyter`, a Python kernel) and `jupyter notebook` to open them.
        # The optional Weights & Biases copy of a run's metrics (train.wandb_project).
        "wandb": ["wandb>=0.17"],
        "notebooks": ["nbconvert>=7.16", "jupyter_core>=5.7", "ipykernel>=6.29",
                      "notebook>=7.2"],
    },
)
