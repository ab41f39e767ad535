"""What int8 / int4 projections do to a model, measured in one run: error, agreement, bytes, time per forward.

Every variant (float32, bfloat16, int8, int4 in groups of 128 and 32, int4 per
channel; docs/architecture.md, "Quantized weights") holds the same weights: a
trained checkpoint read into each, or one random draw of a preset cast and
quantized from it. Each is compared with the bfloat16 one (and the float32
one): the relative logit error and top-1 agreement over teacher-forced rows,
the share of greedy autoregressive tokens equal to bfloat16's, the bytes of its
parameters, and the time of one ReFusion decode forward (the decode of the same
prompts divided by the batched forwards it ran, prefills included), timed by
`benchmarks.timer`: a warm-up decode each (compilation excluded), then the
variants interleaved over the rounds. On a CPU the time shows the overhead of casting integer kernels up;
on an accelerator, the saving of reading fewer bytes per forward.

With a checkpoint of the built-in tasks (a demo run), the rows are validation
examples (query + reference answer) and the prompts their queries; otherwise
random tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.benchmarks.table import byte_count, spread
from refusion_jax.benchmarks.timer import Timing, log, machine, time_rounds
from refusion_jax.checkpoints.load import load, load_model
from refusion_jax.data import tasks
from refusion_jax.decoding.ar import AR
from refusion_jax.decoding.engine import decode
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.model import quant
from refusion_jax.model.config import ModelConfig, preset
from refusion_jax.model.quantize import quantize
from refusion_jax.model.transformer import Transformer, causal_mask, init_model, with_config

# (name, compute and parameter dtype, quantize, int4 inputs per scale)
VARIANTS = (
  ("float32", "float32", "none", 128),
  ("bfloat16", "bfloat16", "none", 128),
  ("int8", "bfloat16", "int8", 128),
  ("int4 g128", "bfloat16", "int4", 128),
  ("int4 g32", "bfloat16", "int4", 32),
  ("int4 per channel", "bfloat16", "int4", 0),
)
REFERENCE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class QuantBenchOptions:
  """The model (a checkpoint, else a preset with random weights), the rows and prompts, the rounds."""

  checkpoint: str = ""
  preset: str = "small"
  count: int = 32
  length: int = 128
  gen_length: int = 32
  repeats: int = 3  # timed rounds after the warm-up (benchmarks.timer)
  seed: int = 0
  variants: str = ",".join(name for name, *_ in VARIANTS)  # comma-separated; float32 and bfloat16 always run


@dataclasses.dataclass(frozen=True)
class QuantRow:
  """One variant against the reference (bfloat16) and float32."""

  name: str
  error_vs_float32: float
  error_vs_reference: float
  top1: float  # share of rows' argmax equal to the reference's
  greedy_agreement: float  # share of greedy AR tokens equal to the reference's
  param_bytes: int
  timing: Timing  # of the whole ReFusion decode
  forwards: int  # the batched forwards that decode ran

  @property
  def seconds_per_forward(self) -> float:
    """The median decode over its forwards."""
    return self.timing.median / self.forwards


def run_quant_bench(options: QuantBenchOptions) -> tuple[list[QuantRow], str]:
  """Build every variant, compare it with bfloat16 and time its decode forwards; (rows, the model's name)."""
  load_variant, rows, valid, prompts, eos_id, source = _source(options)
  refusion = ReFusion(options.gen_length, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.5)
  models, logits, greedy = {}, {}, {}
  chosen = {"float32", REFERENCE, *options.variants.split(",")}
  unknown = chosen - {name for name, *_ in VARIANTS}
  if unknown:
    raise ValueError(f"Unknown variants {sorted(unknown)}; choose from {[name for name, *_ in VARIANTS]}.")
  for name, dtype, mode, group in VARIANTS:
    if name not in chosen:
      continue
    if models and mode != "none" and not _groups_fit(models["float32"].config, mode, group, name):
      continue
    log(f"{name}: build, logits, greedy decoding")
    models[name] = model = load_variant(dtype, mode, group)
    logits[name] = _logits(model, rows)[valid]
    greedy[name] = decode(model, prompts, AR(options.gen_length), eos_id=eos_id).tokens
  calls = {name: functools.partial(decode, model, prompts, refusion) for name, model in models.items()}
  decoded, timings = time_rounds(calls, options.repeats)
  result = []
  for name, model in models.items():
    same = [a == b for x, y in zip(greedy[name], greedy[REFERENCE]) for a, b in zip(x, y)]
    longest = sum(max(len(x), len(y)) for x, y in zip(greedy[name], greedy[REFERENCE]))
    result.append(
      QuantRow(
        name=name,
        error_vs_float32=_relative_error(logits[name], logits["float32"]),
        error_vs_reference=_relative_error(logits[name], logits[REFERENCE]),
        top1=float(np.mean(logits[name].argmax(-1) == logits[REFERENCE].argmax(-1))),
        greedy_agreement=sum(same) / max(longest, 1),
        param_bytes=sum(quant.stored_bytes(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        timing=timings[name],
        forwards=decoded[name].batched_forwards,
      )
    )
  return result, source


def _source(options: QuantBenchOptions) -> tuple[Callable[..., Transformer], np.ndarray, np.ndarray, list, int, str]:
  """(variant loader, [count, length] rows, [count, length] valid, prompts, EOS id, the model's name)."""
  if options.checkpoint:
    tokenizer = load(options.checkpoint)[1]
    examples = tasks.generate_examples("validation", options.count, tasks=("sort", "lookup", "code"))
    prompts = [tokenizer.encode(e["query"]) for e in examples]
    rows = np.full((options.count, options.length), tokenizer.pad_id, np.int32)
    valid = np.zeros(rows.shape, bool)
    for i, (query, example) in enumerate(zip(prompts, examples)):
      ids = (query + tokenizer.encode(example["response"]))[: options.length]
      rows[i, : len(ids)], valid[i, : len(ids)] = ids, True

    def load_variant(dtype: str, mode: str, group: int) -> Transformer:
      return load_model(options.checkpoint, dtype=dtype, quantize=mode, quantize_group_size=group)

    return load_variant, rows, valid, prompts, tokenizer.eos_id, options.checkpoint
  config = preset(options.preset, dtype="float32", param_dtype="float32")
  vocab = config.vocab_size
  config = config.replace(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 3)
  drawn = init_model(config, options.seed)  # one draw: every variant is this model cast and quantized
  rng = np.random.default_rng(options.seed)
  rows = rng.integers(0, vocab - 3, (options.count, options.length)).astype(np.int32)
  prompts = [row[: int(rng.integers(8, 17))].tolist() for row in rows[: max(options.count // 4, 1)]]

  def load_variant(dtype: str, mode: str, group: int) -> Transformer:
    model = _cast(drawn, dtype)
    return model if mode == "none" else quantize(model, mode, group)

  return load_variant, rows, np.ones(rows.shape, bool), prompts, vocab - 2, f"{options.preset} (random weights)"


def _groups_fit(config: ModelConfig, mode: str, group: int, name: str) -> bool:
  """Whether `group` divides every projection's input width (a small preset's may not: that variant is left out)."""
  try:
    config.replace(quantize=mode, quantize_group_size=group)
  except ValueError as error:
    log(f"{name}: left out ({error})")
    return False
  return True


def _cast(model: Transformer, dtype: str) -> Transformer:
  """A copy of `model` whose floating parameters and activations are in `dtype`."""
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return with_config(nnx.merge(graphdef, state), model.config.replace(dtype=dtype, param_dtype=dtype))


def _logits(model: Transformer, rows: np.ndarray) -> np.ndarray:
  """[rows, length, vocab] float32 logits of teacher-forced `rows`."""
  tokens = jnp.asarray(rows)
  return np.asarray(jax.jit(lambda m, t: m(t, mask=causal_mask(*t.shape))[0])(model, tokens).astype(jnp.float32))


def _relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
  return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def format_quant(rows: Sequence[QuantRow], source: str) -> str:
  """The rows as a markdown table, each variant's time per forward also as a same-round ratio to bfloat16's."""
  reference = next(r for r in rows if r.name == REFERENCE)
  lines = [
    f"{source}: against {REFERENCE} (and float32); time = one ReFusion decode forward, compile excluded; "
    f"machine: {machine()}",
    "",
    "| variant | rel. logit error vs float32 | vs bfloat16 | top-1 = bfloat16 | greedy AR tokens = bfloat16 "
    "| parameters | ms / forward | spread | time vs bfloat16 |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    # Both decodes' times over their own forwards: the same-round ratio scaled by the forwards' ratio.
    ratio = r.timing.ratio_to(reference.timing) * reference.forwards / r.forwards
    lines.append(
      f"| {r.name} | {r.error_vs_float32:.2e} | {r.error_vs_reference:.2e} | {100 * r.top1:.1f} % "
      f"| {100 * r.greedy_agreement:.1f} % | {byte_count(r.param_bytes)} | {1e3 * r.seconds_per_forward:.2f} "
      f"| {spread(r.timing)} | {ratio:.2f}x |"
    )
  return "\n".join(lines)
