"""An answer's text as it grows (decoding/text_stream.py, decoding/stop_strings.py): the increments joined are
the text of the whole answer, whatever the chunking, multi-byte characters and stop strings across chunks."""

import numpy as np
import pytest

from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.stop_strings import check_stop_strings, first_stop, pending_from
from refusion_jax.decoding.text_stream import FINISH_LENGTH, FINISH_STOP, TextStream

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id
ALPHABET = list("ab ¢€𝄞\n") + ["ab", "€a"]  # 1- to 4-byte characters: tokens cut them


def _reference(tokens: list[int], stops: tuple[str, ...], max_tokens: int) -> str:
  """The answer's text straight from its definition: cut at max_tokens, after the EOS, at the first stop."""
  tokens = tokens[:max_tokens]
  if EOS in tokens:
    tokens = tokens[: tokens.index(EOS) + 1]
  text = TOKENIZER.decode(tokens)
  cuts = [text.find(s) for s in stops if s in text]
  return text[: min(cuts)] if cuts else text


def _random_case(rng: np.random.Generator):
  text = "".join(rng.choice(ALPHABET, size=int(rng.integers(1, 30))))
  tokens = TOKENIZER.encode(text)
  if rng.random() < 0.3:
    tokens.insert(int(rng.integers(0, len(tokens) + 1)), EOS)
  stops = []
  for _ in range(int(rng.integers(0, 3))):
    start = int(rng.integers(0, len(text)))
    stops.append(text[start : start + int(rng.integers(1, 4))] or "zz")
  if rng.random() < 0.3:
    stops.append("never")
  return tokens, tuple(stops), int(rng.integers(1, len(tokens) + 3))


def test_increments_join_into_the_whole_answers_text_for_any_chunking():
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  for case in range(300):
    tokens, stops, max_tokens = _random_case(rng)
    whole = TextStream(TOKENIZER, EOS, max_tokens, stops)
    assert whole.update(tokens, final=True) == _reference(tokens, stops, max_tokens), (seed, case)
    stream, sent, length = TextStream(TOKENIZER, EOS, max_tokens, stops), [], 0
    while stream.finish_reason is None:
      length = min(len(tokens), length + int(rng.integers(0, 4)))
      sent.append(stream.update(tokens[:length], final=length == len(tokens) and rng.random() < 0.5))
      if length == len(tokens):
        sent.append(stream.update(tokens, final=True))
    assert "".join(sent) == whole.text, (seed, case, tokens, stops, max_tokens, sent)
    assert stream.finish_reason == whole.finish_reason, (seed, case)


def test_a_cut_multibyte_character_is_held_back_until_its_last_byte():
  stream = TextStream(TOKENIZER, EOS, 16)
  euro = TOKENIZER.encode("€")  # three bytes
  assert stream.update(TOKENIZER.encode("a") + euro[:2]) == "a"
  assert stream.update(TOKENIZER.encode("a") + euro) == "€"


def test_a_possible_stop_string_is_held_back_and_cut_once_it_completes():
  stream = TextStream(TOKENIZER, EOS, 64, ("STOP",))
  assert stream.update(TOKENIZER.encode("go ST")) == "go "
  assert stream.finish_reason is None
  assert stream.update(TOKENIZER.encode("go STOP and more")) == ""
  assert (stream.text, stream.finish_reason) == ("go ", FINISH_STOP)
  assert stream.update(TOKENIZER.encode("go STOP and more, longer")) == ""


def test_a_stop_string_found_early_still_waits_for_an_earlier_one_that_may_complete():
  stream = TextStream(TOKENIZER, EOS, 64, ("abcdef", "cd"))
  assert stream.update(TOKENIZER.encode("xabcd")) == "x"  # "cd" is there, but "abcdef" may begin earlier
  assert stream.finish_reason is None
  assert stream.update(TOKENIZER.encode("xabcdef")) == ""
  assert (stream.text, stream.finish_reason) == ("x", FINISH_STOP)


def test_the_answer_ends_at_its_eos_or_its_token_limit():
  stream = TextStream(TOKENIZER, EOS, 64)
  assert stream.update([*TOKENIZER.encode("hi"), EOS, *TOKENIZER.encode("after")]) == "hi"
  assert (stream.finish_reason, stream.tokens) == (FINISH_STOP, [*TOKENIZER.encode("hi"), EOS])
  limited = TextStream(TOKENIZER, EOS, 3)
  assert limited.update(TOKENIZER.encode("hello")) == "hel"
  assert (limited.finish_reason, len(limited.tokens)) == (FINISH_LENGTH, 3)
  short = TextStream(TOKENIZER, EOS, 64)
  assert short.update(TOKENIZER.encode("ok"), final=True) == "ok"
  assert short.finish_reason == FINISH_LENGTH


def test_a_stop_id_ends_the_answer_as_the_eos_does_without_its_text():
  stream = TextStream(TOKENIZER, EOS, 64, stop_ids=(ord("\n"),))
  assert stream.update(TOKENIZER.encode("one")) == "one"
  assert stream.update(TOKENIZER.encode("one\ntwo")) == ""
  assert (stream.text, stream.finish_reason, stream.tokens) == ("one", FINISH_STOP, TOKENIZER.encode("one\n"))


def test_stop_string_helpers():
  assert first_stop("a stop here, STOP", ("STOP", "here")) == 7
  assert first_stop("nothing", ("STOP",)) is None
  assert pending_from("go ST", ("STOP",)) == 3
  assert pending_from("go", ("STOP",)) == 2


@pytest.mark.parametrize(
  "stops, message",
  [(["a"] * 5, "at most 4"), ([""], "non-empty"), (["x" * 300], "at most 256")],
)
def test_bad_stop_strings_say_what_to_send(stops, message):
  with pytest.raises(ValueError, match=message):
    check_stop_strings(stops)
  assert check_stop_strings(["a"] * 16, limit=16) == ("a",) * 16  # a server allows more (--max_stop)
  assert check_stop_strings("one") == ("one",)
  assert check_stop_strings(None) == ()


def test_sampler_stream_joins_into_the_samplers_answer():
  import refusion_jax as rj

  model, tokenizer = rj.load("tiny", format="preset", tokenizer="bytes")
  seed = int(np.random.default_rng().integers(1 << 20))
  for temperature in (0.0, 0.9):
    sampler = rj.Sampler(model, tokenizer, rj.ReFusion(gen_length=32, slot_size=4, temperature=temperature), seed=seed)
    answer = sampler("stream me")
    pieces = list(sampler.stream("stream me"))
    assert "".join(pieces) == answer, (seed, temperature, pieces)
    stop = answer[3:5] or "zz"
    expected = answer[: answer.find(stop)] if stop in answer else answer
    assert "".join(sampler.stream("stream me", stop=stop)) == expected, (seed, temperature, stop)
  early = sampler.stream("stream me")
  next(early, None)
  early.close()  # a caller that stops early leaves the engine idle for the next call
  assert sampler.engine(1, 16).idle
