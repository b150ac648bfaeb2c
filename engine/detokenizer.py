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
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text (cut before a stop string, which sets stopped)."""
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
        if not self.stop:
            self.text += delta
            return delta
        start = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
        combined = self.text + delta
        cut = None
        for s in self.stop:
            idx = combined.find(s, start)
            if idx != -1 and (cut is None or idx < cut):
                cut = idx
        if cut is None:
            self.text = combined
            return delta
        self.stopped = True
        out = combined[len(self.text):cut] if cut >= len(self.text) else ""
        self.text = combined[:cut]
        return out
