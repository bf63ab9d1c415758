"""Within a stage: servers average their accumulated updates in all-or-nothing rounds.

Pure state, the clock an argument (torchft's quorum style). A stage holds `step`, the
number of committed rounds, and the agreed state id at that step. Once the live, synced
servers of a stage report `target_samples` pending samples between them, a round opens
with them as members. Each member snapshots its accumulated gradient sum, publishes it as a
blob and reports (cid, samples). The round commits when every member reported, or at the
deadline with those that did if any sample is in; a member that missed it is not waited
for. After a commit every server of the stage at that step fetches every reported blob
(hash-checked), applies sum / samples with its optimizer (a server that missed the round
keeps its own sum for the next) and reports its new state id. The live servers that
reported samples trainers vouched for to one of the stage's last STANDING_ROUNDS rounds
vote (no one else's state counts): an id named by more than half of them is the stage's
agreed state, and a server holding another resyncs from it. Before the first round nobody
votes: the agreed state is the one the coordinator builds from the run's seed (`seed`). An
update is accepted when its round commits: a round without any sample in by the deadline
aborts, and its members keep their gradients for the next.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

NORM_FACTOR = 10.0  # a per-sample gradient norm this many times the low median is left out
SAMPLES_FACTOR = 8  # samples this many times the low median (or the target) are left out
STANDING_ROUNDS = 4  # a server that reported to one of a stage's last this many rounds votes


def outliers(norms: dict[str, float], reference: list[float]) -> set[str]:
    """Reports whose per-sample norm exceeds NORM_FACTOR x the low median of this round's
    nonzero norms and `reference` (the stage's last accepted ones). With two members the
    low median is the smaller: the larger of two is left out only at 10x the other."""
    pool = sorted(v for v in [*norms.values(), *reference] if v > 0)
    if len(pool) < 2:
        return set()
    low = pool[(len(pool) - 1) // 2]
    return {p for p, v in norms.items() if v > NORM_FACTOR * low}


def heavy(samples: dict[str, int], target: int) -> set[str]:
    """Reports claiming more than SAMPLES_FACTOR x max(low median of the round's samples,
    `target`): the samples weigh a sum in the mean, so a liar claiming many with a sum
    of ordinary per-sample norm would set the round's direction. Honest servers of 1x to
    4x different speeds stay within it."""
    pool = sorted(samples.values())
    if len(pool) < 2:
        return set()
    cap = SAMPLES_FACTOR * max(pool[(len(pool) - 1) // 2], target)
    return {p for p, n in samples.items() if n > cap}


@dataclass
class AvgRound:
    stage: int
    id: int
    step: int  # the stage step this round moves from
    members: list[str]
    opened: float
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # peer -> cid, samples, url
    status: str = "open"  # open | committed | aborted
    dropped: list[str] = field(default_factory=list)  # reports left out: outlier norms

    def view(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "id": self.id,
            "step": self.step,
            "members": self.members,
            "status": self.status,
            "reports": dict(sorted(self.reports.items())),
        }


@dataclass
class StageBook:
    stage: int
    step: int = 0
    agreed: str | None = None  # state id at `step`, once a server reported one
    states: dict[str, str] = field(default_factory=dict)  # peer -> state id at `step`
    round: AvgRound | None = None
    last: AvgRound | None = None  # the last committed round
    committed_at: float = 0.0
    history: dict[int, AvgRound] = field(default_factory=dict)  # step -> committed round
    rounds: int = 0
    aborted: int = 0
    samples: int = 0  # accepted samples
    norms: list[float] = field(default_factory=list)  # per-sample norms of the last round
    voters: set[str] = field(default_factory=set)  # who votes on the state (`_voters`)
    seeded: str | None = None  # the state id at the run's seed, once the coordinator built it
    missed: dict[str, int] = field(default_factory=dict)  # peer -> rounds missed in a row
    benched: dict[str, float] = field(default_factory=dict)  # peer -> kept out until

    @property
    def quorum(self) -> int:
        return len(self.voters)


class Averaging:
    """The rounds of every stage. `live` arguments map peer -> (stage, step, pending)."""

    def __init__(self, n_stages: int, target_samples: int, round_timeout_s: float) -> None:
        self.stages = [StageBook(k) for k in range(n_stages)]
        self.target = target_samples
        self.timeout_s = round_timeout_s
        self._next_id = 0

    def tick(self, live: dict[str, tuple[int, int, int]], busy: set[str], now: float) -> None:
        """Open rounds where enough samples wait; close rounds past their deadline or
        complete. `busy`: servers that must not join a round (moving, resyncing)."""
        for book in self.stages:
            if book.last is not None:
                book.voters = self._voters(book, live)
                self._agree(book)
            r = book.round
            if r is not None:
                gone = [m for m in r.members if m not in live and m not in r.reports]
                waiting = set(r.members) - set(gone) - set(r.reports)
                everyone = not waiting and bool(r.reports)
                if everyone or now - r.opened > self.timeout_s or not set(r.members) - set(gone):
                    self._close(book, now)
                continue
            synced = {
                p: pending
                for p, (k, step, pending) in live.items()
                if k == book.stage
                and step == book.step
                and p not in busy
                and (book.agreed is None or book.states.get(p) in (None, book.agreed))
                and book.benched.get(p, 0.0) <= now
            }
            # the last round's members apply it first, so the next round has them all
            last = book.last
            behind = last is not None and any(
                p in live and p not in book.states for p in last.reports
            )
            if behind and now - book.committed_at <= self.timeout_s:
                continue
            if synced and sum(synced.values()) >= self.target:
                book.round = AvgRound(book.stage, self._next_id, book.step, sorted(synced), now)
                self._next_id += 1

    @staticmethod
    def _voters(book: StageBook, live: dict[str, tuple[int, int, int]] | None = None) -> set[str]:
        """Who votes on the stage's state: the live servers on this stage that reported
        samples trainers vouched for (not only claimed) to one of its last STANDING_ROUNDS
        committed rounds. Not the last round's alone: two colluders with one honest server could
        carry a round that the other honest servers were too slow to join, then the vote
        after it. The dead are no voters, nor those moved to another stage, nor newcomers
        and sybils with no work in a round behind them."""
        recent = [r for s, r in book.history.items() if s >= book.step - STANDING_ROUNDS]
        if book.last is not None:
            recent.append(book.last)
        voters = {p for r in recent for p, x in r.reports.items() if x.get("vouched", x["samples"])}
        if live is None:
            return voters
        return {p for p in voters if p in live and live[p][0] == book.stage}

    def report(
        self,
        peer: str,
        stage: int,
        round_id: int,
        cid: str,
        samples: int,
        url: str,
        norm: float = 0.0,
        vouched: int | None = None,
    ) -> str:
        """A member's gradient blob (`norm`: its L2 norm per sample, covey.swarm.sums;
        `vouched`: how many of its `samples` trainers vouched it served, default all).
        Returns "ok", or why it is refused."""
        book = self._book(stage)
        r = book.round
        if r is None or r.id != round_id:
            return f"round {round_id} of stage {stage} is not open"
        if peer not in r.members:
            return f"peer {peer[:8]} is not a member of round {round_id}"
        if samples < 0:
            return f"samples ({samples}) must be >= 0"
        vouched = samples if vouched is None else max(0, min(samples, vouched))
        r.reports[peer] = {"cid": cid, "samples": samples, "url": url, "norm": norm,
                           "vouched": vouched}  # fmt: skip
        return "ok"

    def _close(self, book: StageBook, now: float) -> None:
        r = book.round
        assert r is not None
        # a sum far larger per sample, or far heavier, than the others' would poison every
        # member or set the round's direction: left out
        self._bench(book, r, now)
        norms = {p: float(x.get("norm", 0.0)) for p, x in r.reports.items()}
        samples = {p: int(x["samples"]) for p, x in r.reports.items()}
        for p in sorted(outliers(norms, book.norms) | heavy(samples, self.target)):
            r.reports.pop(p)
            r.dropped.append(p)
        total = sum(x["samples"] for x in r.reports.values())
        book.round = None
        if total <= 0:
            r.status = "aborted"
            book.aborted += 1
            return
        r.status = "committed"
        book.last, book.committed_at = r, now
        book.history[r.step] = r
        book.history.pop(r.step - 8, None)
        book.rounds += 1
        book.samples += total
        book.step += 1
        book.agreed, book.states = None, {}
        book.norms = [norms[p] for p in sorted(r.reports) if norms[p] > 0]
        book.voters = self._voters(book)  # the next tick leaves out the dead and moved

    def _bench(self, book: StageBook, r: AvgRound, now: float) -> None:
        """A member that misses two rounds in a row (a heartbeat that claims samples and
        never reports them makes every round wait out its timeout) is kept out of the
        stage's rounds for timeout x 2^(misses - 1), at most 64 timeouts; a report clears
        it. Bounded either way: an honest server that was only slow rejoins soon."""
        for p in r.members:
            if p in r.reports:
                book.missed.pop(p, None)
                book.benched.pop(p, None)
                continue
            n = book.missed[p] = book.missed.get(p, 0) + 1
            if n >= 2:
                book.benched[p] = now + self.timeout_s * 2 ** min(n - 1, 6)

    def state(self, peer: str, stage: int, step: int, cid: str) -> None:
        """A server's state id after applying rounds up to `step`."""
        book = self._book(stage)
        if step != book.step:
            return
        book.states[peer] = cid
        self._agree(book)

    @staticmethod
    def _agree(book: StageBook) -> None:
        """The agreed state: one named by more than half of the stage's `_voters` (its live
        servers with recent work in a round); other servers' states are not counted. A tie
        agrees on nothing: a lone liar neither wins a coin toss nor gets its state pushed
        on others as a resync. Before the first committed round there is no vote: the agreed
        state is the seeded one the coordinator computed (`seed`), None until it has."""
        if book.last is None:  # before the first round: the seed's state, not a vote
            book.agreed = book.seeded
            return
        votes = Counter(cid for p, cid in book.states.items() if p in book.voters)
        if not votes:
            book.agreed = None
            return
        cid, n = max(votes.items(), key=lambda kv: (kv[1], kv[0]))
        book.agreed = cid if 2 * n > len(book.voters) else None

    def seed(self, stage: int, cid: str) -> None:
        """`stage`'s state id at the run's seed, computed by the coordinator from the spec:
        the agreed state until the stage's first round commits."""
        book = self._book(stage)
        book.seeded = cid
        self._agree(book)

    def directive(self, peer: str, stage: int, step: int, cid: str | None) -> dict[str, Any]:
        """What a server of `stage` at `step` holding state `cid` does next: join the open
        round, apply the committed round at its step (kept for 8 steps), or resync to the
        agreed state."""
        book = self._book(stage)
        out: dict[str, Any] = {"step": book.step, "agreed": book.agreed}
        if book.round is not None and peer in book.round.members:
            out["round"] = book.round.view()
        done = book.history.get(step)
        if done is not None:  # a member applies it; one that missed it catches up with it
            out["apply"] = done.view()
        elif book.agreed is not None and (step != book.step or cid != book.agreed):
            out["resync"] = book.agreed
        return out

    def drop(self, peer: str) -> None:
        """A convicted server leaves every open round, its reported gradient sum with it
        (not averaged into the stage); rounds already committed stay as they are."""
        for b in self.stages:
            r = b.round
            if r is not None and peer in r.members:
                r.members = [m for m in r.members if m != peer]
                r.reports.pop(peer, None)

    def in_round(self, peer: str) -> bool:
        return any(b.round is not None and peer in b.round.members for b in self.stages)

    def _book(self, stage: int) -> StageBook:
        if not 0 <= stage < len(self.stages):
            raise ValueError(f"stage {stage}; stages are 0..{len(self.stages) - 1}")
        return self.stages[stage]

    # -- persistence: the coordinator saves this after every change and loads it on restart

    def to_dict(self) -> dict[str, Any]:
        """Everything a restarted coordinator needs to resume every stage's rounds: step,
        agreed state, votes, the open round with its reports, the committed history."""
        stages = [{**asdict(b), "voters": sorted(b.voters)} for b in self.stages]
        return {"next_id": self._next_id, "stages": stages}

    def load(self, data: dict[str, Any]) -> None:
        """Restore `to_dict`'s output. ValueError when it is for another number of stages."""
        books = data["stages"]
        if len(books) != len(self.stages):
            raise ValueError(
                f"saved averaging has {len(books)} stages, this run {len(self.stages)}"
            )

        def rnd(r: dict[str, Any] | None) -> AvgRound | None:
            return None if r is None else AvgRound(**r)

        self._next_id = int(data["next_id"])
        for k, b in enumerate(books):
            b = {key: v for key, v in b.items() if key != "quorum"}  # saved before voters
            self.stages[k] = StageBook(
                **{**b, "round": rnd(b["round"]), "last": rnd(b["last"]),
                   "voters": set(b.get("voters", ())),
                   "history": {int(s): AvgRound(**r) for s, r in b["history"].items()}}
            )  # fmt: skip

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "stage": b.stage,
                "step": b.step,
                "agreed": b.agreed,
                "rounds": b.rounds,
                "aborted": b.aborted,
                "samples": b.samples,
                "open_round": None if b.round is None else b.round.id,
            }
            for b in self.stages
        ]
