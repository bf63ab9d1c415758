"""What the swarm coordinator writes to the run's ledger (covey.trust.ledger), in the entry
types and payloads covey.trust.incentives.Book checks, so `covey ledger verify` audits a
swarm run like any other: pay per microbatch, and a proven lie's dispute and slash.

`epoch` plays the ledger's `round`: one per payout or verdict, so each (round, peer) pair
is paid at most once.
"""

from __future__ import annotations

import time

from covey.coordinator.accounts import Accounts
from covey.swarm.config import SwarmConfig


def pay(accounts: Accounts, cfg: SwarmConfig, due: dict[str, int], epoch: int) -> None:
    """A "contribution accepted" and a "reward" (work) per server for its `due` tokens of
    verified work (covey.swarm.evidence.tokens_paid). Banned or unknown servers and zero
    counts are skipped (a liar convicted before the payout is not paid)."""
    now = time.time()
    book = accounts.book
    due = {p: n for p, n in due.items() if n > 0 and p in book.accounts
           and not book.accounts[p].banned}  # fmt: skip
    if not due:
        return
    with accounts.transaction() as c:
        for peer, tokens in sorted(due.items()):
            n = max(1, round(tokens / (cfg.microbatch * cfg.seq_len)))  # in microbatches
            accounts.append(
                c, "contribution accepted",
                {"round": epoch, "peer_id": peer, "cid": "", "tokens": tokens, "inner_steps": n,
                 "sampled": False, "rate": cfg.verify_rate, "draw": "",
                 "request_id": f"swarm-{epoch}", "nonce": "", "signature": ""},
                now,
            )  # fmt: skip
            accounts.append(
                c, "reward",
                {"round": epoch, "peer_id": peer, "tokens": tokens, "kind": "work",
                 "amount": accounts.book.work_reward(tokens)},
                now,
            )  # fmt: skip


def convict(
    accounts: Accounts, epoch: int, stage: int, liars: list[str], witness: str, detail: str
) -> list[str]:
    """A "dispute" (fraud; `witness`, the honest server or the trainer, as its validator)
    and a "slash" (slash_fraction of stake; the Book bans the peer) per liar not banned
    yet. Returns the liars convicted now."""
    now = time.time()
    done = []
    with accounts.transaction() as c:
        for liar in liars:
            if accounts.book.accounts[liar].banned:
                continue
            accounts.append(
                c, "dispute",
                {"round": epoch, "peer_id": liar, "validator_id": witness, "segment": stage,
                 "outcome": "fraud", "detail": detail[:200]},
                now,
            )  # fmt: skip
            accounts.append(
                c, "slash",
                {"round": epoch, "peer_id": liar, "reason": "swarm: wrong reply",
                 "amount": accounts.book.slash_amount(liar)},
                now,
            )  # fmt: skip
            done.append(liar)
    return done
