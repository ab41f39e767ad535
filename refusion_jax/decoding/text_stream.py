"""An answer's text as it grows: increments of the contiguous committed prefix, stop strings applied.

ReFusion commits slots out of order (docs/method.md §2), so only the answer's
leading run of committed tokens is text that will not change. `TextStream`
turns each longer run into the text to send next. The increments joined equal
the text of the whole answer exactly, because what could still change is held
back: a trailing U+FFFD (a multi-byte character cut by a token boundary, which
the next token may complete) and a tail that may be the start of a stop string
(`stop_strings.settled_cut`). The server's streaming and `Sampler.stream`
both read answers through it, and its one final update gives the text of an
answer that is not streamed, so the two agree by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.stop_strings import settled_cut

# What a decoder writes for a cut multi-byte character: it may turn into a real character with the next token.
REPLACEMENT_CHARACTER = "\ufffd"

FINISH_STOP = "stop"  # the answer ended: EOS or a stop string
FINISH_LENGTH = "length"  # the token limit (the request's max_tokens or the answer length G) ended it


@dataclasses.dataclass
class TextStream:
  """The text of one answer, increment by increment.

  Attributes:
    tokenizer: decodes ids to text.
    eos_id: the answer ends after this id (`checks.NO_TOKEN`, -1: never).
    max_tokens: the answer ends after this many tokens.
    stops: stop strings (`stop_strings.check_stop_strings`).
    stop_ids: token ids that end the answer as the EOS does, their own text left out (OpenAI's `stop_token_ids`).
    text: the text sent so far.
    tokens: the answer's ids that `text` was read from (cut after the EOS or a stop id, and at max_tokens).
    finish_reason: None while the answer may grow, else FINISH_STOP or FINISH_LENGTH.
  """

  tokenizer: Tokenizer
  eos_id: int
  max_tokens: int
  stops: tuple[str, ...] = ()
  stop_ids: tuple[int, ...] = ()
  text: str = ""
  tokens: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None

  def update(self, prefix: Sequence[int], final: bool = False) -> str:
    """The text to send now, given the answer's committed prefix.

    Args:
      prefix: the leading run of committed answer ids (`committed_prefix`), at least as long as the last one.
      final: the decode of this answer is over (`prefix` is the whole answer).

    Returns:
      The new text ("" when nothing settled); `finish_reason` is set once the answer is over, after which
      the answer's decode may be stopped and further updates return "".
    """
    if self.finish_reason is not None:
      return ""
    tokens = [int(t) for t in prefix[: self.max_tokens]]
    ends = (self.eos_id, *self.stop_ids)
    eos = next((at for at, token in enumerate(tokens) if token in ends), None)
    shown = tokens
    if eos is not None:
      tokens = tokens[: eos + 1]
      shown = tokens if tokens[eos] == self.eos_id else tokens[:eos]  # a stop id's own text is not sent
    ended = final or eos is not None or len(tokens) == self.max_tokens
    full = self.tokenizer.decode(shown)
    if not ended:
      full = full.rstrip(REPLACEMENT_CHARACTER)
    end, stopped = settled_cut(full, self.stops, final=ended)
    settled = full[:end]
    if settled.startswith(self.text):
      increment, self.text = settled[len(self.text) :], settled
    elif not ended:  # the decoder changed an earlier character (merging across tokens): wait for more
      return ""
    else:  # what was sent stays the answer's text
      increment = ""
    self.tokens = tokens
    if stopped or eos is not None:
      self.finish_reason = FINISH_STOP
    elif ended:
      self.finish_reason = FINISH_LENGTH
    return increment
