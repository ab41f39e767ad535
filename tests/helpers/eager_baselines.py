"""Eager transcriptions of the AR and MDM baselines (batch 1, a full forward per step), to check the jitted ones by."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

# Every naive forward runs at this width: trailing filler changes nothing under the causal mask.
NAIVE_WIDTH = 48


@nnx.jit
def logits_of(model, tokens, mask=None):
  return model(tokens, mask=mask)[0]


def naive_greedy(model, prompt, gen_length, eos_id=None):
  """Full causal forward over the whole sequence for every new token."""
  seq = list(prompt)
  answer = []
  for _ in range(gen_length):
    # Trailing filler changes nothing under the causal mask and keeps one shape.
    padded = seq + [0] * (NAIVE_WIDTH - len(seq))
    logits = logits_of(model, jnp.asarray([padded], jnp.int32))
    token = int(jnp.argmax(logits[0, len(seq) - 1]))
    answer.append(token)
    seq.append(token)
    if token == eos_id:
      break
  return answer


def llada_low_confidence(model, prompt, gen_length, block_length, steps, mask_id, margins=None):
  """LLaDA generate.py (temperature 0, low_confidence remasking), batch 1, in NumPy.

  `margins`, a list, gets each step's float64 confidence gap between the last position unmasked and the first
  left masked: where it is within float32 rounding, the jitted decoder may rank the two the other way.
  """
  x = np.array(list(prompt) + [mask_id] * gen_length)
  start = len(prompt)
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks
  for block in range(num_blocks):
    lo, hi = start + block * block_length, start + (block + 1) * block_length
    masked = int((x[lo:hi] == mask_id).sum())
    counts = np.full(steps_per_block, masked // steps_per_block)
    counts[: masked % steps_per_block] += 1
    for i in range(steps_per_block):
      mask_index = x == mask_id
      full = jnp.ones((1, len(x), len(x)), bool)
      logits = np.asarray(logits_of(model, jnp.asarray(x[None], jnp.int32), full)[0], np.float64)
      x0 = logits.argmax(-1)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      x0_p = p[np.arange(len(x)), x0]
      x0_p[hi:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      confidence = np.where(mask_index, x0_p, -np.inf)
      order = np.argsort(-confidence, kind="stable")
      select = order[: counts[i]]
      if margins is not None and np.isfinite(confidence[order[counts[i]]]):
        margins.append(confidence[order[counts[i] - 1]] - confidence[order[counts[i]]])
      x[select] = x0[select]
  return x[start:].tolist()
