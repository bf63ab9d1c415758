"""The decentralization multiplier: what a run spent across its peers, divided by what one
centralized process of the same device class needs for the same accepted tokens.

The centralized process would run exactly the accepted inner steps, back to back, on the
same kind of device: the sum of the accepted contributions' compute seconds (`useful_s`).
Every other second a peer spent in the run is a cost of running decentralized, booked to
one part:

- `network`: a member's time in a round beyond its own compute: uploading, downloading,
  waiting for the slowest member and for the round to close;
- `verification`: validators' re-execution compute (what they report for each check);
- `evidence`: moving a drawn contribution's verification evidence (its bytes over the
  sender's measured bandwidth);
- `redundant`: work done twice on purpose beyond verification (SWARM's duplicated hops,
  RL batches checked more than once);
- `churn`: members' time in attempts that were aborted and in rounds they never submitted
  to (a peer that died, left, or missed its deadline);
- `rejected`: members' time in rounds whose contribution was refused.

multiplier = (useful + every part) / useful; 1.0 is a centralized run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PARTS = ("network", "verification", "evidence", "redundant", "churn", "rejected")


@dataclass
class Costs:
    """Seconds of peer time by what they bought; `add_member` books one member of one
    round, the other parts are added directly."""

    useful_s: float = 0.0
    network_s: float = 0.0
    verification_s: float = 0.0
    evidence_s: float = 0.0
    redundant_s: float = 0.0
    churn_s: float = 0.0
    rejected_s: float = 0.0
    evidence_bytes: int = 0
    unmeasured: list[str] = field(default_factory=list)

    def add_member(self, span_s: float, compute_s: float | None, outcome: str) -> None:
        """One member's `span_s` seconds in one round: `outcome` is "accepted" (its compute
        is useful, the rest network), "rejected" or "absent" (all of it lost)."""
        span_s = max(0.0, span_s)
        if outcome == "accepted":
            useful = max(0.0, compute_s or 0.0)
            self.useful_s += useful
            self.network_s += max(0.0, span_s - useful)
        elif outcome == "rejected":
            self.rejected_s += span_s
        elif outcome == "absent":
            self.churn_s += span_s
        else:
            raise ValueError(f"unknown outcome {outcome!r}: accepted, rejected or absent")

    def mark_unmeasured(self, what: str) -> None:
        """Name a part of the run that could not be measured (once)."""
        if what not in self.unmeasured:
            self.unmeasured.append(what)

    def total_s(self) -> float:
        return self.useful_s + sum(getattr(self, f"{p}_s") for p in PARTS)

    def multiplier(self) -> float | None:
        """Total peer seconds over useful ones; None before any accepted work."""
        return self.total_s() / self.useful_s if self.useful_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """For summary.json, the status feed and the benches: the multiplier, the seconds of
        each part and each part's share of the multiplier above 1 (they add up to it)."""
        parts = {p: round(getattr(self, f"{p}_s"), 3) for p in PARTS}
        useful = self.useful_s
        # what each part adds, to 4 decimals; the multiplier given is 1 + their sum, so the
        # shown parts add up to it exactly (within 3e-4 of `multiplier()`)
        adds = {p: round(s / useful, 4) if useful > 0 else None for p, s in parts.items()}
        m = round(1 + sum(a or 0.0 for a in adds.values()), 4) if useful > 0 else None
        return {
            "multiplier": m,
            "useful_s": round(useful, 3),
            "parts_s": parts,
            "adds": adds,  # multiplier = 1 + sum(of these): what each part adds to it
            "evidence_bytes": self.evidence_bytes,
            "unmeasured": list(self.unmeasured),
        }


def costs_fields() -> list[str]:
    """The seconds fields, in order (the metrics' labels)."""
    return [f.name for f in fields(Costs) if f.name.endswith("_s")]


Seconds = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)


class CostsReport(BaseModel):
    """A peer's own booked costs on the wire (a SWARM trainer's report): bounded, finite,
    and only ever shown and summed, never a verdict's input."""

    model_config = ConfigDict(extra="forbid")
    useful_s: float = Seconds
    network_s: float = Seconds
    verification_s: float = Seconds
    evidence_s: float = Seconds
    redundant_s: float = Seconds
    churn_s: float = Seconds
    rejected_s: float = Seconds
    evidence_bytes: int = Field(0, ge=0, le=2**53)
    unmeasured: list[str] = Field([], max_length=8)

    @staticmethod
    def of(costs: Costs) -> dict[str, Any]:
        """`costs` as a report's JSON."""
        return {
            **{f: round(getattr(costs, f), 6) for f in costs_fields()},
            "evidence_bytes": costs.evidence_bytes,
            "unmeasured": [u[:100] for u in costs.unmeasured[:8]],
        }

    def add_to(self, total: Costs) -> None:
        """Add this report's seconds and bytes to `total`."""
        for f in costs_fields():
            setattr(total, f, getattr(total, f) + getattr(self, f))
        total.evidence_bytes += self.evidence_bytes
        for u in self.unmeasured:
            if u[:100] not in total.unmeasured and len(total.unmeasured) < 16:
                total.unmeasured.append(u[:100])
