"""Tokenizers behind one small interface: raw bytes for demos, Hugging Face `tokenizer.json` for checkpoints.

The sampler, the training loop and the input pipeline only see the `Tokenizer`
protocol: text <-> ids, the special ids the method needs (pad, EOS, mask) and a
chat-template hook applied to a query before it is encoded.

`encode` never adds special tokens; whoever builds a sequence adds them (the
input pipeline appends EOS to every response).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import tokenizers


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of the package needs from a tokenizer."""

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without any special token added."""
    ...

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; special tokens are not rendered (see each class for the mask)."""
    ...

  def apply_chat_template(self, query: str) -> str:
    """Wraps a user query the way the model saw prompts in training (identity if it has no template)."""
    ...

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def mask_id(self) -> int | None: ...

  @property
  def bos_id(self) -> int | None: ...


# Shown in place of a mask token by `ByteTokenizer.decode`, so partially decoded
# answers stay readable; a light shade block is very unlikely in task text.
MASK_GLYPH = "\u2591"


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then pad=256, bos=257, eos=258, mask=259 (vocab_size 260).

  `decode(encode(text)) == text` for any string. `decode` drops pad, BOS and EOS,
  renders the mask id as `MASK_GLYPH`, rejects ids outside the vocabulary, and
  replaces invalid UTF-8 (a model may emit a cut multi-byte character) with U+FFFD.
  """

  vocab_size = 260
  pad_id = 256
  bos_id = 257
  eos_id = 258
  mask_id = 259

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    pieces: list[str] = []
    run = bytearray()
    for token in ids:
      token = int(token)
      if 0 <= token < 256:
        run.append(token)
        continue
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"id {token} is outside the byte vocabulary [0, {self.vocab_size}).")
      pieces.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if token == self.mask_id:
        pieces.append(MASK_GLYPH)
    pieces.append(run.decode("utf-8", errors="replace"))
    return "".join(pieces)

  def apply_chat_template(self, query: str) -> str:
    return query


# Contents a mask token is known to have in Hugging Face vocabularies, most specific first.
_MASK_TOKEN_CANDIDATES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")
_CHAT_TEMPLATE = "<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_content(entry) -> str | None:
  """A special-token entry is either the token string or {"content": ...}."""
  if isinstance(entry, dict):
    return entry.get("content")
  return entry


def _first_id(value) -> int | None:
  """`eos_token_id` in model configs is an int or a list of ints."""
  if isinstance(value, list):
    return int(value[0]) if value else None
  return None if value is None else int(value)


class HFTokenizer:
  """A Hugging Face fast tokenizer (`tokenizer.json`) with its special tokens.

  Special tokens come from `tokenizer_config.json`, then `special_tokens_map.json`
  (`eos_token`, `pad_token`, `bos_token`, `mask_token`); when the EOS is not named
  there, `generation_config.json` / `config.json` `eos_token_id` is used. A mask
  token not named in the configs is looked up by its usual spellings
  (`<|mask|>`, `<mask>`, `[MASK]`). Without a pad token, padding uses the EOS id:
  padded positions carry no label, so any id is correct there.
  """

  def __init__(self, path: str):
    """`path` is a directory holding `tokenizer.json` (and optionally the JSON configs)."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
      raise FileNotFoundError(
        f"No tokenizer.json in {path!r}. Pass a Hugging Face checkpoint directory that holds"
        " tokenizer.json (save one with `tokenizer.save_pretrained(dir)`), or 'bytes' for the byte tokenizer."
      )
    self._tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
    named = {}
    for config_name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
      config = _read_json(os.path.join(path, config_name))
      for key in ("eos_token", "pad_token", "bos_token", "mask_token"):
        content = _token_content(config.get(key))
        if content:
          named[key] = content
    model_configs = [_read_json(os.path.join(path, name)) for name in ("generation_config.json", "config.json")]

    eos_id = self._id_of(named.get("eos_token"))
    if eos_id is None:
      eos_id = next((_first_id(c["eos_token_id"]) for c in model_configs if c.get("eos_token_id") is not None), None)
    if eos_id is None:
      raise ValueError(
        f"Could not find the EOS token of the tokenizer in {path!r}: set `eos_token` in"
        " tokenizer_config.json (or `eos_token_id` in generation_config.json)."
      )
    self._eos_id = eos_id
    pad_id = self._id_of(named.get("pad_token"))
    self._pad_id = eos_id if pad_id is None else pad_id
    self._bos_id = self._id_of(named.get("bos_token"))
    self._mask_id = self._id_of(named.get("mask_token"))
    if self._mask_id is None:
      known = [self._tokenizer.token_to_id(token) for token in _MASK_TOKEN_CANDIDATES]
      self._mask_id = next((token_id for token_id in known if token_id is not None), None)
    self._has_chat_tokens = all(
      self._tokenizer.token_to_id(token) is not None for token in ("<|im_start|>", "<|im_end|>")
    )

  def _id_of(self, token: str | None) -> int | None:
    if token is None:
      return None
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise ValueError(f"Special token {token!r} named in the tokenizer configs is not in tokenizer.json's vocabulary.")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def mask_id(self) -> int | None:
    return self._mask_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

  def apply_chat_template(self, query: str) -> str:
    """Qwen's ChatML user turn when the vocabulary has its tokens, else the query unchanged."""
    return _CHAT_TEMPLATE.format(query=query) if self._has_chat_tokens else query


def load_tokenizer(path_or_name: str) -> Tokenizer:
  """ "bytes" -> `ByteTokenizer`; a directory holding tokenizer.json -> `HFTokenizer`."""
  if path_or_name == "bytes":
    return ByteTokenizer()
  if os.path.isdir(path_or_name):
    return HFTokenizer(path_or_name)
  raise ValueError(
    f"Unknown tokenizer {path_or_name!r}: pass 'bytes' or a directory holding a Hugging Face tokenizer.json."
  )
