"""refusion_jax: ReFusion (arXiv 2512.13586) in JAX / Flax NNX."""

from setuptools import find_packages, setup

setup(
  name="refusion_jax",
  version="0.1.0",
  description="ReFusion slot-parallel diffusion LM in JAX: training, jitted plan-and-infill decoding, HF interop.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  packages=find_packages(include=["refusion_jax", "refusion_jax.*"]),
  python_requires=">=3.10",
  install_requires=[
    "jax>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8,<0.13",
    "chex>=0.1.92",
    "tensorflow-datasets>=4.9.10,<5",
    "array_record>=0.8.6",
    # tfds needs it for builders defined inside a package, but does not declare it.
    "importlib_resources>=6",
    "grain>=0.2.18,<0.3",
    "ml-collections>=1.1.0",
    "absl-py>=2.1",
    "safetensors>=0.8.0",
    "tokenizers>=0.23",
    "numpy>=2.0",
    "matplotlib>=3.9",
    "tqdm>=4.66",
    "tensorboardX>=2.6",
  ],
  extras_require={
    # Reference implementations for parity tests. torch is pinned: that CPU
    # build is what CI installs; an unpinned torch pulls a multi-GB CUDA build.
    "test": [
      "pytest>=8",
      "hypothesis>=6.100",
      "torch==2.13.0",
      "transformers>=5.24,<6",
      # docs/sampling.ipynb is executed headlessly by tests/test_notebook.py
      "nbclient>=0.10",
      "nbformat>=5.10",
      "ipykernel>=6.29",
      # .ci/run checks formatting and lint with the repo's ruff.toml
      "ruff>=0.17,<0.18",
    ],
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
  },
)
