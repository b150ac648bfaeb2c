"""IncrementalDetokenizer: text deltas from a growing token list, with stop strings.

Text is released only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so a
multi-byte character split over tokens is never emitted half-way.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = list(prompt_token_ids[-6:])  # context for leading-space handling
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text (cut before a stop string, which sets stopped).
        With stop strings, up to (longest stop - 1) characters are held back until `flush`."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._apply_stop(delta)

    def _apply_stop(self, delta: str) -> str:
        self.text += delta
        if not self.stop:
            return self._emit(len(self.text))
        window = max(len(s) for s in self.stop)
        start = max(0, self._emitted - window)
        cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if cuts:
            self.stopped = True
            self.text = self.text[:min(cuts)]
            return self._emit(len(self.text))
        # Hold back what could still become the start of a stop string.
        return self._emit(max(self._emitted, len(self.text) - window + 1))

    def flush(self) -> str:
        """The text held back for stop-string matching; call when the request ends."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self._emitted:upto]
        self._emitted = max(self._emitted, upto)
        return out
