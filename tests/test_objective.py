"""The training objectives against a plain NumPy transcription of docs/method.md §1.

The reference below loops over examples and slots in Python and consumes the
very draws the jitted code uses (`objective.draw_randomness`), so layouts and
losses must agree exactly (up to float rounding).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.training import objective

VOCAB = 64
MASK_ID = VOCAB - 1
EOS_ID = VOCAB - 2
PAD_ID = 0
LAYOUT_FIELDS = ("tokens", "positions", "labels", "ar_weights", "mdm_weights")
LENGTH_KEYS = ("prompt_len", "answer_len")


def make_config(kind, **overrides):
  return objective.ObjectiveConfig(kind=kind, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID, **overrides)


def make_batch(rng, prompt_lens, answer_lens, length):
  """Random real tokens; the padding holds random garbage, which must not matter."""
  batch_size = len(prompt_lens)
  return dict(
    tokens=rng.integers(1, MASK_ID, (batch_size, length)).astype(np.int32),
    prompt_len=np.asarray(prompt_lens, np.int32),
    answer_len=np.asarray(answer_lens, np.int32),
  )


def host_draws(draws):
  return jax.tree.map(np.asarray, draws)


# ---------------------------------------------------------------- NumPy reference of docs/method.md §1


def reference_p(t, config):
  # Same float32 rounding as the jitted code, so "u < p" decides identically.
  return np.float32(1.0 - config.eps) * np.float32(t) + np.float32(config.eps)


def row_lengths(batch, b):
  """[(prompt_len, answer_len)] of the examples of row b, unused segments included."""
  prompt_len, answer_len = (np.asarray(batch[key]).reshape(len(batch["tokens"]), -1)[b] for key in LENGTH_KEYS)
  return list(zip(prompt_len.tolist(), answer_len.tolist()))


def row_examples(batch, draws, b):
  """Per example of row b: (its tokens, P, A, t, S, per-unit uniforms, per-unit ranks), per docs/method.md §1.

  Unit k of an example draws at the column of its k-th answer token (see `objective.Draws`).
  """
  examples, start = [], 0
  for k, (P, A) in enumerate(row_lengths(batch, b)):
    answer_start = start + P
    units = slice(answer_start, None)
    examples.append(
      (
        batch["tokens"][b, start : start + P + A],
        P,
        A,
        draws.t[b, k],
        int(draws.slot_size[b, k]),
        draws.mask_uniform[b, units],
        draws.slot_rank[b, units],
      )
    )
    start += P + A
  return examples


def reference_refusion_example(tokens, P, A, t, S, uniform, rank, length, config):
  """Stored (token, position, label, ar_weight, mdm_weight) of one example, per docs/method.md §1."""
  p = reference_p(t, config)
  answer = tokens[P : P + A]
  # 1. Cut the answer into slots of S tokens; the last may be shorter.
  slots = [list(range(start, min(start + S, A))) for start in range(0, A, S)]
  # 2. Mask each slot independently with probability p.
  masked = [bool(uniform[k] < p) for k in range(len(slots))]
  # 3. Prompt, then clean slots in random order, then masked slots in original order.
  clean_order = sorted((k for k in range(len(slots)) if not masked[k]), key=lambda k: rank[k])
  rows = [(tokens[i], i, 0, 0.0, 0.0) for i in range(P)]
  for k in clean_order:
    for j, a in enumerate(slots[k]):
      # 4. A clean token predicts the next token of its own slot; the slot's last has no label.
      if j + 1 < len(slots[k]):
        rows.append((answer[a], P + a, answer[a + 1], 1.0, 0.0))
      else:
        rows.append((answer[a], P + a, 0, 0.0, 0.0))
  for k in range(len(slots)):
    if masked[k]:
      for a in slots[k]:
        # 4. A masked token predicts itself, weighted 1 / (p * answer_length).
        rows.append((MASK_ID, P + a, answer[a], 0.0, 1.0 / (p * A)))
  return rows


def reference_ar_example(tokens, P, A, t, S, uniform, rank, length, config):
  """Plain next-token prediction; only answer tokens are targets."""
  rows = []
  for i in range(P + A):
    if P <= i + 1 < P + A:
      rows.append((tokens[i], i, tokens[i + 1], 1.0, 0.0))
    else:
      rows.append((tokens[i], i, 0, 0.0, 0.0))
  return rows


def reference_mdm_example(tokens, P, A, t, S, uniform, rank, length, config):
  """LLaDA-style: the answer, EOS-padded to the row's end; each of its tokens masked on its own w.p. p."""
  if A == 0:
    return []  # a padding row of a partial batch stays padding
  p = reference_p(t, config)
  answer = list(tokens[P : P + A]) + [EOS_ID] * (length - P - A)
  rows = [(tokens[i], i, 0, 0.0, 0.0) for i in range(P)]
  for a, token in enumerate(answer):
    if uniform[a] < p:
      rows.append((MASK_ID, P + a, token, 0.0, 1.0 / (p * len(answer))))
    else:
      rows.append((token, P + a, 0, 0.0, 0.0))
  return rows


REFERENCE_EXAMPLES = {"refusion": reference_refusion_example, "ar": reference_ar_example, "mdm": reference_mdm_example}


def reference_layout(batch, draws, config):
  """Each row: its examples' reference rows one after the other, padded with (pad_id, 0, 0, 0, 0)."""
  draws = host_draws(draws)
  batch_size, length = batch["tokens"].shape
  out = {name: np.zeros((batch_size, length), np.float64) for name in (*LAYOUT_FIELDS, "segment_ids")}
  for b in range(batch_size):
    rows = []
    for k, example in enumerate(row_examples(batch, draws, b)):
      example_rows = REFERENCE_EXAMPLES[config.kind](*example, length, config)
      out["segment_ids"][b, len(rows) : len(rows) + len(example_rows)] = k + 1
      rows += example_rows
    rows += [(PAD_ID, 0, 0, 0.0, 0.0)] * (length - len(rows))
    for name, column in zip(LAYOUT_FIELDS, zip(*rows)):
      out[name][b] = column
  return out


def reference_loss(model, batch, draws, config):
  """Per example: forward its reference layout alone, then docs/method.md §1 step 5 in float64.

  Each example runs as a batch of one, at the start of a row of its own; the
  mask written here hides that row's padding from every real query (causal for
  "refusion"/"ar", all real tokens for "mdm"), so padding cannot change a real
  token's logits.
  """
  host = host_draws(draws)
  length = batch["tokens"].shape[1]
  ar_sum, ar_count, mdm_sum, examples = 0.0, 0.0, 0.0, 0
  for b in range(batch["tokens"].shape[0]):
    for example in row_examples(batch, host, b):
      if example[2] == 0:  # no answer: a padding row or an unused segment
        continue
      examples += 1
      rows = REFERENCE_EXAMPLES[config.kind](*example, length, config)
      n = len(rows)  # an MDM answer runs to the row's end (EOS-padded)
      layout = dict(zip(LAYOUT_FIELDS, (np.asarray(c + (0,) * (length - n)) for c in zip(*rows))))
      if config.kind == "mdm":
        mask = np.zeros((length, length), bool)
        mask[:, :n] = True
      else:
        mask = np.tril(np.ones((length, length), bool))
      tokens, positions = (layout[name][None].astype(np.int32) for name in ("tokens", "positions"))
      logits = np.asarray(jit_model(model, tokens, positions, mask[None]), np.float64)[0, :n]
      log_probs = logits - logits.max(-1, keepdims=True)
      log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
      ce = -log_probs[np.arange(n), layout["labels"][:n].astype(int)]
      ar_sum += (ce * layout["ar_weights"][:n]).sum()
      ar_count += layout["ar_weights"][:n].sum()
      mdm_sum += (ce * layout["mdm_weights"][:n]).sum()
  return ar_sum / max(ar_count, 1.0) + mdm_sum / max(examples, 1)


# ---------------------------------------------------------------- jitted entry points

build_inputs = jax.jit(objective.build_inputs, static_argnames="config")
draw_randomness = jax.jit(objective.draw_randomness, static_argnums=(1, 2, 3, 4))


@nnx.jit
def jit_model(model, tokens, positions, mask):
  return model(tokens, positions, mask)[0]


@nnx.jit(static_argnames="config")
def jit_loss(model, batch, key, config):
  return objective.loss_fn(model, batch, key, config)


@nnx.jit(static_argnames="config")
def jit_loss_from_draws(model, batch, draws, config):
  return objective.loss_from_inputs(model, objective.build_inputs(batch, draws, config), config)


@nnx.jit(static_argnames="config")
def jit_loss_and_grad_from_draws(model, batch, draws, config):
  def loss(model):
    return objective.loss_from_inputs(model, objective.build_inputs(batch, draws, config), config)

  return nnx.value_and_grad(loss, has_aux=True)(model)


@nnx.jit(static_argnames="config")
def jit_forward(model, inputs, config):
  return objective.forward(model, inputs, config)


@pytest.fixture(scope="module")
def model():
  return init_model(tiny(vocab_size=VOCAB), seed=0)


# ---------------------------------------------------------------- cases

# Every case has the same [batch, length], and slot sizes are forced through the
# draws rather than the (static) config, so each kind compiles once.
BATCH, LENGTH = 4, 24

# name: (prompt lengths, answer lengths, forced slot sizes or None, other forced draws)
CASES = {
  "ragged_answers": ([3, 5, 1, 2], [9, 16, 7, 21], [2, 3, 4, 5], {}),
  "drawn_slot_sizes": ([4, 2, 1, 3], [20, 21, 23, 13], None, {}),
  "answers_of_whole_slots": ([2, 3, 1, 4], [4, 8, 16, 20], [4, 4, 8, 4], {}),
  "all_slots_masked": ([3, 2, 6, 1], [11, 7, 18, 23], [2, 3, 5, 1], {"t": 1.0}),
  "no_slot_masked": ([3, 2, 6, 1], [11, 7, 18, 23], [2, 3, 5, 1], {"mask_uniform": 1.0}),
  "padding_rows": ([3, 4, 0, 0], [9, 6, 0, 0], [2, 3, 4, 4], {}),
}
KINDS = ["refusion", "ar", "mdm"]


def case_inputs(case, kind):
  """(batch, draws, config) of a named case; the seed is fixed per case."""
  prompt_lens, answer_lens, slot_sizes, overrides = CASES[case]
  config = make_config(kind)
  rng = np.random.default_rng(sorted(CASES).index(case))
  batch = make_batch(rng, prompt_lens, answer_lens, LENGTH)
  draws = draw_randomness(jax.random.key(rng.integers(1 << 30)), BATCH, LENGTH, config)
  if slot_sizes is not None:
    overrides = {**overrides, "slot_size": np.asarray(slot_sizes, np.int32)}
  return batch, force(draws, overrides), config


def force(draws, overrides):
  """Draws with some fields replaced: a value of the field's size fills it in order, a smaller one is broadcast."""

  def forced(name, value):
    current = getattr(draws, name)
    value = jnp.asarray(value, current.dtype)
    return value.reshape(current.shape) if value.size == current.size else jnp.broadcast_to(value, current.shape)

  return draws.replace(**{name: forced(name, value) for name, value in overrides.items()})


def assert_layout_matches_reference(inputs, batch, draws, config):
  expected = reference_layout(batch, draws, config)
  for name in ("tokens", "positions", "labels", "segment_ids"):
    np.testing.assert_array_equal(np.asarray(getattr(inputs, name)), expected[name], err_msg=name)
  for name in ("ar_weights", "mdm_weights"):
    np.testing.assert_allclose(np.asarray(getattr(inputs, name)), expected[name], rtol=1e-6, err_msg=name)


# ---------------------------------------------------------------- layout equivalence


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_numpy_reference(case, kind):
  batch, draws, config = case_inputs(case, kind)
  assert_layout_matches_reference(build_inputs(batch, draws, config=config), batch, draws, config)


@st.composite
def random_cases(draw):
  rows = []
  for row in range(BATCH):
    if row and draw(st.integers(0, 3)) == 0:
      rows.append((0, 0, 1))  # a padding row
      continue
    prompt = draw(st.integers(1, LENGTH - 1))
    rows.append((prompt, draw(st.integers(1, LENGTH - prompt)), draw(st.integers(1, 9))))
  prompt_lens, answer_lens, slot_sizes = zip(*rows)
  return prompt_lens, answer_lens, slot_sizes, draw(st.integers(0, 2**30))


@settings(max_examples=20, deadline=None)
@given(random_cases(), st.sampled_from(KINDS))
def test_layout_matches_numpy_reference_on_random_lengths(random_case, kind):
  prompt_lens, answer_lens, slot_sizes, seed = random_case
  config = make_config(kind)
  batch = make_batch(np.random.default_rng(seed), prompt_lens, answer_lens, LENGTH)
  draws = force(draw_randomness(jax.random.key(seed), BATCH, LENGTH, config), {"slot_size": slot_sizes})
  assert_layout_matches_reference(build_inputs(batch, draws, config=config), batch, draws, config)


# Packed rows: PACKED_BATCH rows of up to SEGMENTS examples each, and the same examples one per row.
PACKED_BATCH, PACKED_LENGTH, SEGMENTS = 3, 40, 3


@st.composite
def packed_cases(draw):
  """(prompt_len, answer_len [PACKED_BATCH, SEGMENTS], slot sizes of the examples, seed); one row may be empty."""
  lengths = np.zeros((2, PACKED_BATCH, SEGMENTS), np.int32)
  for row in range(PACKED_BATCH):
    free = PACKED_LENGTH
    for segment in range(draw(st.integers(1 if row == 0 else 0, SEGMENTS))):
      if free < 2:
        break
      prompt = draw(st.integers(1, min(6, free - 1)))
      answer = draw(st.integers(1, min(16, free - prompt)))
      lengths[:, row, segment] = prompt, answer
      free -= prompt + answer
  slot_sizes = draw(st.lists(st.integers(1, 6), min_size=PACKED_BATCH * SEGMENTS, max_size=PACKED_BATCH * SEGMENTS))
  return lengths[0], lengths[1], slot_sizes, draw(st.integers(0, 2**30))


def packed_inputs(packed_case, kind):
  """(packed batch, its draws, the same examples one per row, their draws, config).

  Each unpacked example carries the draws of its span in the packed row (`objective.Draws`): the same
  per-example randomness, so both layouts must agree example for example.
  """
  prompt_len, answer_len, slot_sizes, seed = packed_case
  config = make_config(kind)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, MASK_ID, (PACKED_BATCH, PACKED_LENGTH)).astype(np.int32)
  packed = dict(tokens=tokens, prompt_len=prompt_len, answer_len=answer_len)
  draws = draw_randomness(jax.random.key(seed), PACKED_BATCH, PACKED_LENGTH, config, SEGMENTS)
  draws = host_draws(force(draws, {"slot_size": slot_sizes}))
  spans = [
    (b, k, int(prompt_len[b, :k].sum() + answer_len[b, :k].sum()), int(prompt_len[b, k]), int(answer_len[b, k]))
    for b in range(PACKED_BATCH)
    for k in range(SEGMENTS)
    if answer_len[b, k]
  ]
  single = host_draws(draw_randomness(jax.random.key(seed + 1), len(spans), PACKED_LENGTH, config))
  unpacked = dict(
    tokens=rng.integers(1, MASK_ID, (len(spans), PACKED_LENGTH)).astype(np.int32),
    prompt_len=np.asarray([span[3] for span in spans], np.int32),
    answer_len=np.asarray([span[4] for span in spans], np.int32),
  )
  fields = {name: np.array(getattr(single, name)) for name in ("slot_size", "t", "mask_uniform", "slot_rank")}
  for row, (b, k, start, P, A) in enumerate(spans):
    unpacked["tokens"][row, : P + A] = tokens[b, start : start + P + A]
    fields["slot_size"][row, 0], fields["t"][row, 0] = draws.slot_size[b, k], draws.t[b, k]
    for name in ("mask_uniform", "slot_rank"):
      fields[name][row, P : P + A] = getattr(draws, name)[b, start + P : start + P + A]
  return packed, draws, unpacked, single.replace(**fields), config


@settings(max_examples=15, deadline=None)
@given(packed_cases(), st.sampled_from(["refusion", "ar"]))
def test_packed_layout_matches_numpy_reference(packed_case, kind):
  packed, draws, _, _, config = packed_inputs(packed_case, kind)
  inputs = build_inputs(packed, draws, config=config)
  assert_layout_matches_reference(inputs, packed, draws, config)
  np.testing.assert_array_equal(inputs.real_examples, packed["answer_len"] > 0)


@pytest.mark.parametrize("kind", ["refusion", "ar"])
def test_packed_loss_and_gradients_equal_the_unpacked_ones(model, kind):
  """docs/method.md §1: normalised by tokens and examples, never rows, packing changes nothing."""
  case = (np.asarray([[4, 2, 3], [5, 6, 0], [2, 0, 0]]), np.asarray([[9, 12, 7], [16, 11, 0], [21, 0, 0]]))
  packed, draws, unpacked, single, config = packed_inputs((*case, [1, 2, 3, 4, 5, 6, 2, 3, 4], 5), kind)
  (packed_loss, packed_metrics), packed_grads = jit_loss_and_grad_from_draws(model, packed, draws, config=config)
  (loss, metrics), grads = jit_loss_and_grad_from_draws(model, unpacked, single, config=config)
  assert float(metrics["num_examples"]) == 6 and float(packed_metrics["num_examples"]) == 6
  for name in metrics:
    np.testing.assert_allclose(float(packed_metrics[name]), float(metrics[name]), rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(float(packed_loss), reference_loss(model, packed, draws, config), rtol=2e-5)
  for packed_grad, grad in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(packed_grad, grad, rtol=1e-4, atol=1e-6)


def test_packed_examples_do_not_see_each_other(model):
  case = (np.asarray([[4, 2, 3], [5, 6, 0], [2, 0, 0]]), np.asarray([[9, 12, 7], [16, 11, 0], [21, 0, 0]]))
  packed, draws, _, _, config = packed_inputs((*case, [2] * 9, 3), "refusion")
  inputs = build_inputs(packed, draws, config=config)
  logits = jit_forward(model, inputs, config=config)
  # Row 0 holds examples of 13, 14 and 10 tokens: change the first example's last stored token.
  changed = jit_forward(model, changed_token(inputs, 0, 12), config=config)
  np.testing.assert_array_equal(changed[0, 13:], logits[0, 13:])
  assert np.abs(changed[0, 12] - logits[0, 12]).max() > 1e-4
  assert int(inputs.positions[0, 13]) == 0 and int(inputs.positions[0, 27]) == 0  # each example's prompt starts at 0


def test_mdm_rows_cannot_be_packed():
  packed, draws, _, _, config = packed_inputs((np.full((3, 3), 2), np.full((3, 3), 5), [1] * 9, 0), "mdm")
  with pytest.raises(ValueError, match="one example"):
    objective.build_inputs(packed, draws, config)


def test_reorganize_uses_the_draws_of_its_key():
  config = make_config("refusion")
  batch = make_batch(np.random.default_rng(7), [3, 2, 5, 1], [10, 22, 19, 8], LENGTH)
  key = jax.random.key(11)
  inputs = jax.jit(objective.reorganize, static_argnames="config")(batch, key, config=config)
  assert_layout_matches_reference(inputs, batch, draw_randomness(key, BATCH, LENGTH, config), config)


def test_draws_have_the_documented_ranges():
  config = make_config("refusion")
  draws = host_draws(draw_randomness(jax.random.key(3), 64, 20, config))
  assert set(np.unique(draws.slot_size)) <= set(config.slot_sizes)
  assert ((draws.t >= 0) & (draws.t < 1)).all()
  assert ((draws.mask_uniform >= 0) & (draws.mask_uniform < 1)).all()
  np.testing.assert_array_equal(np.sort(draws.slot_rank, axis=1), np.broadcast_to(np.arange(20), (64, 20)))
  assert len({tuple(row) for row in draws.slot_rank}) > 1  # rows get their own permutations


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["ragged_answers", "all_slots_masked", "no_slot_masked", "padding_rows"])
def test_loss_matches_numpy_reference(model, case, kind):
  batch, draws, config = case_inputs(case, kind)
  loss, metrics = jit_loss_from_draws(model, batch, draws, config=config)
  np.testing.assert_allclose(float(loss), reference_loss(model, batch, draws, config), rtol=2e-5)
  np.testing.assert_allclose(float(metrics["ar_loss"] + metrics["mdm_loss"]), float(loss), rtol=1e-6)


def test_loss_fn_draws_from_its_key(model):
  config = make_config("refusion")
  batch = make_batch(np.random.default_rng(5), [4, 2, 3, 1], [11, 13, 6, 23], LENGTH)
  key = jax.random.key(9)
  draws = draw_randomness(key, BATCH, LENGTH, config)
  loss, metrics = jit_loss(model, batch, key, config=config)
  np.testing.assert_allclose(float(loss), reference_loss(model, batch, draws, config), rtol=2e-5)
  layout = reference_layout(batch, draws, config)
  assert metrics["num_ar_tokens"] == layout["ar_weights"].sum()
  assert metrics["num_mdm_tokens"] == (layout["mdm_weights"] > 0).sum()


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_are_finite(model, kind):
  batch, draws, config = case_inputs("ragged_answers", kind)
  (loss, _), grads = jit_loss_and_grad_from_draws(model, batch, draws, config=config)
  assert np.isfinite(float(loss))
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(g).all() for g in leaves)
  assert all(np.abs(g).max() > 0 for g in leaves)


def test_batch_without_ar_labels_has_finite_loss_and_gradients(model):
  batch, draws, config = case_inputs("all_slots_masked", "refusion")
  (loss, metrics), grads = jit_loss_and_grad_from_draws(model, batch, draws, config=config)
  assert metrics["num_ar_tokens"] == 0 and metrics["ar_loss"] == 0
  assert np.isfinite(float(loss)) and float(loss) > 0
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_add_nothing(model, kind):
  padded, draws, config = case_inputs("padding_rows", kind)
  real = {name: value[:2] for name, value in padded.items()}
  _, padded_metrics = jit_loss_from_draws(model, padded, draws, config=config)
  _, real_metrics = jit_loss_from_draws(model, real, jax.tree.map(lambda x: x[:2], draws), config=config)
  for name in real_metrics:
    np.testing.assert_allclose(float(padded_metrics[name]), float(real_metrics[name]), rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [5])  # LENGTH = 24: a padded last chunk (whole chunks: test_cross_entropy.py)
def test_chunked_loss_and_gradients_equal_the_dense_ones(model, kind, chunk):
  batch, draws, dense = case_inputs("ragged_answers", kind)
  chunked = make_config(kind, loss_chunk=chunk)
  (dense_loss, dense_metrics), dense_grads = jit_loss_and_grad_from_draws(
    model, batch, draws, config=dataclasses.replace(dense, loss_chunk=0)
  )
  (loss, metrics), grads = jit_loss_and_grad_from_draws(model, batch, draws, config=chunked)
  for name in metrics:
    np.testing.assert_allclose(float(metrics[name]), float(dense_metrics[name]), rtol=1e-6, err_msg=name)
  np.testing.assert_allclose(float(loss), float(dense_loss), rtol=1e-6)
  for grad, dense_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
    np.testing.assert_allclose(grad, dense_grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- attention patterns


def changed_token(inputs, row, index):
  return inputs.replace(tokens=inputs.tokens.at[row, index].set((inputs.tokens[row, index] + 1) % MASK_ID))


def test_mdm_attention_is_bidirectional_over_the_eos_padded_answer(model):
  batch, draws, config = case_inputs("padding_rows", "mdm")  # row 0: 12 real tokens, then EOS to the end
  inputs = build_inputs(batch, draws, config=config)
  np.testing.assert_array_equal(np.asarray(inputs.valid[:2]), True)  # real rows: the whole row is the answer
  np.testing.assert_array_equal(np.asarray(inputs.valid[2:]), False)  # padding rows: nothing
  tail = np.asarray(inputs.labels[0, 12:])[np.asarray(inputs.mdm_weights[0, 12:]) > 0]
  assert tail.size and (tail == EOS_ID).all()  # masked EOS padding is predicted as EOS
  logits = jit_forward(model, inputs, config=config)
  later_logits = jit_forward(model, changed_token(inputs, 0, 11), config=config)
  assert np.abs(later_logits[0, 0] - logits[0, 0]).max() > 1e-4
  tail_logits = jit_forward(model, changed_token(inputs, 0, 20), config=config)
  assert np.abs(tail_logits[0, 0] - logits[0, 0]).max() > 1e-4


def test_refusion_attention_is_causal_over_storage_order(model):
  batch, draws, config = case_inputs("ragged_answers", "refusion")
  inputs = build_inputs(batch, draws, config=config)
  assert not np.array_equal(inputs.positions[1, :21], np.arange(21))  # stored out of position order
  logits = jit_forward(model, inputs, config=config)
  stored = 12
  changed_logits = jit_forward(model, changed_token(inputs, 1, stored), config=config)
  np.testing.assert_allclose(changed_logits[1, :stored], logits[1, :stored], atol=1e-6)
  assert np.abs(changed_logits[1, stored:21] - logits[1, stored:21]).max(-1).min() > 1e-4


# ---------------------------------------------------------------- input checks


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(kind="bert"), "kind"),
    (dict(kind="refusion", eps=0.0), "eps"),
    (dict(kind="refusion", slot_sizes=()), "slot_sizes"),
    (dict(kind="refusion", mask_id=-1), "mask_id"),
    (dict(kind="ar", pad_id=None), "pad_id"),
    (dict(kind="mdm"), "eos_id"),
    (dict(kind="mdm", eos_id=-2), "eos_id"),
  ],
)
def test_bad_config_is_rejected(fields, message):
  with pytest.raises(ValueError, match=message):
    objective.ObjectiveConfig(**{"mask_id": MASK_ID, "pad_id": PAD_ID, **fields})


def test_config_is_hashable_with_list_slot_sizes():
  assert hash(make_config("refusion", slot_sizes=[4, 8])) == hash(make_config("refusion", slot_sizes=(4, 8)))


def test_overlong_rows_are_rejected():
  batch = make_batch(np.random.default_rng(0), [6], [11], 16)
  with pytest.raises(ValueError, match="prompt_len \\+ answer_len"):
    objective.reorganize(batch, jax.random.key(0), make_config("refusion"))


def test_missing_batch_field_is_rejected():
  batch = make_batch(np.random.default_rng(0), [6], [5], 16)
  del batch["answer_len"]
  with pytest.raises(ValueError, match="answer_len"):
    objective.reorganize(batch, jax.random.key(0), make_config("refusion"))


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda b: dict(b, tokens=b["tokens"].astype(np.float32) + 0.5), "integer tokens"),
    (lambda b: dict(b, prompt_len=b["prompt_len"][:1]), r"prompt_len \(1,\)"),
    (lambda b: dict(b, tokens=b["tokens"][0]), "tokens \\[batch, length\\]"),
  ],
)
def test_batch_of_wrong_type_or_shape_is_rejected_at_the_boundary(change, message):
  batch = make_batch(np.random.default_rng(1), [3, 4], [5, 6], 16)
  with pytest.raises(ValueError, match=message):
    objective.reorganize(change(batch), jax.random.key(0), make_config("refusion"))
