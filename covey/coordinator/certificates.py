"""A round's certificate: who was accepted (with weights and blob providers) and who was
refused and why, signed by the coordinator's key (covey.trust.certify)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from covey.protocol import schemas
from covey.trust.certify import sign_certificate

from .peers import Peers

if TYPE_CHECKING:
    from covey.trust.identity import Identity

    from .db import Database
    from .views import OpenRound


def make_certificate(
    db: Database,
    identity: Identity,
    run_id: str,
    start_hash: str,
    rnd: OpenRound,
    rows: list[Any],
    new_hash: str,
    new_cid: str,
    new_size: int,
    now: float,
    reason: str,
    ledger_head: dict[str, Any] | None = None,
) -> schemas.Certificate:
    """The signed certificate of `rnd` committing `rows` (its contributions, by peer id)
    from `start_hash` to `new_hash`; members without an accepted contribution are listed
    as rejected, with the reason intake recorded or "no contribution". `ledger_head`: the
    ledger's signed head as of the commit (covey.coordinator.accounts.Accounts.head),
    which the certificate names and peers keep."""
    total = sum(r["tokens"] for r in rows)
    peers = Peers(db)
    names = {p["peer_id"]: p["name"] or "" for p in peers.every()}
    urls = peers.blob_urls()
    accepted = [
        schemas.AcceptedContribution(
            peer_id=r["peer_id"],
            name=names.get(r["peer_id"], ""),
            cid=r["cid"],
            size=r["size"],
            tokens=r["tokens"],
            inner_steps=r["inner_steps"],
            fragment=r["fragment"],
            weight=r["tokens"] / total,
            providers=[urls[r["peer_id"]]] if r["peer_id"] in urls else [],
        )
        for r in rows
    ]
    done = {r["peer_id"] for r in rows}
    rejected = {
        x["peer_id"]: x["reason"]
        for x in db.query(
            "SELECT peer_id, reason FROM rejections WHERE round = ? AND attempt = ? ORDER BY id",
            (rnd.round, rnd.attempt),
        )
        if x["peer_id"] not in done
    }
    for m in rnd.members:
        rejected.setdefault(m, "no contribution") if m not in done else None
    unsigned = schemas.Certificate(
        run_id=run_id,
        round=rnd.round,
        attempt=rnd.attempt,
        start_hash=start_hash,
        new_hash=new_hash,
        new_cid=new_cid,
        new_size=new_size,
        accepted=accepted,
        rejected=[
            schemas.Rejection(peer_id=p, name=names.get(p, ""), reason=w)
            for p, w in sorted(rejected.items())
        ],
        closed_at=now,
        reason=reason,
        ledger_head=None if ledger_head is None else schemas.LedgerHead(**ledger_head),
    )
    return sign_certificate(unsigned, identity)
