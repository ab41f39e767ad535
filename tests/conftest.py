"""Shared test setup: tests run on the CPU with float32 matmuls at full precision."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")
