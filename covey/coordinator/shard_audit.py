"""The late check of a sharded round (docs/sharded-aggregation.md, "Late checks").

A round's drawn checks (covey.coordinator.sharding) re-aggregate a share of its shards
before the certificate; the rest are certified on their aggregator's word, and a checker
that agreed with a wrong shard would lose nothing. So, once a sharded round is committed,
the coordinator recomputes EVERY shard an aggregator published from the round's signed
board (`ShardedAggregation.compute`, the referee's own recomputation: the shard's byte
ranges of each certified contribution, aggregated and stepped from the start state), in a
thread, off the round's critical path. It costs one unsharded aggregation of the round,
no inner step (measured in BENCHMARKS.md); every shard is checked, so the audit rate of
cleared shards is 1, and a liar is convicted whether or not the draw checked its shards.

Each certified shard whose hash is not the recomputed one is a proven fraud, written in
one transaction, with the rounds mode's missed-fraud accounting (covey.coordinator.checks):

- a "verification" (outcome "agree") per checker that agreed with the wrong shard,
  carrying `shard_check`, the checker's own signed check body naming the wrong hash (so
  nobody can be written as having agreed with a lie it did not sign:
  covey.trust.shard_evidence.check_slashes refuses such an entry);
- a "slash" of the aggregator per wrong shard, with the evidence of an in-round slash
  (its signed publish, the board, the truth: `covey ledger verify --recompute` recomputes
  it); the Book convicts the aggregator's round-r item on it, and bans the aggregator;
- `Checks.convict`: each checker that agreed pays validator_slash_fraction of its stake
  ("penalty", kind "missed fraud") and any check pay for it; any pay of the aggregator
  for the item is clawed back (neither is paid per shard today, so nothing is).

The certified state of the round is not undone: peers hold it and the next round started
from it. What a liar can do is bounded instead: the driver waits for round r's late check
before it draws round r + 1's aggregators (`wait`), so a liar is banned before it can
aggregate again: its wrong shards reach the model in one round at most, and that round
costs it slash_fraction of its stake per wrong shard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .accounts import Accounts
from .checks import Checks
from .sharding import ShardBoard

log = logging.getLogger("covey.coordinator")

#: how long the round driver waits for the previous round's late check before it draws
#: the next round's aggregators (a late check is one aggregation, far shorter than this)
WAIT_S = 600.0


class LateChecks:
    """Late checks of committed sharded rounds, one thread at a time (see the module).
    `compute(round, shard)` is the referee's hash of a shard from its board (raising when
    it cannot: that shard is left unjudged, nobody is slashed on an exception)."""

    def __init__(
        self,
        board: ShardBoard,
        accounts: Accounts,
        compute: Callable[[int, int], str],
    ) -> None:
        self.board, self.accounts = board, accounts
        self.compute = compute
        self._thread: threading.Thread | None = None

    def start(self, round_: int) -> None:
        """Check round `round_`'s certified shards in a thread (after its commit)."""
        self.wait()
        self.board.set_late(round_, status="running")
        self._thread = threading.Thread(
            target=self.run, args=(round_,), name=f"late-check-{round_}", daemon=True
        )
        self._thread.start()

    def wait(self, timeout_s: float = WAIT_S) -> bool:
        """Wait for the running late check, at most `timeout_s`: whether none is running."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
        return t is None or not t.is_alive()

    def run(self, round_: int) -> dict[str, Any]:
        """Recompute every certified shard of `round_` and convict each wrong one; what it
        found (also on the round's board as `late_check`)."""
        began = time.monotonic()
        wrong: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
        unjudged, checked = [], 0
        for shard, pub in self.board.certified(round_):
            try:
                truth = self.compute(round_, shard)
            except Exception as e:  # a recomputation that fails convicts nobody
                log.warning("[round %d] late check of shard %d failed: %s", round_, shard, e)
                unjudged.append(shard)
                continue
            checked += 1
            if truth != pub["hash"]:
                wrong.setdefault(pub["aggregator"], []).append((shard, truth, pub))
        convicted = []
        for liar, shards in sorted(wrong.items()):
            try:
                convicted.append(self._convict(round_, liar, shards))
            except Exception:  # a rule the book refuses: logged, the round stays as is
                log.exception("[round %d] late conviction of %s failed", round_, liar[:12])
        seconds = round(time.monotonic() - began, 3)
        found = {"status": "done", "checked": checked, "unjudged": unjudged,
                 "convicted": convicted, "seconds": seconds}  # fmt: skip
        self.board.set_late(round_, **found)
        if convicted:
            log.warning("[round %d] late check: %d shards recomputed in %.2f s, convicted %s",
                        round_, checked, seconds, convicted)  # fmt: skip
        else:
            log.info("[round %d] late check: %d shards recomputed in %.2f s, all right",
                     round_, checked, seconds)  # fmt: skip
        return found

    def _convict(
        self, round_: int, liar: str, shards: list[tuple[int, str, dict[str, Any]]]
    ) -> dict[str, Any]:
        """The entries of one aggregator's wrong shards of `round_` (see the module)."""
        accounts, now = self.accounts, time.time()
        agreed: list[str] = []
        with accounts.transaction() as c:
            for _, _, pub in shards:
                for body in pub["checks"]:
                    accounts.append(
                        c, "verification",
                        {"round": round_, "peer_id": liar, "validator_id": body["peer_id"],
                         "outcome": "agree", "distance": None, "exact": True,
                         "shard_check": body},
                        now,
                    )  # fmt: skip
                    agreed.append(body["peer_id"])
            for shard, truth, pub in shards:
                why = (
                    f"wrong aggregate (late check): shard {shard} of round {round_}: published "
                    f"{pub['hash'][:16]}, is {truth[:16]}"
                )
                accounts.append(
                    c, "slash",
                    {"round": round_, "peer_id": liar, "reason": why,
                     "amount": accounts.book.slash_amount(liar),
                     "evidence": self.board.evidence(round_, shard, truth)},
                    now,
                )  # fmt: skip
            reason = f"its shards {[s for s, _, _ in shards]} of round {round_} were wrong"
            penalised = Checks(accounts).convict(c, round_, liar, reason, now)
        log.warning("[round %d] aggregator %s convicted late (shards %s); missed fraud: %s",
                    round_, liar[:12], [s for s, _, _ in shards],
                    [v[:12] for v in penalised])  # fmt: skip
        return {"aggregator": liar, "shards": [s for s, _, _ in shards],
                "agreed": sorted(set(agreed)), "penalised": penalised}  # fmt: skip
