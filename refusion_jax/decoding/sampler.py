"""Text in, text out: a notebook-friendly front end over the three decoders.

    sampler = Sampler(model, "bytes")                 # ReFusion, default knobs
    sampler("2 + 2 =")                                # -> str
    sampler(["a", "b"])                               # -> list[str], one batch
    texts, result = sampler.generate(["a", "b"])      # + the DecodeResult (trace, TPF)
    Sampler(model, tok, method="ar", gen_length=32)   # the baselines, same interface
    Sampler(model, tok, batch_size=8)(texts)          # many texts, 8 rows kept busy (continuous batching)

Prompts are padded into the length buckets of `refusion_jax.decoding.prompts`,
so calls with new prompts of a bucket reuse the compiled program: with
`batch_size`, whatever the number of texts; without, for the same number.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from refusion_jax.data.special_tokens import resolve_special_tokens
from refusion_jax.data.tokenizer import Tokenizer, format_prompt, load_tokenizer
from refusion_jax.decoding import defaults
from refusion_jax.decoding.ar import ar_generate
from refusion_jax.decoding.mdm import mdm_generate
from refusion_jax.decoding.refusion import generate
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.model.transformer import Transformer, inference_view

# The decoder of each method; its default knobs are `defaults.method_defaults(method, gen_length)`.
METHODS: dict[str, Callable[..., DecodeResult]] = {"refusion": generate, "ar": ar_generate, "mdm": mdm_generate}


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
        defaults of `refusion_jax.decoding.defaults` (MDM's block length and
        steps follow gen_length).
    """
    if method not in METHODS:
      raise ValueError(f"Unknown method {method!r}; choose one of {sorted(METHODS)}.")
    self.decoder = METHODS[method]
    options = decoder_options(self.decoder)
    unknown = sorted(set(decode_kwargs) - set(options))
    if unknown:
      raise ValueError(f"method={method!r} takes no {', '.join(unknown)}; its options are {options}.")
    self.model = inference_view(model)  # remat off and weights cast once, not per call
    self.method = method
    self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    self.chat_template = chat_template
    special = resolve_special_tokens(tokenizer=self.tokenizer, config=model.config)
    special = dict(mask_id=special.mask, eos_id=special.eos, pad_id=special.pad)
    self.decode_kwargs = {k: v for k, v in special.items() if k in options and v is not None}
    self.decode_kwargs.update(defaults.method_defaults(method, decode_kwargs.get("gen_length", defaults.GEN_LENGTH)))
    self.decode_kwargs.update(decode_kwargs)

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
