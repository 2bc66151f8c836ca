"""Streaming detokenization with stop strings.

Text comes from tokenizers' `DecodeStream` (Rust, one call per token): it decodes a small window, from a few
tokens already turned into text (context, so that merges and leading spaces come out right) to the end, and
returns what the window adds. While the window's text ends in U+FFFD (a character still split across tokens) it
returns nothing and holds the tokens; at finish, tokens still held are decoded as they are (U+FFFD included), so
the deltas add up to a full decode of the output. The first window starts with the prompt's last tokens.
Stop strings: a tail that could still grow into one is held back; a match cuts the text there. Only that tail is
kept as a string, so an update costs the same at any output length.
"""
from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream

from replicas.sampling_params import SamplingParams
from replicas.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5     # tokens decoded as context before the first new one (the prompt's, at the start)
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = tuple(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._longest_stop = max(map(len, self.stop), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])    # context + output ids
        self._stream = self._new_stream(self._ids)
        self._held = 0                           # trailing ids the stream holds back (an incomplete character)
        self.num_tokens = 0                      # output tokens seen
        self._unsent = ""                        # decoded text held back: a tail that may grow into a stop string
        self._sent: list[str] = []               # the deltas returned so far
        self.stop_reason: Optional[str] = None   # the stop string that ended the output, if any

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """The text returned so far: the concatenated deltas."""
        return "".join(self._sent)

    def _new_stream(self, context: list[int]) -> DecodeStream:
        """A stream that has decoded `context` (as context: its text is not returned). Primed a token at a time, the
        one way every tokenizers release with DecodeStream offers."""
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            for token in context:
                stream.step(self.tokenizer.backend, token)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            return DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return stream

    def _step(self, new_token_ids: list[int]) -> str:
        """The text the new ids complete ("" while the last character is incomplete)."""
        backend, texts = self.tokenizer.backend, []
        for token in new_token_ids:
            self._ids.append(token)
            try:
                pieces = [self._stream.step(backend, token)]
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                # The stream refuses a window whose text does not extend its previous text (a decoder that
                # rewrites earlier characters once more tokens follow): a new stream, from the last emitted tokens
                # as context, takes the held ids and this one.
                emitted = len(self._ids) - self._held - 1
                self._stream = self._new_stream(self._ids[max(0, emitted - _CONTEXT_TOKENS):emitted])
                self._held = 0
                pieces = [self._stream.step(backend, t) for t in self._ids[emitted:]]
            for text in pieces:
                if text is None:
                    self._held += 1
                else:
                    self._held = 0
                    texts.append(text)
        return "".join(texts)

    def _held_text(self) -> str:
        """The held ids decoded as they are, after the last emitted tokens as context."""
        if not self._held:
            return ""
        emitted = len(self._ids) - self._held
        window = self._ids[max(0, emitted - _CONTEXT_TOKENS):]
        read = self.tokenizer.decode(window[:len(window) - self._held], self.skip_special_tokens)
        return self.tokenizer.decode(window, self.skip_special_tokens)[len(read):]

    def update(self, new_token_ids: list[int]) -> tuple[str, Optional[str]]:
        """Feed new output tokens; returns (text to stream now, the stop string matched or None).
        After a stop string matched, further tokens are ignored."""
        if self.finished or not new_token_ids:
            return "", None
        self.num_tokens += len(new_token_ids)
        return self._take(self._step(new_token_ids), final=False)

    def flush(self) -> str:
        """At finish: the held-back tail (a possible stop-string start, an incomplete character). A stop string
        found in it still truncates the text and sets `stop_reason`."""
        if self.finished:
            return ""
        return self._take(self._held_text(), final=True)[0]

    def _take(self, new_text: str, final: bool) -> tuple[str, Optional[str]]:
        if not self.stop:
            self._sent.append(new_text)
            return new_text, None
        searched_to = len(self._unsent)     # a match starting before this would have been found already
        self._unsent += new_text
        if self.num_tokens < self.min_tokens:
            return self._send(len(self._unsent)), None
        stop, at = self._find_stop(max(0, searched_to - self._longest_stop + 1))
        if stop is not None:
            self.stop_reason = stop
            return self._send(at + len(stop) if self.include_stop else at), stop
        return self._send(len(self._unsent) - (0 if final else self._stop_prefix_length())), None

    def _send(self, end: int) -> str:
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        self._sent.append(delta)
        return delta

    def _find_stop(self, start: int) -> tuple[Optional[str], int]:
        """The earliest stop string at or after `start` in the text not yet sent."""
        best, best_at = None, -1
        for s in self.stop:
            at = self._unsent.find(s, start)
            if at != -1 and (best is None or at < best_at):
                best, best_at = s, at
        return best, best_at

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the unsent text that could still grow into a stop string."""
        tail = self._unsent[max(0, len(self._unsent) - self._longest_stop + 1):]
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0
