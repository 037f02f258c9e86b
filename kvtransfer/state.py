"""Transfer state, ordered so that the most conservative state across TP ranks is a `min`."""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3

    @classmethod
    def combine(cls, states) -> TransferState:
        """One request's state across the ranks that carry parts of it."""
        return min(states, default=cls.PENDING)
