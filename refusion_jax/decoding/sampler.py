"""Text in, text out: a notebook-friendly front end over the three decoders.

    sampler = Sampler(model, "bytes")                 # ReFusion, default knobs
    sampler("2 + 2 =")                                # -> str
    sampler(["a", "b"])                               # -> list[str], one batch
    texts, result = sampler.generate(["a", "b"])      # + the DecodeResult (trace, TPF)
    Sampler(model, tok, method="ar", gen_length=32)   # the baselines, same interface

Prompts are padded into the length buckets of `refusion_jax.decoding.common`, so
calls with new prompts of a bucket (and the same batch size) reuse the
compiled program of the decoder's jit cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from refusion_jax.data.special_tokens import resolve_special_tokens
from refusion_jax.data.tokenizer import Tokenizer, format_prompt, load_tokenizer
from refusion_jax.decoding import baselines
from refusion_jax.decoding import refusion as decode
from refusion_jax.decoding.common import DecodeResult
from refusion_jax.model.transformer import Transformer

# The decoder of each method and its default knobs (the paper's settings scaled to short demos).
METHODS: dict[str, tuple[Callable[..., DecodeResult], dict]] = {
  "refusion": (
    decode.generate,
    dict(gen_length=64, slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.9),
  ),
  "ar": (baselines.ar_generate, dict(gen_length=64)),
  # block_length and steps follow gen_length unless given (see `Sampler`).
  "mdm": (baselines.mdm_generate, dict(gen_length=64)),
}
MDM_BLOCK_LENGTH = 32


def decoder_options(decoder: Callable) -> list[str]:
  """The keyword-only arguments of a decoder (what `decode_kwargs` may set)."""
  return [name for name, p in inspect.signature(decoder).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]


class Sampler:
  """Decode text prompts with ReFusion ("refusion") or a baseline ("ar", "mdm").

  Special ids (mask, EOS, pad) default to the tokenizer's — the ids the model
  saw in training — then to the model config's; pass `mask_id=` etc. to
  override.
  """

  def __init__(
    self,
    model: Transformer,
    tokenizer: Tokenizer | str,
    method: str = "refusion",
    chat_template: bool = False,
    **decode_kwargs,
  ):
    """
    Args:
      model: the backbone.
      tokenizer: a `Tokenizer`, or a name/path for `load_tokenizer` ("bytes", a HF directory).
      method: "refusion", "ar" or "mdm".
      chat_template: wrap every prompt with the tokenizer's chat template first.
      **decode_kwargs: keyword arguments of the method's decoder (e.g.
        gen_length, slot_size, temperature, seed); unset ones take the
        defaults in `METHODS`.
    """
    if method not in METHODS:
      raise ValueError(f"Unknown method {method!r}; choose one of {sorted(METHODS)}.")
    self.decoder, defaults = METHODS[method]
    options = decoder_options(self.decoder)
    unknown = sorted(set(decode_kwargs) - set(options))
    if unknown:
      raise ValueError(f"method={method!r} takes no {', '.join(unknown)}; its options are {options}.")
    self.model = model
    self.method = method
    self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    self.chat_template = chat_template
    special = resolve_special_tokens(tokenizer=self.tokenizer, config=model.config)
    special = dict(mask_id=special.mask, eos_id=special.eos, pad_id=special.pad)
    self.decode_kwargs = {k: v for k, v in special.items() if k in options and v is not None}
    self.decode_kwargs.update(defaults)
    self.decode_kwargs.update(decode_kwargs)
    if method == "mdm":
      # LLaDA's usual setting: one token per step, blocks of 32 (or the whole answer when shorter).
      gen_length = self.decode_kwargs["gen_length"]
      self.decode_kwargs.setdefault("block_length", min(MDM_BLOCK_LENGTH, gen_length))
      self.decode_kwargs.setdefault("steps", gen_length)

  def encode(self, text: str) -> list[int]:
    """Prompt ids of one text (after the chat template when it is on)."""
    ids = self.tokenizer.encode(format_prompt(self.tokenizer, text, self.chat_template))
    if not ids:
      raise ValueError("The prompt is empty after tokenisation; give at least one character.")
    return ids

  def decode_ids(self, prompt_ids: Sequence[Sequence[int]]) -> DecodeResult:
    """Decode token-id prompts (one batch) with this sampler's method and knobs."""
    return self.decoder(self.model, prompt_ids, **self.decode_kwargs)

  def generate(self, texts: Sequence[str]) -> tuple[list[str], DecodeResult]:
    """Decode a batch of text prompts; returns the answers' texts and the full result."""
    result = self.decode_ids([self.encode(t) for t in texts])
    return [self.tokenizer.decode(tokens) for tokens in result.tokens], result

  def __call__(self, texts: str | Sequence[str]) -> str | list[str]:
    """One text -> its answer; a list of texts -> their answers (decoded as one batch)."""
    if isinstance(texts, str):
      return self.generate([texts])[0][0]
    return self.generate(list(texts))[0]
