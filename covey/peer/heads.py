"""The signed ledger heads a peer keeps (covey.trust.heads): evidence, held outside the
coordinator, of how long the run's ledger was and what it held. `covey ledger verify
--heads <store>/ledger-heads.jsonl` refuses a copy of the ledger that is shorter than one
of them or differs at its length.

A head goes into the file only once its signature is the run's coordinator's and its run
is this run; one head per length is kept (the file stays bounded by the ledger's length,
and a later head at a length already kept is a fork: it is kept too, as the evidence).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from covey.trust.heads import HEADS_FILE, Head, HeadError, head_is_signed, head_line, parse_head

log = logging.getLogger("covey.peer")


class HeadKeeper:
    """Appends validly signed heads to `<store_dir>/ledger-heads.jsonl`, one per length."""

    def __init__(self, store_dir: Path, run_id: str, coordinator_key: str) -> None:
        self.path = Path(store_dir) / HEADS_FILE
        self.run_id, self.coordinator_key = run_id, coordinator_key
        self._kept: dict[int, set[str]] = {}
        if self.path.is_file():  # a restarted peer: what it kept before still counts
            for line in self.path.read_text(encoding="ascii", errors="replace").splitlines():
                try:
                    head = parse_head(json.loads(line))
                except (HeadError, ValueError):
                    continue
                self._kept.setdefault(head.length, set()).add(head.hash)

    def keep(self, value: Any, where: str) -> Head | None:
        """Keep the head `value` (a head's JSON object, or None when the reply carried
        none) if it is this run's and validly signed; the head kept, or None. A head that
        fails is logged and dropped: it is no evidence."""
        if value is None:
            return None
        try:
            head = parse_head(value)
        except HeadError as e:
            log.warning("ledger head in %s is malformed: %s", where, e)
            return None
        if head.run_id != self.run_id or not head_is_signed(head, self.coordinator_key):
            log.warning("ledger head in %s is not this run's coordinator's: dropped", where)
            return None
        hashes = self._kept.setdefault(head.length, set())
        if head.hash in hashes:
            return head
        if hashes:
            log.error(
                "the coordinator signed two ledger heads at length %d (%s): its ledger forked",
                head.length,
                where,
            )
        hashes.add(head.hash)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="ascii") as f:
            f.write(head_line(head) + "\n")
        return head
