"""Streaming detokenization with stop strings.

Each update decodes only a small window of tokens: from `prefix_offset` (a few tokens of context already
turned into text, so that merges and leading spaces come out right) to the end, and emits what the window
adds beyond its already-read part (`prefix_offset:read_offset`). Text ending in U+FFFD means a character
is still split across tokens: the text before it goes out, the character waits for the next token.
Stop strings: a tail that could still grow into one is held back; a match cuts the text there.
"""
from __future__ import annotations

from typing import Optional

from replicas.sampling_params import SamplingParams
from replicas.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5     # prompt tokens decoded as context before the first output token
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = tuple(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._longest_stop = max(map(len, self.stop), default=0)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context                      # context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._window_taken = 0                   # chars of the current window's new text already taken
        self.num_tokens = 0                      # output tokens seen
        self._decoded = ""                       # all text decoded so far (past the context)
        self.text = ""                           # text returned so far: the concatenated deltas
        self.stop_reason: Optional[str] = None   # the stop string that ended the output, if any

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def _decode_window(self, final: bool = False) -> str:
        """Text the ids past read_offset add. While the last character is incomplete, only the text before it
        (once), and the offsets stay; `final` takes everything."""
        window = self._ids[self._prefix_offset:]
        read = self.tokenizer.decode(window[:self._read_offset - self._prefix_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(window, self.skip_special_tokens)
        new = full[len(read):]
        if new.endswith(_INCOMPLETE) and not final:
            ready = new.rstrip(_INCOMPLETE)
            delta = ready[self._window_taken:]
            self._window_taken = max(self._window_taken, len(ready))
            return delta
        delta = new[self._window_taken:]
        if new:
            self._prefix_offset, self._read_offset, self._window_taken = self._read_offset, len(self._ids), 0
        return delta

    def update(self, new_token_ids: list[int]) -> tuple[str, Optional[str]]:
        """Feed new output tokens; returns (text to stream now, the stop string matched or None).
        After a stop string matched, further tokens are ignored."""
        if self.finished or not new_token_ids:
            return "", None
        self._ids.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        return self._take(self._decode_window(), final=False)

    def flush(self) -> str:
        """At finish: the held-back tail (a possible stop-string start, an incomplete character). A stop string
        found in it still truncates the text and sets `stop_reason`."""
        if self.finished:
            return ""
        return self._take(self._decode_window(final=True), final=True)[0]

    def _take(self, new_text: str, final: bool) -> tuple[str, Optional[str]]:
        searched_to = len(self._decoded)
        self._decoded += new_text
        if not self.stop or self.num_tokens < self.min_tokens:
            return self._emit(len(self._decoded)), None
        stop, at = self._find_stop(max(len(self.text), searched_to - self._longest_stop + 1))
        if stop is not None:
            self.stop_reason = stop
            self._decoded = self._decoded[:at + len(stop) if self.include_stop else at]
            return self._emit(len(self._decoded)), stop
        return self._emit(len(self._decoded) - (0 if final else self._stop_prefix_length())), None

    def _emit(self, end: int) -> str:
        delta = self._decoded[len(self.text):end]
        self.text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[Optional[str], int]:
        """The earliest stop string at or after `start` in the decoded text."""
        best, best_at = None, -1
        for s in self.stop:
            at = self._decoded.find(s, start)
            if at != -1 and (best is None or at < best_at):
                best, best_at = s, at
        return best, best_at

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the decoded text that could still grow into a stop string."""
        tail = self._decoded[max(len(self.text), len(self._decoded) - self._longest_stop + 1):]
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0
