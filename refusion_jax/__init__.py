"""ReFusion in JAX: slot-parallel plan-and-infill decoding on a causal transformer."""

from refusion_jax.cache import BlockKV, KVCache
from refusion_jax.config import ModelConfig, preset
from refusion_jax.model import Transformer, init_model
