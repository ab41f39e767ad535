"""Hand-built ReFusion cases whose decode is derived by hand (G = 8, S = 4): a bigram model and what it must do.

Shared by tests/test_refusion.py (the decoder and the eager reference give the derived tokens, forwards,
iterations and phases) and tests/test_batching.py (forwards fitted to their work).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.result import PHASE_INFILL, PHASE_VERIFY
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import Transformer, init_model

VOCAB, MASK, EOS, WORD = 8, 7, 6, 1
LOGIT = 3.0  # softmax([3, 0 x 7])[0] ≈ 0.742


def bigram_model(mask_predicts: int, word_follows: int) -> Transformer:
  """A model whose logits at a position depend only on that position's input token.

  The attention and MLP outputs are zeroed, so the residual stream is the
  token embedding (one-hot), and the LM head maps token v to logits
  `LOGIT * onehot(next[v])`: a mask predicts `mask_predicts`, WORD predicts
  `word_follows`, everything else predicts token 0.
  """
  model = init_model(tiny(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS))
  hidden = model.config.hidden_size
  model.embed_tokens[...] = jnp.eye(VOCAB, hidden)
  for layer in model.layers:
    layer.self_attn.o_proj[...] = jnp.zeros_like(layer.self_attn.o_proj[...])
    layer.mlp.down_proj[...] = jnp.zeros_like(layer.mlp.down_proj[...])
  follows = np.zeros(VOCAB, int)
  follows[MASK], follows[WORD] = mask_predicts, word_follows
  # The final norm scales a one-hot embedding to sqrt(hidden).
  head = np.zeros((hidden, VOCAB), np.float32)
  head[np.arange(VOCAB), follows] = LOGIT / np.sqrt(hidden)
  model.lm_head[...] = jnp.asarray(head)
  return model


HAND_CASES = {
  # Every slot is confident and every AR check passes: one plan commits the whole block.
  "all slots at once": dict(
    model=(WORD, WORD),
    slot_threshold=0.5,
    token_threshold=0.5,
    serial_blocks=1,
    tokens=[WORD] * 8,
    forwards=[3],
    steps=[1],
    iteration=[0] * 8,
    phase=[PHASE_VERIFY] * 8,
  ),
  "one plan per serial block": dict(
    model=(WORD, WORD),
    slot_threshold=0.5,
    token_threshold=0.5,
    serial_blocks=2,
    tokens=[WORD] * 8,
    forwards=[5],
    steps=[2],
    iteration=[0] * 4 + [1] * 4,
    phase=[PHASE_VERIFY] * 8,
  ),
  # No slot reaches the slot threshold: equal confidences, so the first slot wins each plan.
  "one slot per plan": dict(
    model=(WORD, WORD),
    slot_threshold=0.9,
    token_threshold=0.5,
    serial_blocks=1,
    tokens=[WORD] * 8,
    forwards=[5],
    steps=[2],
    iteration=[0] * 4 + [1] * 4,
    phase=[PHASE_VERIFY] * 8,
  ),
  # AR checks fail: both slots go to the infill, which accepts one forced token per round (3 rounds).
  "token by token infill": dict(
    model=(WORD, 0),
    slot_threshold=0.5,
    token_threshold=0.5,
    serial_blocks=1,
    tokens=[WORD] * 8,
    forwards=[1 + 2 + 2 * 3],
    steps=[1],
    iteration=[0] * 8,
    phase=[PHASE_INFILL] * 8,
  ),
  # Every draft is EOS: the global verification commits the first slot cut after its EOS.
  "eos first": dict(
    model=(EOS, 0),
    slot_threshold=0.5,
    token_threshold=0.5,
    serial_blocks=2,
    tokens=[EOS],
    forwards=[3],
    steps=[1],
    iteration=[0] + [-1] * 7,
    phase=[PHASE_VERIFY] + [-1] * 7,
  ),
}


def hand_knobs(case: dict) -> dict:
  """The decode knobs of a hand-built case (G = 8, S = 4)."""
  names = ("serial_blocks", "slot_threshold", "token_threshold")
  return dict(gen_length=8, slot_size=4, **{name: case[name] for name in names})
