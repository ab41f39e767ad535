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

from refusion_jax.data.special_tokens import Vocabulary, discover_special_tokens


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


_CHAT_TEMPLATE = "<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"


class HFTokenizer:
  """A Hugging Face fast tokenizer (`tokenizer.json`) with its special tokens.

  Special ids follow `refusion_jax.data.special_tokens.discover_special_tokens`
  (the configs' named tokens, the model configs' EOS id, a mask token found by
  its usual spellings). Without a pad token, padding uses the EOS id: padded
  positions carry no label, so any id is correct there. `chat_template` is the
  checkpoint's Jinja chat template (None without one), which the lm-eval
  harness renders whole chats with (`apply_chat_template` here wraps one query).
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
    vocabulary = Vocabulary(
      ids=self._tokenizer.get_vocab(with_added_tokens=True),
      added={i: token.content for i, token in self._tokenizer.get_added_tokens_decoder().items()},
      complete=True,
    )
    special = discover_special_tokens(path, vocabulary)
    if special.eos is None:
      raise ValueError(
        f"Could not find the EOS token of the tokenizer in {path!r}: set `eos_token` in"
        " tokenizer_config.json (or `eos_token_id` in generation_config.json)."
      )
    self._special = special
    self._has_chat_tokens = all(
      self._tokenizer.token_to_id(token) is not None for token in ("<|im_start|>", "<|im_end|>")
    )
    self.chat_template = _jinja_chat_template(path)

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._special.padding

  @property
  def eos_id(self) -> int:
    return self._special.eos

  @property
  def mask_id(self) -> int | None:
    return self._special.mask

  @property
  def bos_id(self) -> int | None:
    return self._special.bos

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`; `skip_special_tokens=False` spells special tokens out (as HF's `decode` does)."""
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_text(self, token_id: int | None) -> str:
    """The spelling of one id ("" for None), e.g. the EOS token's for a chat template."""
    return "" if token_id is None else (self._tokenizer.id_to_token(int(token_id)) or "")

  def apply_chat_template(self, query: str) -> str:
    """Qwen's ChatML user turn when the vocabulary has its tokens, else the query unchanged."""
    return _CHAT_TEMPLATE.format(query=query) if self._has_chat_tokens else query


def _jinja_chat_template(path: str) -> str | None:
  """The checkpoint's Jinja chat template (chat_template.jinja, else tokenizer_config.json's), None without one."""
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  config_file = os.path.join(path, "tokenizer_config.json")
  if os.path.isfile(config_file):
    with open(config_file, encoding="utf-8") as f:
      template = json.load(f).get("chat_template")
    return template if isinstance(template, str) else None
  return None


def format_prompt(tokenizer: Tokenizer, query: str, chat_template: bool) -> str:
  """The prompt text of a query: wrapped in the tokenizer's chat template when `chat_template` is on.

  The one place that decides it, so that training data, evaluation, the sampler
  and the benchmarks all show the model the prompts it was trained on.
  """
  return tokenizer.apply_chat_template(query) if chat_template else query


def load_tokenizer(path_or_name: str) -> Tokenizer:
  """ "bytes" -> `ByteTokenizer`; a directory holding tokenizer.json -> `HFTokenizer`."""
  if path_or_name == "bytes":
    return ByteTokenizer()
  if os.path.isdir(path_or_name):
    return HFTokenizer(path_or_name)
  raise ValueError(
    f"Unknown tokenizer {path_or_name!r}: pass 'bytes' or a directory holding a Hugging Face tokenizer.json."
  )
