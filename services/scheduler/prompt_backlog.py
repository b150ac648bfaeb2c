"""`PromptBacklog`: the prompt tokens the scheduler sent to each engine and the engine has not
computed yet, and — when a prefill answers — how many tokens the engine computed while that
request waited for it.

An engine batches every waiting prompt into its next step, so a prefill's time from dispatch
to answer covers the tokens queued ahead of it *and* those sent after it that joined its step.
Counting only the tokens ahead (what the backlog was at dispatch) made one four-prompt batch
(1,638 tokens in 3.8 s) read as 402, 787 and 1,207 tokens in 3.8 s each: a flat line that
pushed the prefill fit's fixed part to seconds (decision 0037). So each dispatch gets a ticket;
a prefill that answers before one dispatched earlier adds its tokens to that one's window (it
joined its step), and an answer while a later dispatch is still waiting gives no sample (that
one may have joined the step too, or not: the window is unknown).

Pure and synchronous; ticket ids only ever grow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Waiting:
    num_tokens: int  # the request's own uncached tokens
    num_ahead: int  # the engine's backlog when it was sent
    num_joined: int = 0  # tokens of later dispatches that answered first (joined its step)


@dataclass(slots=True)
class PromptBacklog:
    """See the module docstring. `tokens[engine_id]` is the engine's backlog in tokens."""

    tokens: Counter[str] = field(default_factory=Counter)
    _waiting: dict[str, dict[int, _Waiting]] = field(default_factory=dict)
    _next_ticket: int = 0

    def add(self, engine_id: str, num_tokens: int) -> int:
        """A prompt of `num_tokens` uncached tokens was sent to `engine_id`; returns its ticket."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self._waiting.setdefault(engine_id, {})[ticket] = _Waiting(num_tokens, self.tokens[engine_id])
        self.tokens[engine_id] += num_tokens
        return ticket

    def settle(self, engine_id: str, ticket: int, computed: bool) -> tuple[int, int] | None:
        """The engine answered the ticket's prompt (`computed`) or gave up on it. Returns the
        tokens that were ahead of it at dispatch and all it computed between the dispatch and
        the answer (ahead, own, joined), or None: not computed, an unknown ticket, or a later
        dispatch still waiting (window unknown)."""
        waiting = self._waiting.get(engine_id)
        entry = waiting.pop(ticket, None) if waiting is not None else None
        if entry is None:
            return None
        left = self.tokens[engine_id] - entry.num_tokens
        if left > 0:
            self.tokens[engine_id] = left
        else:
            del self.tokens[engine_id]
        assert waiting is not None
        if not waiting:
            del self._waiting[engine_id]
        if not computed:
            return None
        later_waiting = False
        for other_ticket, other in waiting.items():
            if other_ticket < ticket:
                other.num_joined += entry.num_tokens
            else:
                later_waiting = True
        if later_waiting:
            return None
        return entry.num_ahead, entry.num_ahead + entry.num_tokens + entry.num_joined

    def leaks(self) -> list[str]:
        return [f"backlog {e}: {n} tokens" for e, n in self.tokens.items()] + \
            [f"waiting {e}: {len(w)} prompts" for e, w in self._waiting.items()]
