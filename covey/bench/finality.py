"""`covey bench trust --only finality`: can a party clear its own cheats with its own
validator keys? Measured on the book's own draw (covey.trust.draws.Draws.draw: stake-weighted
with a per-key cap, an established validator in every drawn set), over many beacons.

A party holds a share f of the validators' capped stake, split over two keys; five honest
validators hold the rest (stake 20 each, cap 100). Its worker cheats on every contribution;
a contribution drawn for checks is cleared only when every validator drawn for it is the
party's (they agree), and convicted otherwise (an honest validator's dispute: the referee
convicts it; canaries keep honest validators re-executing). Scenarios: the party's keys
established (they did honest checks first: the worst case) or fresh, and a worker checked
by one validator (an established worker) or by `validators_per_check` = 2 (a new or
low-reputation one), with and without an audit of cleared work (one more check by a
validator not yet tried, at `audit_rate`, default 0.1). Stated (`stated`): f for one
check, f x (f/2) / (1 - f/2) for two (two draws without replacement, weights f/2 per
party key), times the chance the audit misses or lands on the party too; 0 when its keys
are fresh (the established validator every set holds is then an honest one). P(clear)
is the share of draws cleared; the number of cheats cleared before the first conviction
is geometric: P / (1 - P). Pure and in one process.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from covey.trust.incentives import Book, Policy
from covey.trust.policy import Account

HONEST, STAKE, CAP = 5, 20.0, 100.0
POLICY = Policy(
    min_stake=10.0,
    reward_per_token=0.001,
    slash_fraction=0.5,
    catch_reward=1.0,
    new_peer_rate=1.0,
    new_peer_contributions=3,
    low_reputation=0.5,
    sample_rate=0.25,
    min_validator_stake=5.0,
    validator_slash_fraction=0.5,
    check_reward=0.1,
    validators_per_check=2,
    validator_round_cap=1_000_000,
    canary_rate=0.0,
    validator_stake_cap=CAP,
    established_checks=5,
    audit_rate=0.1,
)


def book_for(share: float, party_established: bool) -> tuple[Book, set[str]]:
    """A book with five honest established validators and a party's two keys holding
    `share` of the capped stake (established or fresh). Returns it and the party's keys."""
    book = Book()
    book.policy, book.run_id = POLICY, "bench-finality"
    party_total = HONEST * STAKE * share / (1 - share)
    for i in range(HONEST):
        book.accounts[f"honest{i}"] = Account(f"honest{i}", f"h{i}", "validator", "", stake=STAKE,
                                              checks=50)  # fmt: skip
    party = {"party0", "party1"}
    for key in sorted(party):
        book.accounts[key] = Account(key, key, "validator", "", stake=party_total / 2,
                                     checks=50 if party_established else 0)  # fmt: skip
    book.accounts["cheater"] = Account("cheater", "cheater", "worker", "", stake=10.0)
    book._last_certificate = "0" * 64
    return book, party


def clear_probability(
    book: Book, party: set[str], checks: int, draws: int, audit_rate: float = 0.0
) -> float:
    """The share of `draws` rounds in which every validator drawn is the party's, the
    audit's too when one is drawn (a pseudo-random audit draw per round, at `audit_rate`)."""
    cleared = 0
    for r in range(draws):
        chosen = book.draw(r, "cheater", checks)
        if not set(chosen) <= party:
            continue
        if random.Random(r).random() < audit_rate:  # audited: one validator not yet tried
            book._tried[(r, "cheater")] = set(chosen)
            chosen = book.draw(r, "cheater", 1)
            del book._tried[(r, "cheater")]
        cleared += set(chosen) <= party
    return cleared / draws


def stated(share: float, checks: int, audit_rate: float = 0.0) -> float:
    """P(every one of `checks` stake-weighted draws without replacement is the party's, and
    the audit's, drawn at `audit_rate`), its share split evenly over two keys: f for one
    check, f x (f/2) / (1 - f/2) for two; an audit after one check is the party's with
    probability (f/2) / (1 - f/2), after two never (both its keys were tried)."""
    rest = (share / 2) / (1 - share / 2)
    if checks == 1:
        return share * (1 - audit_rate * (1 - rest))
    return share * rest * (1 - audit_rate) if checks == 2 else 0.0


def finality_report(
    draws: int = 20_000, audit_rate: float = 0.1, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Rows per (f, party keys established or fresh, checks per item, audit rate)."""
    rows = []
    for share in (0.2, 0.4):
        for established in (True, False):
            book, party = book_for(share, established)
            for checks in (1, 2):
                for audit in (0.0, audit_rate) if established else (0.0,):
                    p = clear_probability(book, party, checks, draws, audit)
                    expected = p / (1 - p) if p < 1 else float("inf")
                    row = {
                        "share": share,
                        "party_established": established,
                        "checks": checks,
                        "audit_rate": audit,
                        "draws": draws,
                        "p_clear": p,
                        "stated_p_clear": stated(share, checks, audit) if established else 0.0,
                        "cheats_before_conviction": expected,
                    }
                    rows.append(row)
                    echo(
                        f"f={share}: party keys {'established' if established else 'fresh'}, "
                        f"{checks} check(s), audit rate {audit}: P(clears a cheat) {p:.3f} "
                        f"(stated {row['stated_p_clear']:.3f}), cheats cleared before "
                        f"conviction {expected:.2f}"
                    )
    return {"rows": rows, "honest_validators": HONEST, "honest_stake": STAKE, "cap": CAP}
