"""How far int8 / int4 projections move a model: relative logit error, top-1 and greedy AR token agreement.

    python results/quantization_quality.py --checkpoint /tmp/refusion_demo     # a trained demo run
    python results/quantization_quality.py --preset small                       # random weights, random tokens

Every variant is compared with the bfloat16 model (and the float32 one): the logits of teacher-forced
validation rows (query + reference answer), and the tokens of greedy autoregressive decoding of the
validation queries. results/quantization.md holds the numbers.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import refusion_jax as rj
from refusion_jax.data import tasks
from refusion_jax.model.transformer import causal_mask

VARIANTS = (  # (name, dtype, quantize, int4 group size)
  ("float32", "float32", None, 128),
  ("bfloat16", "bfloat16", None, 128),
  ("int8", "bfloat16", "int8", 128),
  ("int4 g128", "bfloat16", "int4", 128),
  ("int4 g32", "bfloat16", "int4", 32),
  ("int4 per channel", "bfloat16", "int4", 0),
)


def _rows(tokenizer, count: int, length: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
  """(queries, [count, length] query + answer tokens padded, [count, length] valid) of the validation split."""
  examples = tasks.generate_examples("validation", count, tasks=("sort", "lookup", "code"))
  queries = [tokenizer.encode(e["query"]) for e in examples]
  rows = np.full((count, length), tokenizer.pad_id, np.int32)
  valid = np.zeros((count, length), bool)
  for i, (query, example) in enumerate(zip(queries, examples)):
    ids = (query + tokenizer.encode(example["response"]))[:length]
    rows[i, : len(ids)], valid[i, : len(ids)] = ids, True
  return queries, rows, valid


def _logits(model, rows: np.ndarray) -> jax.Array:
  tokens = jnp.asarray(rows)
  return jax.jit(lambda m, t: m(t, mask=causal_mask(*t.shape))[0])(model, tokens).astype(jnp.float32)


def _greedy(model, queries, gen_length: int, eos_id: int) -> list[list[int]]:
  return rj.ar_generate(model, queries, gen_length=gen_length, eos_id=eos_id).tokens


def compare(load, queries, rows, valid, gen_length: int, eos_id: int | None) -> list[str]:
  """Table rows comparing every variant with the bfloat16 and float32 models."""
  outputs = {}
  for name, dtype, mode, group in VARIANTS:
    model = load(dtype, mode, group)
    logits = _logits(model, rows)
    tokens = _greedy(model, queries, gen_length, eos_id) if eos_id is not None else None
    outputs[name] = (np.asarray(logits)[valid], tokens)
  lines = []
  ref32, ref16 = outputs["float32"][0], outputs["bfloat16"][0]
  for name, (logits, tokens) in outputs.items():
    error32 = np.linalg.norm(logits - ref32) / np.linalg.norm(ref32)
    error16 = np.linalg.norm(logits - ref16) / np.linalg.norm(ref16)
    top1 = np.mean(logits.argmax(-1) == ref16.argmax(-1))
    agreement = "n/a"
    if tokens is not None:
      reference = outputs["bfloat16"][1]
      same = [a == b for x, y in zip(tokens, reference) for a, b in zip(x, y)]
      longest = sum(max(len(x), len(y)) for x, y in zip(tokens, reference))
      agreement = f"{100 * sum(same) / max(longest, 1):.1f} %"
    lines.append(f"| {name} | {error32:.2e} | {error16:.2e} | {100 * top1:.1f} % | {agreement} |")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", help="a trained demo run (its validation split is the prompts).")
  parser.add_argument("--preset", help="a preset with random weights and random tokens instead.")
  parser.add_argument("--count", type=int, default=128, help="validation rows.")
  parser.add_argument("--gen_length", type=int, default=48)
  args = parser.parse_args()
  if args.checkpoint:
    source, tokenizer = args.checkpoint, rj.load(args.checkpoint)[1]
    queries, rows, valid = _rows(tokenizer, args.count, 64)
    eos_id = tokenizer.eos_id
  else:
    source, eos_id = args.preset, None
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (args.count // 4, 128)).astype(np.int32)
    queries, valid = None, np.ones(rows.shape, bool)

  def load(dtype, mode, group):
    return rj.load_model(source, dtype=dtype, quantize=mode, quantize_group_size=group)

  print("| variant | rel. logit error vs float32 | vs bfloat16 | top-1 = bfloat16 | greedy AR tokens = bfloat16 |")
  print("| --- | --- | --- | --- | --- |")
  print("\n".join(compare(load, queries, rows, valid, args.gen_length, eos_id)))


if __name__ == "__main__":
  main()
