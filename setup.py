"""refusion_jax: ReFusion (arXiv 2512.13586) in JAX / Flax NNX."""

import os
import runpy

from setuptools import find_packages, setup

# The package's version, the jax lines, the flax of each and the tokamax release live in refusion_jax/versions.py,
# which the package checks at import: read here without importing the package (nothing is installed yet). The
# accelerator extras pin the same jax, so `pip install -e ".[cuda12]"` never moves jax off the line the package
# was tested on.
VERSIONS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "refusion_jax", "versions.py"))
JAX_LINES = VERSIONS["JAX_LINES"]
# tokamax needs Python >= 3.12 and jax >= 0.11.1: the GPU's fused attention on jax >= 0.12.1 (model/flash.py).
TOKAMAX = f'{VERSIONS["TOKAMAX"]}; python_version >= "3.12"'


def jax_requirements(extra: str = "") -> list[str]:
  """jax (with `extra`, e.g. "[tpu]") on each Python's line; flax with it when no extra is asked for."""
  requirements = []
  for marker, (jax, flax) in JAX_LINES.items():
    requirements.append(f"jax{extra}{jax}; {marker}")
    if not extra:
      requirements.append(f"flax{flax}; {marker}")
  return requirements


setup(
  name="refusion_jax",
  version=VERSIONS["__version__"],
  description="ReFusion slot-parallel diffusion LM in JAX: training, jitted plan-and-infill decoding, HF interop.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  packages=find_packages(include=["refusion_jax", "refusion_jax.*"]),
  python_requires=">=3.11",  # jax 0.10.2, the oldest jax supported, needs it
  install_requires=[
    *jax_requirements(),
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
    # Reference implementations for parity tests. torch is pinned, on Python 3.11 only: that CPU build is
    # what CI installs; for Python >= 3.12 PyPI serves only CUDA builds (2.6 GB of wheels with their CUDA
    # libraries), so there the torch parity tests skip unless torch is installed by hand.
    "test": [
      "pytest>=8",
      # the suite runs in two processes (`-n 2`, .ci/run): one process keeps about one core busy (compiling,
      # Python), so a 2-core machine runs the suite in about half the time
      "pytest-xdist>=3.5",
      "hypothesis>=6.100",
      'torch==2.13.0; python_version < "3.12"',
      "transformers>=5.24,<6",
      # LoRA adapters written and read by peft itself (tests/test_lora.py); it needs torch, hence the same marker
      'peft>=0.21,<0.22; python_version < "3.12"',
      # the GPU kernel of jax >= 0.12.1, whose forward tests/test_flash_attention.py runs interpreted on the CPU
      TOKAMAX,
      # docs/sampling.ipynb is executed headlessly by tests/test_notebook.py
      "nbclient>=0.10",
      "nbformat>=5.10",
      "ipykernel>=6.29",
      # .ci/run checks formatting and lint with the repo's ruff.toml
      "ruff>=0.17,<0.18",
      # tests/test_serving.py runs the server (the serve extra's packages) and talks to it as OpenAI's own client
      "fastapi>=0.165,<1",
      "uvicorn>=0.55,<1",
      "openai>=3.63,<4",
      "httpx>=0.29,<1",
    ],
    # The OpenAI-compatible HTTP server (python -m refusion_jax.serve, docs/serving.md); jinja2 renders the
    # checkpoint's chat template for /v1/chat/completions.
    "serve": ["fastapi>=0.165,<1", "uvicorn>=0.55,<1", "jinja2>=3.1,<4"],
    # The paper's benchmark table through lm-evaluation-harness (python -m refusion_jax.harness): the lm-eval
    # the harness tests run against (~750 MB with datasets, pyarrow, scikit-learn; no torch). eval-math adds
    # what minerva_math imports (sympy, math_verify, antlr4). Its [api] part (aiohttp, tenacity, tiktoken) runs
    # lm-eval's local-completions against our server (docs/serving.md).
    "eval": ["lm-eval[api]==0.4.13"],
    # TRL's GRPOTrainer, the reference GRPO's loss is checked against (tests/test_rl_objective.py). An extra, not
    # part of [test]: it brings datasets, pyarrow and pandas, which [eval] installs anyway in CI's extras phase.
    "trl": ["trl>=1.16,<2"],
    "eval-math": ["lm-eval[math]==0.4.13"],
    "tpu": jax_requirements("[tpu]"),
    "cuda12": [*jax_requirements("[cuda12]"), TOKAMAX],
    "cuda13": [*jax_requirements("[cuda13]"), TOKAMAX],
  },
)
