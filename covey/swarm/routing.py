"""Which server of each stage gets the next microbatch: pure routing math (SWARM sec. 3.2).

Each server's throughput (samples/s) is an exponential moving average of its measured
replies; the expected finish time of a new microbatch on a server is
(queue + 1) / throughput, and a trainer picks, per stage, the server with the least.
Servers never measured are probed with probability `probe_rate` (a seeded generator, so
runs replay), or always when no measured server is left. A timeout marks a server slow
for `slow_s` seconds (the trainer reroutes to another server of the stage); an invalid
reply bans it for the run with the reason kept for the report. The clock is an argument.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


class NoServerError(RuntimeError):
    """No usable server is left for a stage; the message names the stage."""


@dataclass
class ServerState:
    server: str
    stage: int
    throughput: float | None = None  # EMA samples/s; None until measured
    queue: int = 0  # microbatches sent and not yet answered
    slow_until: float = 0.0
    banned: str | None = None  # reason, once banned
    timeouts: int = 0
    replies: int = 0
    ahead: deque[int] = field(default_factory=deque)  # queue at each unanswered send


@dataclass
class Router:
    """Routing state of one trainer. `ema`: weight of the newest measurement.

    `service_time`: measure a server by its service time, not its latency: a reply that
    waited behind `a` earlier requests of this trainer to the same server took about
    seconds / (a + 1) of the server's time. Latency already holds the queue, and expected
    finish multiplies by (queue + 1) again, so a busy fast server would look (queue + 1)
    times slower than it is and microbatches would go to slower servers."""

    ema: float = 0.3
    probe_rate: float = 0.05
    slow_s: float = 30.0
    seed: int = 0
    service_time: bool = False
    servers: dict[str, ServerState] = field(default_factory=dict)
    reroutes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.ema <= 1 or not 0 <= self.probe_rate <= 1:
            raise ValueError(
                f"ema ({self.ema}) must be in (0, 1], probe_rate ({self.probe_rate}) in [0, 1]"
            )
        self._rng = random.Random(self.seed)

    def add_server(self, server: str, stage: int) -> None:
        """Register (or move) `server` to `stage`; a moved server is measured afresh."""
        old = self.servers.get(server)
        if old is not None and old.stage == stage:
            return
        banned = old.banned if old is not None else None
        self.servers[server] = ServerState(server, stage, banned=banned)

    def remove_server(self, server: str) -> None:
        self.servers.pop(server, None)

    def expected_finish(self, server: str) -> float:
        """(queue + 1) / throughput in seconds; inf when not yet measured."""
        s = self.servers[server]
        if not s.throughput:
            return float("inf")
        return (s.queue + 1) / s.throughput

    def choose(self, stage: int, now: float) -> str:
        """The server of `stage` for the next microbatch. Not banned; not slow unless every
        server of the stage is slow. NoServerError when none is left."""
        usable = [s for s in self.servers.values() if s.stage == stage and s.banned is None]
        if not usable:
            raise NoServerError(f"stage {stage} has no server that is not banned")
        fresh = [s for s in usable if s.slow_until <= now]
        pool = fresh or usable
        new = sorted((s for s in pool if s.throughput is None), key=lambda s: (s.queue, s.server))
        measured = [s for s in pool if s.throughput is not None]
        if new and (not measured or self._rng.random() < self.probe_rate):
            least = [s for s in new if s.queue == new[0].queue]
            return self._rng.choice(least).server
        return min(measured, key=lambda s: (self.expected_finish(s.server), s.server)).server

    def route(self, n_stages: int, now: float) -> list[str]:
        """One server per stage, 0..n_stages-1."""
        return [self.choose(k, now) for k in range(n_stages)]

    def started(self, server: str) -> None:
        s = self.servers[server]
        s.ahead.append(s.queue)
        s.queue += 1

    def _answered(self, s: ServerState) -> int:
        """One request left the queue; how many were ahead of it when it was sent."""
        s.queue = max(0, s.queue - 1)
        return s.ahead.popleft() if s.ahead else 0

    def finished(self, server: str, samples: int, seconds: float) -> None:
        """A valid reply for `samples` samples that took `seconds` (send to answer)."""
        if samples <= 0 or seconds <= 0:
            raise ValueError(f"samples ({samples}) and seconds ({seconds}) must be > 0")
        s = self.servers[server]
        ahead = self._answered(s)
        s.replies += 1
        rate = samples / seconds * ((ahead + 1) if self.service_time else 1)
        s.throughput = (
            rate if s.throughput is None else (1 - self.ema) * s.throughput + self.ema * rate
        )
        s.slow_until = 0.0

    def timed_out(self, server: str, now: float) -> None:
        """No answer within the deadline: slow for `slow_s`, its estimate halved, and the
        microbatch is rerouted (counted)."""
        s = self.servers[server]
        self._answered(s)
        s.timeouts += 1
        s.slow_until = now + self.slow_s
        if s.throughput is not None:
            s.throughput /= 2
        self.reroutes += 1

    def invalid(self, server: str, reason: str) -> None:
        """An invalid reply (malformed bytes, wrong shape, non-finite): banned for the run."""
        s = self.servers[server]
        self._answered(s)
        s.banned = reason
        self.reroutes += 1

    def banned(self) -> dict[str, str]:
        """Banned servers and why, for the run's report."""
        return {s.server: s.banned for s in self.servers.values() if s.banned is not None}


@dataclass
class StateWatch:
    """Which stage state a server's replies may be signed on.

    Servers of a stage hold the same weights between averaging rounds, so an honest reply
    is on the stage's newest agreed state, on the one before it during a round's
    switch-over, or on a newer one for the moments before the coordinator agrees on it.
    `agreed` holds each stage's recent agreed ids, oldest first, as the servers view sends
    them (set with `agree`, which notes when each stage's newest id was first seen).

    A reply is usable when it is on:
    - the newest agreed state;
    - the previous agreed state, for `grace_s` after the newest was first seen (after
      that the server skipped a round or serves old weights);
    - a state not agreed (yet), while the server's oldest open clock is younger than
      `grace_s`. A clock opens at a server's first reply on an unagreed state and closes
      only when that state is agreed (an honest server ahead). A made-up id never closes
      its clock, and a reply on an agreed state does not close it either, so a liar that
      sprinkles honest replies among made-up ones is not used on made-up ones after
      `grace_s`.
    Any older agreed state is never usable. `grace_s` must outlast how long the coordinator
    may take to agree on an honest server's new state: a round's apply, a heartbeat, and a
    dead member still counted in the vote until `dead_after_s` (the trainer sets it so). A
    server that names the agreed state but computed on other weights is the
    duplicated-hop comparison's to catch (its replies differ beyond `tolerance`)."""

    grace_s: float = 10.0
    agreed: dict[int, list[str]] = field(default_factory=dict)  # stage -> recent agreed ids
    clocks: dict[str, dict[str, float]] = field(default_factory=dict)  # server -> state -> t
    max_clocks: int = 64  # open clocks kept a server (made-up ids do not grow it further)
    newest: dict[int, tuple[str, float]] = field(default_factory=dict)  # stage -> (id, since)

    def agree(self, agreed: dict[int, list[str]], now: float) -> None:
        """The coordinator's recent agreed ids per stage (oldest first), seen at `now`.
        Every server's clock on a state agreed now closes here (an honest server ahead),
        whether or not it answers again on an unagreed state, and whichever stage it
        serves now (the rebalancer moves servers)."""
        self.agreed = agreed
        for stage, ids in agreed.items():
            if ids:  # none before a stage's first round
                self._newest(stage, now)
        known = {s for ids in agreed.values() for s in ids}
        for mine in self.clocks.values():
            for s in [s for s in mine if s in known]:
                del mine[s]

    def newest_state(self, stage: int) -> str | None:
        history = self.agreed.get(stage)
        return history[-1] if history else None

    def _newest(self, stage: int, now: float) -> float:
        """When the stage's newest agreed id was first seen."""
        last = self.agreed[stage][-1]
        if stage not in self.newest or self.newest[stage][0] != last:
            self.newest[stage] = (last, now)
        return self.newest[stage][1]

    def usable(self, server: str, stage: int, state: str, now: float) -> bool:
        return self.refusal(server, stage, state, now) is None

    def refusal(self, server: str, stage: int, state: str, now: float) -> str | None:
        """None when a reply of `server` on `state` may be used (`usable`), else why not."""
        history = self.agreed.get(stage)
        if not history:  # nothing known yet (a coordinator restarting): no judgment
            return None
        since = self._newest(stage, now)
        if state == history[-1]:
            return None
        if state in history:  # the previous state for a switch-over's grace; older never
            if len(history) > 1 and state == history[-2]:
                late = now - since - self.grace_s
                return None if late <= 0 else f"the previous agreed state, {late:.1f} s late"
            return f"an agreed state {len(history) - 1 - history.index(state)} rounds old"
        mine = self.clocks.setdefault(server, {})
        for s in [s for s in mine if s in history]:  # it was ahead, and is agreed now
            del mine[s]
        if state not in mine and len(mine) < self.max_clocks:
            mine[state] = now
        oldest = min(mine, key=mine.__getitem__, default=None)
        if oldest is None or now - mine[oldest] <= self.grace_s:
            return None
        return f"not agreed; its state {oldest[:12]} went unagreed {now - mine[oldest]:.0f} s"
