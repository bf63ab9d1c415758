"""A peer's JSON client for the coordinator's /v1 API, with bounded patience.

A refusal (4xx) is final and raised at once as `PeerRejected` with the coordinator's
message. An unreachable or failing coordinator (connection error, timeout, 5xx) is
retried with capped backoff until `lost_s` has passed since the first failure, then
`CoordinatorLost` is raised: a restarting coordinator is waited for, a dead one is not
waited for forever.

With an identity, every POST is signed (covey.trust.identity) afresh on each attempt, so a
retry carries a new nonce instead of looking like a replay, and for the path it is sent
to (its purpose), so callers never name the endpoint twice.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

from covey.trust.identity import NO_ROUND, Identity, request_purpose

log = logging.getLogger("covey.client")


class PeerRejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class CoordinatorLost(Exception):
    """The coordinator stayed unreachable for longer than the run allows."""


class CoordinatorClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        lost_s: float = 120.0,
        stop: threading.Event | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.lost_s = lost_s
        self.stop = stop or threading.Event()
        self.identity = identity
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def configure(self, timeout_s: float, lost_s: float) -> None:
        """Adopt the run's limits once its spec is known."""
        self.timeout_s, self.lost_s = timeout_s, lost_s
        self._http.timeout = httpx.Timeout(timeout_s)

    def get(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        quiet: bool = False,
        headers: dict[str, str] | None = None,
    ) -> Any:
        return self._patient("GET", path, params=params, quiet=quiet, headers=headers)

    def post(
        self,
        path: str,
        body: dict[str, Any],
        round: int | None = NO_ROUND,
        timeout_s: float | None = None,
    ) -> Any:
        """POST JSON, signed for `round` when the client has an identity (round None: the
        body is already signed and goes as it is). `timeout_s` replaces the client's
        per-request timeout for this call: an answer that waits on the coordinator moving
        a model-sized blob takes longer, and a pre-signed body cannot be sent twice (its
        retry is refused as a replay)."""
        extra = {"timeout": timeout_s} if timeout_s is not None else {}
        return self._patient("POST", path, body=body, round=round, **extra)

    def halted(self, timeout_s: float) -> str | None:
        """The owner's HALT as the coordinator's `/v1/host` shows it ("... at round N:
        reason"), in one attempt; None while the run goes on or when no answer came."""
        try:
            resp = self._http.get("/v1/host", timeout=timeout_s)
            h = resp.json().get("halted") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not isinstance(h, dict):
            return None
        return f"halted by its owner at round {h.get('round')}: {h.get('reason')}"

    def post_once(
        self, path: str, body: dict[str, Any], timeout_s: float, round: int | None = NO_ROUND
    ) -> Any:
        """One attempt with its own timeout (heartbeats, the deathrattle)."""
        signed = self._sign(path, body, round)
        return self._decode(self._http.post(path, json=signed, timeout=timeout_s))

    def _sign(self, path: str, body: dict[str, Any], round: int | None) -> dict[str, Any]:
        if self.identity is None or round is None:
            return body
        return self.identity.sign_request(body, round, purpose=request_purpose(path))

    def close(self) -> None:
        self._http.close()

    def _patient(
        self,
        method: str,
        path: str,
        quiet: bool = False,
        body: dict[str, Any] | None = None,
        round: int | None = NO_ROUND,
        **kwargs: Any,
    ) -> Any:
        first_failure: float | None = None
        delay = 0.25
        while True:
            try:
                if body is not None:
                    kwargs["json"] = self._sign(path, body, round)
                resp = self._http.request(method, path, **kwargs)
                if resp.status_code < 500 and resp.status_code != 429:  # 429: busy, retry
                    return self._decode(resp)
                why = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure > self.lost_s:
                raise CoordinatorLost(
                    f"coordinator {self.base_url} unreachable for {now - first_failure:.0f} s "
                    f"({method} {path}: {why})"
                )
            if not quiet:
                log.warning("%s %s failed (%s); retrying in %.1f s", method, path, why, delay)
            if self.stop.wait(delay):
                raise CoordinatorLost(f"stopped while waiting for the coordinator ({why})")
            delay = min(delay * 2, 2.0)

    @staticmethod
    def _decode(resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                message = resp.json().get("error", resp.text)
            except ValueError:
                message = resp.text
            raise PeerRejected(resp.status_code, str(message)[:500])
        return resp.json()
