"""Who sent a request: every state-changing request is signed by its sender's Ed25519 key
over (run id, round, content id, nonce) (covey.trust.identity). A wrong key, an altered
body, another run's or another round's signature, a stale nonce and a replayed one are all
refused with 401 before anything changes. Nonces are remembered in SQLite for the nonce
window, so a replay is refused even across a coordinator restart.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

from covey.trust.identity import nonce_time, request_message, verify

from .views import Rejected

if TYPE_CHECKING:
    from covey.config import RunConfig

    from .db import Database


class Auth:
    # provided by Coordinator
    cfg: RunConfig
    db: Database

    def authenticate(
        self, raw: dict[str, Any], round: int, peer_id: str, public_key: str | None = None
    ) -> None:
        """Check `raw` (the request body as received) is signed by `peer_id`'s key (known
        from its join, or `public_key` for the join itself) for `round`, with a fresh
        nonce, and use the nonce up. Rejected(401/404) otherwise."""
        if public_key is None:
            row = self.db.one("SELECT public_key FROM peers WHERE peer_id = ?", (peer_id,))
            if row is None or not row["public_key"]:
                raise Rejected(404, f"unknown peer {peer_id}: join first")
            public_key = row["public_key"]
        signature = raw.get("signature")
        if not isinstance(signature, str) or not verify(
            public_key, request_message(raw, round), signature
        ):
            raise Rejected(
                401,
                f"signature does not verify for peer {peer_id[:12]}, run {raw.get('run_id')}, "
                f"round {round}: wrong key, altered body, or signed for another run or round",
            )
        nonce = str(raw.get("nonce"))
        now = time.time()
        age = now - nonce_time(nonce)
        window = self.cfg.trust.nonce_window_s
        if abs(age) > window:
            raise Rejected(401, f"nonce is {age:.0f} s old; requests must be within {window:.0f} s")
        try:
            with self.db.transaction() as c:
                c.execute("INSERT INTO nonces VALUES (?, ?, ?)", (peer_id, nonce, now))
        except sqlite3.IntegrityError:
            raise Rejected(401, f"replayed request: nonce {nonce} was already used") from None

    def prune_nonces(self, now: float) -> None:
        """Forget nonces older than the window: requests that old are refused anyway."""
        with self.db.transaction() as c:
            c.execute("DELETE FROM nonces WHERE at < ?", (now - 2 * self.cfg.trust.nonce_window_s,))
