"""Random decode cases shared by the decoder tests.

A case is a tiny model with fresh random weights, random prompts and random
decode knobs. Weights are drawn into the parameter tree of one template model
per shape group, so the jitted decoder sees them as new *arguments* and
compiles once per group. The LM head is rescaled per case so that token
probabilities land on both sides of the thresholds.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

import refusion_jax as rj
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import Transformer, init_model


@dataclasses.dataclass(frozen=True)
class Group:
  """Everything that fixes a compilation: model shape, decode layout, batch, sampling."""

  name: str
  vocab_size: int
  gen_length: int
  slot_size: int
  serial_blocks: int
  batch: int = 1
  max_prompt: int = 16
  architecture: str = "qwen3"
  sample: bool = False
  cases: int = 30

  def template(self) -> Transformer:
    return init_model(tiny(vocab_size=self.vocab_size, architecture=self.architecture))


@dataclasses.dataclass
class Case:
  model: Transformer
  prompts: list[list[int]]
  knobs: dict  # `decode_reference`'s keyword arguments, which `decode_as_reference` takes too


def random_weights(template: Transformer, seed: int, weight_std: float, head_std: float) -> Transformer:
  """The template's graph with fresh random weights.

  Matrices are N(0, weight_std²) (the LM head N(0, head_std²), which sets how
  peaked the token distributions are), norm weights 1 + N(0, 0.1²), biases
  N(0, weight_std²).
  """
  graphdef, params = nnx.split(template)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  fresh = [jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]
  params = jax.tree.unflatten(treedef, fresh)

  def scale(path, x):
    name = jax.tree_util.keystr(path)
    if "lm_head" in name:
      return x * head_std
    if "norm" in name:
      return 1.0 + 0.1 * x
    return x * weight_std

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(scale, params))


REFUSION_FIELDS = frozenset(field.name for field in dataclasses.fields(rj.ReFusion))


def decode_as_reference(model: Transformer, prompts: list[list[int]], knobs: dict) -> DecodeResult:
  """`rj.decode` of the keywords `decode_reference` takes: ReFusion's fields make the method value, the others
  (special ids, seed) are decode's options."""
  fields = {name: value for name, value in knobs.items() if name in REFUSION_FIELDS}
  options = {name: value for name, value in knobs.items() if name not in REFUSION_FIELDS}
  return rj.decode(model, prompts, rj.ReFusion(**fields), **options)


def random_case(group: Group, template: Transformer, rng: np.random.Generator) -> Case:
  """A model, B prompts of random lengths and random knobs; mask id = vocab - 1."""
  vocab = group.vocab_size
  model = random_weights(
    template,
    seed=int(rng.integers(1 << 30)),
    weight_std=float(rng.uniform(0.05, 0.4)),
    head_std=float(np.exp(rng.uniform(np.log(0.1), np.log(1.5)))),
  )
  lengths = rng.integers(1, group.max_prompt + 1, group.batch)
  prompts = [rng.integers(0, vocab - 1, int(n)).tolist() for n in lengths]
  knobs = dict(
    gen_length=group.gen_length,
    slot_size=group.slot_size,
    serial_blocks=group.serial_blocks,
    slot_threshold=float(rng.uniform(0.05, 0.95)),
    token_threshold=float(rng.uniform(0.02, 0.95)),
    mask_id=vocab - 1,
    eos_id=int(rng.integers(0, vocab - 1)),
    temperature=float(rng.uniform(0.3, 2.0)) if group.sample else 0.0,
    seed=int(rng.integers(1 << 16)),
  )
  return Case(model, prompts, knobs)


def same_decode(a, b, row_a: int = 0, row_b: int = 0) -> list[str]:
  """What differs between row `row_a` of DecodeResult `a` and row `row_b` of `b` (empty if nothing)."""
  diffs = []
  if a.tokens[row_a] != b.tokens[row_b]:
    diffs.append(f"tokens {a.tokens[row_a]} != {b.tokens[row_b]}")
  for field in ("num_forwards", "steps", "commit_iteration", "commit_phase"):
    x, y = getattr(a, field)[row_a], getattr(b, field)[row_b]
    if not np.array_equal(x, y):
      diffs.append(f"{field} {np.asarray(x).tolist()} != {np.asarray(y).tolist()}")
  return diffs


def byte_model(seed: int = 0) -> Transformer:
  """A random tiny model over the byte tokenizer's vocabulary, with its mask, EOS and pad ids in the config."""
  tokenizer = ByteTokenizer()
  model_config = tiny(
    vocab_size=tokenizer.vocab_size,
    mask_token_id=tokenizer.mask_id,
    eos_token_id=tokenizer.eos_id,
    pad_token_id=tokenizer.pad_id,
  )
  return init_model(model_config, seed)
