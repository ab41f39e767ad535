"""Answer tokens' log-probabilities, handed out with the text they make up (OpenAI's `logprobs` objects).

The engine reads an answer's committed prefix with each token's log-probability
under the distribution it was drawn from (`Engine.partial_logprobs`,
docs/method.md). The text sent lags the tokens read (a cut multi-byte character,
a possible stop string are held back, `decoding.text_stream`), and a stop string
may end the answer inside a token, so `AnswerLogprobs` gives out a token once
the text sent covers it: while streaming, the tokens whose text is wholly sent;
at the end, every token that begins within the answer's text, and a closing
EOS. A token's offset is where its text begins in the answer (a token inside a
multi-byte character begins where that character does).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from refusion_jax.data.tokenizer import ByteTokenizer, Tokenizer
from refusion_jax.decoding.text_stream import REPLACEMENT_CHARACTER

# OpenAI's stand-in for a log-probability too small to write (JSON has no -Infinity).
LOWEST_LOGPROB = -9999.0


@dataclasses.dataclass
class TokenLogprob:
  """One answer token: its id, its text alone, its log-probability and where its text begins in the answer."""

  token: int
  text: str
  logprob: float
  offset: int


def token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
  """The UTF-8 bytes of `token` (the byte tokenizer's own byte; else its text's encoding)."""
  if isinstance(tokenizer, ByteTokenizer):
    return [token] if 0 <= token < 256 else []
  return list(tokenizer.decode([token]).encode("utf-8"))


def writable(logprob: float) -> float:
  """`logprob` as JSON can carry it: LOWEST_LOGPROB for -inf or NaN."""
  return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


class AnswerLogprobs:
  """The tokens and log-probabilities of one answer as they are read, given out as its text is sent."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.given = 0  # tokens given out so far; the text of tokens[:given] ends on a whole character
    self.offset = 0  # where tokens[given]'s text begins

  def add(self, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
    """Append the answer ids read after the last ones, with their log-probabilities."""
    if len(tokens) != len(logprobs):
      raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} log-probabilities.")
    self.tokens += [int(t) for t in tokens]
    self.logprobs += [float(p) for p in logprobs]

  def take(self, text: str, final: bool) -> list[TokenLogprob]:
    """The tokens not given out yet that `text`, the answer's text sent so far, covers.

    Args:
      text: the answer's text sent so far (all of it when `final`).
      final: the answer is over: also give out a token that a stop string cut, and a closing EOS.
    """
    rest = text[self.offset :]
    pieces: dict[int, str] = {}

    def piece(end: int) -> str:  # the text of tokens[given:end], decoded together (a token alone may decode apart)
      if end not in pieces:
        pieces[end] = self.tokenizer.decode(self.tokens[self.given : end])
      return pieces[end]

    def begins(k: int) -> int:  # where token k's text begins: tokens inside a character begin where it does
      return self.offset + len(os.path.commonprefix([piece(k), rest]))

    end = self.given
    if final:
      while end < len(self.tokens) and begins(end) < len(text):
        end += 1
      while end < len(self.tokens) and not self.tokenizer.decode(self.tokens[end : end + 1]):  # EOS, specials
        end += 1
    else:  # the longest run of tokens whose text is wholly sent
      for stop in range(self.given + 1, len(self.tokens) + 1):
        if len(piece(stop).rstrip(REPLACEMENT_CHARACTER)) > len(rest):
          break
        if rest.startswith(piece(stop)):
          end = stop
    given = [
      TokenLogprob(self.tokens[k], self.tokenizer.decode([self.tokens[k]]), writable(self.logprobs[k]), begins(k))
      for k in range(self.given, end)
    ]
    self.offset = begins(end)
    self.given = end
    return given
