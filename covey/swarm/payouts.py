"""What the swarm coordinator writes to the run's ledger (covey.trust.ledger), in the entry
types and payloads covey.trust.incentives.Book checks, so `covey ledger verify` audits a
swarm run like any other: pay per microbatch, a proven lie's dispute and slash, and the
missed fraud of a server whose reply agreed with a convicted one.

A duplicated hop's second server is the hop's check. When the referee recomputes agreed
evidence (a spot check) and convicts one server while the other's reply, which agreed with
the lie within `tolerance`, is itself within it of the truth, that other server passed a
lie: it is written as having agreed on the liar's item (a "verification" with outcome
"agree") and pays the rounds mode's missed-fraud penalty (covey.coordinator.checks.Checks:
validator_slash_fraction of its stake, not banned). The Book checks each penalty against
that agreement and the conviction, so `covey ledger verify` replays it.

`epoch` plays the ledger's `round`: one per payout or verdict, so each (round, peer) pair
is paid at most once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from covey.coordinator.accounts import Accounts
from covey.coordinator.checks import Checks
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
    accounts: Accounts,
    epoch: int,
    stage: int,
    liars: list[str],
    witness: str,
    detail: str,
    agreed: Sequence[str] = (),
    proof: dict[str, Any] | None = None,
) -> list[str]:
    """A "dispute" (fraud; `witness`, the honest server or the trainer, as its validator)
    and a "slash" (slash_fraction of stake; the Book bans the peer) per liar not banned
    yet; then, for each server in `agreed` (its reply agreed with a liar's: a spot check),
    a "verification" agreeing on the liar's item and the missed-fraud penalty it costs (see
    the module). `proof`: the dispute's evidence (covey.trust.swarm_evidence), if kept.
    Returns the liars convicted now."""
    now = time.time()
    done = []
    with accounts.transaction() as c:
        for liar in liars:
            if accounts.book.accounts[liar].banned:
                continue
            for partner in agreed:
                accounts.append(
                    c, "verification",
                    {"round": epoch, "peer_id": liar, "validator_id": partner,
                     "outcome": "agree", "distance": None, "exact": False},
                    now,
                )  # fmt: skip
            accounts.append(
                c, "dispute",
                {"round": epoch, "peer_id": liar, "validator_id": witness, "segment": stage,
                 "outcome": "fraud", "detail": detail[:200],
                 **({"evidence": proof} if proof is not None else {})},
                now,
            )  # fmt: skip
            accounts.append(
                c, "slash",
                {"round": epoch, "peer_id": liar, "reason": "swarm: wrong reply",
                 "amount": accounts.book.slash_amount(liar)},
                now,
            )  # fmt: skip
            if agreed:
                why = f"swarm stage {stage}: its reply agreed with a wrong one ({detail})"
                Checks(accounts).convict(c, epoch, liar, why, now)
            done.append(liar)
    return done
