"""Byte and Hugging Face tokenizers behind the common `Tokenizer` interface."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from refusion_jax.data.tokenizer import MASK_GLYPH, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text


def test_byte_tokenizer_specials_are_distinct_and_outside_bytes():
  tok = ByteTokenizer()
  specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id]
  assert len(set(specials)) == 4
  assert all(256 <= s < tok.vocab_size for s in specials)
  assert isinstance(tok, Tokenizer)


def test_byte_decode_drops_specials_and_shows_mask():
  tok = ByteTokenizer()
  ids = [tok.bos_id] + tok.encode("hé") + [tok.mask_id, tok.mask_id] + tok.encode("!") + [tok.eos_id, tok.pad_id]
  assert tok.decode(ids) == "hé" + MASK_GLYPH * 2 + "!"
  with pytest.raises(ValueError, match="outside the byte vocabulary"):
    tok.decode([tok.vocab_size])


def test_byte_chat_template_is_identity():
  assert ByteTokenizer().apply_chat_template("1+2=") == "1+2="


def _save_word_level(directory, words, specials, configs):
  vocab = {word: i for i, word in enumerate(["[UNK]"] + words)}
  raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  raw.add_special_tokens(specials)
  raw.save(str(directory / "tokenizer.json"))
  for name, content in configs.items():
    (directory / name).write_text(json.dumps(content))
  return raw


def _random_words(rng, n):
  return sorted({"".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(n)})


def test_hf_tokenizer_reads_special_tokens_from_configs(tmp_path):
  rng = random.Random(0)
  words = _random_words(rng, 40)
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<pad>"]
  raw = _save_word_level(
    tmp_path,
    words,
    specials,
    {
      "tokenizer_config.json": {"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}},
      "special_tokens_map.json": {"eos_token": "<|endoftext|>"},  # tokenizer_config wins
    },
  )
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
  assert tok.eos_id == raw.token_to_id("<|im_end|>")
  assert tok.pad_id == raw.token_to_id("<pad>")
  assert tok.mask_id == raw.token_to_id("<|mask|>")  # found by its spelling
  assert tok.bos_id is None
  assert tok.vocab_size == len(words) + 1 + len(specials)
  text = " ".join(rng.choice(words) for _ in range(12))
  ids = tok.encode(text)
  assert len(ids) == 12 and tok.decode(ids) == text
  assert tok.decode(ids + [tok.eos_id, tok.mask_id]) == text  # specials skipped
  assert tok.apply_chat_template("q") == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"


def test_hf_tokenizer_without_chat_tokens_or_mask(tmp_path):
  words = _random_words(random.Random(1), 20)
  raw = _save_word_level(tmp_path, words, ["</s>"], {"generation_config.json": {"eos_token_id": [len(words) + 1, 7]}})
  tok = HFTokenizer(str(tmp_path))
  assert tok.eos_id == raw.token_to_id("</s>")
  assert tok.pad_id == tok.eos_id  # no pad token: padding reuses EOS
  assert tok.mask_id is None
  assert tok.apply_chat_template("q") == "q"


def test_hf_tokenizer_errors_are_actionable(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer(str(tmp_path))
  _save_word_level(tmp_path, ["ab", "cd"], [], {})
  with pytest.raises(ValueError, match="EOS"):
    HFTokenizer(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
  with pytest.raises(ValueError, match="not in tokenizer.json"):
    HFTokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="Unknown tokenizer"):
    load_tokenizer(str(tmp_path / "nope"))
