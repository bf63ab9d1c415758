"""The book's validator draws: who must check which contribution, and canaries
(the "assignment" and "canary" ledger entries; their contract is in covey.trust.incentives).

Pure, like the book: each draw is recomputed from the beacon (the hash of the last round
certificate before the round's draws) and the validators' standing as the ledger left it,
so every replay of the ledger, `covey ledger verify`'s included, checks every draw.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from covey.trust.certify import audit_message, check_canary_draw, draw_value
from covey.trust.identity import verify
from covey.trust.ledger import LedgerError

if TYPE_CHECKING:
    from covey.trust.policy import Account, Policy


class Draws:
    """Mixed into `Book`, which holds this state and applies the entries."""

    accounts: dict[str, Account]
    run_id: str | None
    coordinator_key: str | None
    _last_certificate: str | None
    _beacons: dict[int, str]
    _required: dict[tuple[int, str], int]
    _open: dict[tuple[int, str], set[str]]
    _tried: dict[tuple[int, str], set[str]]
    _done: dict[tuple[int, str], int]
    _load: dict[tuple[int, str], int]
    _canaries: set[tuple[int, str]]
    _checks_due: dict[tuple[int, str], int]
    _agreed_by: dict[tuple[int, str], set[str]]
    _audited: set[tuple[int, str]]

    def _policy(self) -> Policy:
        raise NotImplementedError

    def _peer(self, i: int, p: dict[str, Any], field: str = "peer_id") -> Account:
        raise NotImplementedError

    def beacon(self, round: int) -> str:
        """The beacon of round `round`'s draws: fixed at its first draw to the hash of the
        last round certificate then (the run id's hash before any)."""
        if round in self._beacons:
            return self._beacons[round]
        if self._last_certificate is not None:
            return self._last_certificate
        return hashlib.sha256(f"covey-genesis-beacon\n{self.run_id}".encode()).hexdigest()

    def draw(self, round: int, peer_id: str, n: int) -> list[str]:
        """The first `n` eligible validators for the check of `peer_id`'s round-`round`
        contribution, in beacon order (see the "assignment" entry); fewer if fewer are
        eligible."""
        policy = self._policy()
        staked = [
            a.peer_id
            for a in self.accounts.values()
            if a.role == "validator"
            and not a.banned
            and a.stake >= policy.min_validator_stake
            and a.release_at is None  # an unbonding validator has left
        ]
        beacon = self.beacon(round)
        cap = policy.validator_stake_cap

        def rank(v: str) -> Any:
            hashed = draw_rank(beacon, round, peer_id, v)
            return hashed if cap <= 0 else weighted_rank(hashed, self.accounts[v].stake, cap)

        ranked = draw_validators(
            staked,
            rank,
            len(staked),
            worker=peer_id,
            tried=self._tried.get((round, peer_id), set()),
            load={v: self._load.get((round, v), 0) for v in staked},
            cap=policy.validator_round_cap,
        )
        chosen = ranked[: max(n, 0)]
        if chosen and not any(self.established(v) for v in chosen):
            # the best-ranked established validator eligible takes the last place
            first = next((v for v in ranked[len(chosen) :] if self.established(v)), None)
            if first is not None:
                chosen[-1] = first
        return chosen

    def established(self, validator_id: str) -> bool:
        """Whether a validator has an established record: at least `established_checks`
        checks less its false accusations, and no canary passed (never, with the rule
        off)."""
        need, acc = self._policy().established_checks, self.accounts[validator_id]
        if need <= 0:
            return False
        return acc.canaries_passed == 0 and acc.checks - acc.false_accusations >= need

    def checks_needed(self, round: int, peer_id: str) -> int:
        """How many more validators must be assigned to this contribution now: its
        required checks less those completed and those assigned and open."""
        key = (round, peer_id)
        if key not in self._required:
            return 0
        return self._required[key] - self._done.get(key, 0) - len(self._open.get(key, ()))

    def checks_complete(self, round: int, peer_id: str) -> bool:
        """Whether a sampled contribution was checked enough to be paid: at least one check
        completed, and all it requires or every eligible validator tried."""
        key = (round, peer_id)
        if key not in self._required:
            return True  # not sampled
        done = self._done.get(key, 0)
        return done >= 1 and (done >= self._required[key] or not self.draw(round, peer_id, 1))

    def cleared(self, round: int, peer_id: str) -> bool:
        """Whether a sampled contribution was cleared: its checks complete, none open, and
        every completed one an agreement (what an audit may re-check)."""
        key = (round, peer_id)
        if key not in self._required or self._open.get(key) or not self.checks_complete(*key):
            return False
        return len(self._agreed_by.get(key, ())) >= self._done.get(key, 0)

    def is_assigned(self, round: int, peer_id: str, validator_id: str) -> bool:
        """Whether `validator_id` holds an open assignment to check this contribution."""
        return validator_id in self._open.get((round, peer_id), set())

    def _assignment(self, i: int, p: dict[str, Any]) -> None:
        key, rnd = (p["round"], p["peer_id"]), p["round"]
        if key not in self._required:
            raise LedgerError(i, f"assignment: no sampled contribution of {key[1]} in round {rnd}")
        if p["reason"] == "audit":
            self._audit(i, p, key)
        if p["beacon"] != self.beacon(rnd):
            raise LedgerError(
                i,
                f"assignment: beacon {p['beacon'][:16]}, round {rnd}'s is {self.beacon(rnd)[:16]}",
            )
        expected = self.draw(rnd, key[1], self.checks_needed(*key))
        if p["validators"] != expected or not expected:
            raise LedgerError(
                i, f"assignment: validators {p['validators']}, the beacon's draw is {expected}"
            )
        self._beacons.setdefault(rnd, p["beacon"])
        for v in expected:
            self._open.setdefault(key, set()).add(v)
            self._tried.setdefault(key, set()).add(v)
            self._load[(rnd, v)] = self._load.get((rnd, v), 0) + 1

    def _audit(self, i: int, p: dict[str, Any], key: tuple[int, str]) -> None:
        """An audit's grounds (the item cleared: its checks complete, every one agreeing,
        none open; its draw the coordinator's, below audit_rate; once), then one more
        check required of it."""
        where = f"assignment (audit) of {key[1]}'s round-{key[0]} contribution"
        if key in self._audited:
            raise LedgerError(i, f"{where}: audited before")
        if not self.cleared(*key):
            raise LedgerError(i, f"{where}: its checks are not complete and all agreeing")
        draw = p.get("draw")
        message = audit_message(self.run_id or "", key[0], key[1])
        if not isinstance(draw, str) or not verify(self.coordinator_key or "", message, draw):
            raise LedgerError(i, f"{where}: draw is not the coordinator's signature")
        if draw_value(draw) >= self._policy().audit_rate:
            rate = self._policy().audit_rate
            raise LedgerError(i, f"{where}: its draw is {draw_value(draw):.3g}, not below {rate}")
        self._audited.add(key)
        self._required[key] = self._done[key] + 1

    def _canary(self, i: int, p: dict[str, Any]) -> None:
        validator = self._peer(i, p)
        self._peer(i, p, "worker_id")
        if validator.role != "validator":
            raise LedgerError(i, f"canary: peer {validator.peer_id} is not a validator")
        if (p["round"], validator.peer_id) in self._canaries:
            raise LedgerError(
                i, f"canary: a second one for {validator.peer_id} in round {p['round']}"
            )
        key, run_id = self.coordinator_key or "", self.run_id or ""
        rate = self._policy().canary_rate
        if not check_canary_draw(key, run_id, p["round"], validator.peer_id, p["draw"]):
            raise LedgerError(i, "canary: draw is not the coordinator's signature")
        if draw_value(p["draw"]) >= rate:
            raise LedgerError(
                i, f"canary: its draw is {draw_value(p['draw']):.3g}, not below {rate}"
            )
        if p["outcome"] == "caught":
            validator.checks += 1
            due = (p["round"], validator.peer_id)
            self._checks_due[due] = self._checks_due.get(due, 0) + 1
        elif p["outcome"] == "missed":
            validator.missed_checks += 1
        self._canaries.add((p["round"], validator.peer_id))


def draw_validators(
    candidates: Iterable[str],
    rank: Callable[[str], str],
    n: int,
    *,
    worker: str,
    tried: Collection[str],
    load: Mapping[str, int],
    cap: int,
) -> list[str]:
    """Who checks one item, in every coordinator mode: of the `candidates` (the mode's
    validators in good standing: rounds' staked ones, RL's live ones), those that are not
    its `worker`, have not `tried` it and hold fewer than `cap` checks (`load`, in the
    item's round or step), the first `n` by `rank` (a public hash of the mode's beacon,
    the item and the validator: `draw_rank`, covey.rl.intake.assign_rank); fewer if fewer
    are eligible."""
    eligible = [v for v in candidates if v != worker and v not in tried and load.get(v, 0) < cap]
    return sorted(eligible, key=rank)[: max(n, 0)]


def weighted_rank(hashed: str, stake: float, cap: float) -> float:
    """A validator's place in a stake-weighted draw (lower checks first): -ln(u) / w, u
    uniform in (0, 1) from the public hash `hashed`, w its stake counted up to `cap`
    (weighted sampling without replacement, Efraimidis and Spirakis 2006: drawn first
    with probability w / sum(w)). A key staked 0 ranks last."""
    u = (int(hashed[:16], 16) + 0.5) / 2.0**64
    weight = min(max(stake, 0.0), cap)
    return math.inf if weight <= 0 else -math.log(u) / weight


def draw_rank(beacon: str, round: int, peer_id: str, validator_id: str) -> str:
    """A validator's place in the draw for one contribution (lower checks first): public,
    so anyone recomputes it; unpredictable before the beacon (the previous certificate)."""
    message = f"covey-assign/v1\n{beacon}\n{round}\n{peer_id}\n{validator_id}"
    return hashlib.sha256(message.encode()).hexdigest()
