"""What the decoding benchmarks run on: a model with its prompts and special ids, random or trained.

Random weights commit tokens arbitrarily and, near-uniform, would make every
ReFusion slot fail its thresholds. The random models are therefore
"sharpened": their LM head is scaled (confident, repetitive predictions, so
slots pass verification as a trained model's do) and EOS is never predicted
(every method writes all G tokens, so the counts compare).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from refusion_jax.checkpoints.load import load
from refusion_jax.data import tasks
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens
from refusion_jax.data.tokenizer import format_prompt
from refusion_jax.model import config as config_lib
from refusion_jax.model.transformer import Transformer, init_model

PROMPT_LENGTHS = (8, 16)  # random prompts: lengths drawn in [8, 16], one bucket


@dataclasses.dataclass(frozen=True)
class TrainedSource:
  """A trained model to benchmark and where its prompts come from."""

  load_request: dict  # keyword arguments of `checkpoints.load.load`
  texts: Sequence[str] = ()  # prompt texts, cycled to the count needed
  task_prompts: Sequence[str] = ()  # else the test-split queries of these built-in tasks
  chat_template: bool = False
  mask_id: int | None = None  # when neither the tokenizer nor the model config names one

  @property
  def name(self) -> str:
    return str(self.load_request["source"])


@dataclasses.dataclass
class BenchModel:
  """A model to benchmark, its prompts (the batch-1 run uses the first) and special ids."""

  name: str
  model: Transformer
  prompts: list[list[int]]
  mask_id: int
  eos_id: int
  pad_id: int


def sharpen(model: Transformer, scale: float, never: int) -> Transformer:
  """Scale the LM head by `scale` and zero the logit of token `never` (in place).

  A zero logit sits in the middle of the scaled random logits, so greedy
  decoding never picks that token.
  """
  if model.config.tie_embeddings:
    raise ValueError("Sharpening scales the untied lm_head; this preset ties it to the embedding. Use --sharpen 1.")
  model.lm_head[...] = (model.lm_head[...] * scale).at[:, never].set(0.0)
  return model


def random_prompts(
  rng: np.random.Generator, count: int, vocab: int, lengths: tuple[int, int] = PROMPT_LENGTHS
) -> list[list[int]]:
  """`count` prompts of ids below `vocab`, their lengths drawn in [lengths[0], lengths[1]]."""
  low, high = lengths
  return [rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def random_bench_model(
  size: str, batch: int, scale: float, seed: int, lengths: tuple[int, int] = PROMPT_LENGTHS, **overrides
) -> BenchModel:
  """A Qwen3-shaped preset (with `overrides`) with random (sharpened) weights; the last three ids are mask, EOS, pad."""
  base = config_lib.preset(size, **overrides)
  vocab = base.vocab_size
  model_config = base.replace(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 3)
  model = init_model(model_config, seed)
  if scale != 1.0:
    model = sharpen(model, scale, never=vocab - 2)
  prompts = random_prompts(np.random.default_rng(seed), batch, vocab - 3, lengths)
  name = size + "".join(f" {k}={v}" for k, v in overrides.items())
  return BenchModel(name, model, prompts, vocab - 1, vocab - 2, vocab - 3)


def trained_bench_model(source: TrainedSource, count: int, seed: int) -> BenchModel:
  """The trained model with `count` prompts: the task queries, the texts (cycled) or random ids."""
  model, tokenizer = load(**source.load_request)
  special = resolve_special_tokens(SpecialTokens(mask=source.mask_id), tokenizer=tokenizer, config=model.config)
  if special.mask is None:
    raise ValueError("Neither the tokenizer nor the model config names a mask token; pass --mask_id.")
  texts = list(source.texts)
  if source.task_prompts:
    examples = tasks.generate_examples("test", count, tasks=tuple(source.task_prompts))
    texts = [example["query"] for example in examples]
  if texts:
    encoded = [tokenizer.encode(format_prompt(tokenizer, p, source.chat_template)) for p in texts]
    prompts = [encoded[i % len(encoded)] for i in range(count)]
  else:
    vocab = min(model.config.vocab_size, tokenizer.vocab_size)
    prompts = random_prompts(np.random.default_rng(seed), count, vocab)
  return BenchModel(source.name, model, prompts, special.mask, special.eos, special.padding)
