"""The error of a request the coordinator refuses, shared by the host's parts and every
mode (rounds, covey.rl, covey.swarm): each maps to an HTTP status."""

from __future__ import annotations


class Rejected(Exception):
    """A request that cannot be honoured; `status` is the HTTP status it maps to. Raised
    before any state changes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
