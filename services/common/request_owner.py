"""Which scheduler replica owns a request, read from the request id the engines see.

A replica names itself in the engine-side id of every request it accepts:
`<client id>.<random>@<scheduler id>` (`owned_id`). Any rank of any engine, in any process, can
then tell the owner (`owner_of`) without being told: its transfer results go to that replica's
control stream alone, and when that replica is lost the engine releases what it holds for it.
"""

from __future__ import annotations

OWNER_SEPARATOR = "@"


def owned_id(request_id: str, scheduler_id: str) -> str:
    """The engine-side id of a request owned by `scheduler_id`."""
    return f"{request_id}{OWNER_SEPARATOR}{scheduler_id}"


def owner_of(request_id: str) -> str | None:
    """The scheduler id that owns an engine-side request id, or None for an id without one
    (every replica then hears of it)."""
    head, sep, owner = request_id.rpartition(OWNER_SEPARATOR)
    return owner if sep and head and owner and "." not in owner else None
