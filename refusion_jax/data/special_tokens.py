"""The one owner of special token ids: mask, EOS, pad and BOS.

Two questions are answered here and nowhere else:

1. *Discovery*: which ids a Hugging Face tokenizer directory defines
   (`discover_special_tokens`), read from its JSON files so that a directory
   without `tokenizer.json` (only `tokenizer_config.json`) works too.
2. *Precedence*: which id a run uses when several sources name one
   (`resolve_special_tokens`): an explicit argument, then the tokenizer (the ids
   the model saw in training), then the model config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from refusion_jax.model.config import ModelConfig

# What a mask token looks like when the configs do not name one: "<|mask|>",
# "<mask>", "[MASK]", "<|mdm_mask|>" (LLaDA), in any case.
MASK_TOKEN_PATTERN = re.compile(r"[<\[]\|?(mdm_)?mask\|?[>\]]", re.IGNORECASE)
# Keys of the special tokens a tokenizer config may name, per field.
_NAMED_KEYS = {"eos": "eos_token", "pad": "pad_token", "bos": "bos_token", "mask": "mask_token"}
# Read in this order; a later file's entry wins.
_TOKEN_CONFIGS = ("special_tokens_map.json", "tokenizer_config.json")
# Where an EOS id is found when no config names the EOS token.
_MODEL_CONFIGS = ("generation_config.json", "config.json")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Special token ids; None where a source does not define one."""

  mask: int | None = None
  eos: int | None = None
  pad: int | None = None
  bos: int | None = None

  @property
  def padding(self) -> int | None:
    """The id to pad with: pad, else EOS (padded positions carry no label and are never attended)."""
    return self.eos if self.pad is None else self.pad

  def or_else(self, *fallbacks: SpecialTokens) -> SpecialTokens:
    """Field by field, this id, else the first fallback's that is not None."""
    ids = {}
    for field in dataclasses.fields(self):
      values = [getattr(source, field.name) for source in (self, *fallbacks)]
      ids[field.name] = next((value for value in values if value is not None), None)
    return SpecialTokens(**ids)


class HasSpecialIds(Protocol):
  """What `resolve_special_tokens` reads from a tokenizer (see `refusion_jax.data.tokenizer.Tokenizer`)."""

  @property
  def mask_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int | None: ...

  @property
  def pad_id(self) -> int | None: ...

  @property
  def bos_id(self) -> int | None: ...


def of_tokenizer(tokenizer: HasSpecialIds) -> SpecialTokens:
  """The ids a tokenizer defines."""
  return SpecialTokens(mask=tokenizer.mask_id, eos=tokenizer.eos_id, pad=tokenizer.pad_id, bos=tokenizer.bos_id)


def of_model_config(config: ModelConfig) -> SpecialTokens:
  """The ids a model config records."""
  return SpecialTokens(mask=config.mask_token_id, eos=config.eos_token_id, pad=config.pad_token_id)


def resolve_special_tokens(
  explicit: SpecialTokens = SpecialTokens(),
  *,
  tokenizer: HasSpecialIds | None = None,
  config: ModelConfig | None = None,
) -> SpecialTokens:
  """The ids a run uses: `explicit` ones, then the tokenizer's, then the model config's.

  The tokenizer comes before the config because the data pipeline builds every
  training sequence with the tokenizer's ids (it ends answers with its EOS and
  pads with its pad), so those are the ids the model learned.
  """
  fallbacks = []
  if tokenizer is not None:
    fallbacks.append(of_tokenizer(tokenizer))
  if config is not None:
    fallbacks.append(of_model_config(config))
  return explicit.or_else(*fallbacks)


def with_special_tokens(config: ModelConfig, ids: SpecialTokens) -> ModelConfig:
  """`config` recording `ids` (mask, EOS, pad), so that the config alone is enough to decode."""
  return config.replace(mask_token_id=ids.mask, eos_token_id=ids.eos, pad_token_id=ids.pad)


# ------------------------------------------------------------------ discovery


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """The token texts a tokenizer directory defines.

  ids: token text -> id, every token known (model vocabulary and added tokens).
  added: id -> text of the added (special) tokens.
  complete: whether `ids` holds the whole vocabulary (tokenizer.json was read);
    a name missing from an incomplete one is merely unknown, not an error.
  """

  ids: Mapping[str, int]
  added: Mapping[int, str]
  complete: bool


def read_vocabulary(path: str) -> Vocabulary:
  """The vocabulary of the tokenizer files in `path`, from their JSON alone (no tokenizer is built)."""
  tokenizer = _read_json(os.path.join(path, "tokenizer.json"))
  tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))
  vocab = (tokenizer.get("model") or {}).get("vocab") or {}
  # BPE and WordLevel store {text: id}; Unigram a list of [text, score] whose index is the id.
  ids = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
  added = {int(i): entry["content"] for i, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items()}
  added.update({entry["id"]: entry["content"] for entry in tokenizer.get("added_tokens") or []})
  ids.update({content: i for i, content in added.items()})
  return Vocabulary(ids=ids, added=added, complete=bool(tokenizer))


def discover_special_tokens(path: str, vocabulary: Vocabulary | None = None) -> SpecialTokens:
  """The special ids the tokenizer files in `path` define.

  - A token named in `special_tokens_map.json` / `tokenizer_config.json`
    (`eos_token`, `pad_token`, `bos_token`, `mask_token`; the latter file wins).
  - EOS, when no config names it: `eos_token_id` of `generation_config.json`,
    then `config.json` (an int or a list, whose first entry is taken).
  - Mask, when no config names it: the lowest-id added token that looks like a
    mask token (`MASK_TOKEN_PATTERN`), else the lowest-id such token of the
    whole vocabulary.

  Args:
    path: a Hugging Face tokenizer (or checkpoint) directory.
    vocabulary: the tokenizer's vocabulary when the caller has it already
      (default: read from the JSON files of `path`).

  Raises:
    ValueError: a config names a token that the (complete) vocabulary lacks.
  """
  vocabulary = vocabulary or read_vocabulary(path)
  named: dict[str, str] = {}
  for name in _TOKEN_CONFIGS:
    config = _read_json(os.path.join(path, name))
    for field, key in _NAMED_KEYS.items():
      content = _token_content(config.get(key))
      if content:
        named[field] = content
  ids = {field: _id_of(vocabulary, content, path) for field, content in named.items()}
  if ids.get("eos") is None:
    model_configs = [_read_json(os.path.join(path, name)) for name in _MODEL_CONFIGS]
    ids["eos"] = next((first_id(c["eos_token_id"]) for c in model_configs if c.get("eos_token_id") is not None), None)
  if ids.get("mask") is None:
    ids["mask"] = _looks_like_mask(vocabulary)
  return SpecialTokens(**ids)


def _looks_like_mask(vocabulary: Vocabulary) -> int | None:
  for candidates in (vocabulary.added.items(), ((i, text) for text, i in vocabulary.ids.items())):
    found = sorted(i for i, text in candidates if MASK_TOKEN_PATTERN.fullmatch(text))
    if found:
      return found[0]
  return None


def _id_of(vocabulary: Vocabulary, content: str, path: str) -> int | None:
  if content in vocabulary.ids:
    return vocabulary.ids[content]
  if vocabulary.complete:
    raise ValueError(
      f"Special token {content!r} named in the tokenizer configs of {path!r} is not in tokenizer.json's vocabulary."
    )
  return None


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_content(entry: Any) -> str | None:
  """A special-token entry is either the token string or {"content": ...}."""
  if isinstance(entry, dict):
    return entry.get("content")
  return entry


def first_id(value: int | Sequence[int] | None) -> int | None:
  """The id of a config's `eos_token_id` / `pad_token_id`: an int, a list or tuple of ints (the first), or None."""
  if isinstance(value, (list, tuple)):
    return int(value[0]) if value else None
  return None if value is None else int(value)
