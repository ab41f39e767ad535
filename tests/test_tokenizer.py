"""Byte and Hugging Face tokenizers behind the common `Tokenizer` interface."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from refusion_jax.checkpoints.hf import find_mask_token_id
from refusion_jax.data import pipeline
from refusion_jax.data.special_tokens import SpecialTokens, discover_special_tokens, resolve_special_tokens
from refusion_jax.data.tokenizer import (
  MASK_GLYPH,
  ByteTokenizer,
  HFTokenizer,
  Tokenizer,
  format_prompt,
  load_tokenizer,
)
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model


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


# Special tokens: one discovery rule, one precedence -------------------------


@pytest.mark.parametrize("spelling", ["<|mdm_mask|>", "<|MASK|>", "[MASK]", "<mask>"])
def test_mask_token_is_discovered_by_one_rule_everywhere(tmp_path, spelling):
  words = _random_words(random.Random(2), 30)
  raw = _save_word_level(tmp_path, words, ["</s>", spelling], {"tokenizer_config.json": {"eos_token": "</s>"}})
  expected = raw.token_to_id(spelling)
  assert HFTokenizer(str(tmp_path)).mask_id == expected
  assert find_mask_token_id(tmp_path) == expected
  assert discover_special_tokens(str(tmp_path)) == SpecialTokens(mask=expected, eos=raw.token_to_id("</s>"))


def test_declared_mask_token_wins_over_one_that_looks_like_a_mask(tmp_path):
  words = _random_words(random.Random(3), 30)
  configs = {"tokenizer_config.json": {"eos_token": "</s>", "mask_token": "<blank>"}}
  raw = _save_word_level(tmp_path, words, ["</s>", "<|mask|>", "<blank>"], configs)
  assert HFTokenizer(str(tmp_path)).mask_id == raw.token_to_id("<blank>")
  assert find_mask_token_id(tmp_path) == raw.token_to_id("<blank>")


def test_special_ids_come_from_the_argument_then_the_tokenizer_then_the_model_config():
  rng = random.Random(4)
  explicit, config_ids = rng.sample(range(100, 200), 2), rng.sample(range(200, 250), 3)
  config = tiny(vocab_size=260, mask_token_id=config_ids[0], eos_token_id=config_ids[1], pad_token_id=config_ids[2])
  byte = ByteTokenizer()
  ids = resolve_special_tokens(SpecialTokens(eos=explicit[0]), tokenizer=byte, config=config)
  assert ids == SpecialTokens(mask=byte.mask_id, eos=explicit[0], pad=byte.pad_id, bos=byte.bos_id)
  ids = resolve_special_tokens(SpecialTokens(pad=explicit[1]), config=config)
  assert ids == SpecialTokens(mask=config_ids[0], eos=config_ids[1], pad=explicit[1])
  assert SpecialTokens(eos=explicit[0]).padding == explicit[0]  # no pad: padding reuses EOS


def test_sampler_takes_the_tokenizers_ids_over_the_model_configs():
  config = tiny(vocab_size=260, mask_token_id=5, eos_token_id=6, pad_token_id=7)
  sampler = Sampler(init_model(config, seed=0), "bytes", eos_id=9)
  byte = ByteTokenizer()
  assert (sampler.special_ids["mask_id"], sampler.special_ids["pad_id"]) == (byte.mask_id, byte.pad_id)
  assert sampler.special_ids["eos_id"] == 9  # an explicit argument wins


def test_pipeline_sampler_and_evaluation_build_the_same_prompt(tmp_path):
  words = _random_words(random.Random(5), 20)
  _save_word_level(
    tmp_path, words, ["<|im_start|>", "<|im_end|>"], {"tokenizer_config.json": {"eos_token": "<|im_end|>"}}
  )
  tok = HFTokenizer(str(tmp_path))
  query = " ".join(random.Random(6).choices(words, k=5))
  expected = tok.encode("<|im_start|>user\n" + query + "<|im_end|>\n<|im_start|>assistant\n")
  model = init_model(tiny(vocab_size=tok.vocab_size), seed=0)
  assert tok.encode(format_prompt(tok, query, chat_template=True)) == expected
  assert Sampler(model, tok, chat_template=True).encode(query) == expected
  dataset = pipeline.make_dataset(
    [{"query": query, "response": words[0]}], tok, seq_len=64, batch_size=1, seed=0, num_epochs=1, chat_template=True
  )
  prompts, _ = pipeline.batch_prompts_and_answers(next(iter(dataset)))
  assert prompts == [expected]
  assert format_prompt(tok, query, chat_template=False) == query
