"""A SWARM trainer: `covey swarm trainer --coordinator URL`.

Draws microbatches from covey's data layer (seeded windows of the corpus,
covey.data.batches), and sends each through one server per stage: forward 0..S-1 (the last
stage computes the loss and starts backward), then backward S-2..0, each hop carrying the
stage input it needs to recompute forward. Each hop goes to the server with the least
expected finish time (covey.swarm.routing); a timeout or a server no longer on that stage
reroutes the hop to another server of the stage, an invalid reply bans the server for the
run and is reported. A `verify_rate` share of hops also goes to a second server of the
stage: replies on one state that disagree go to the coordinator's referee, and the
microbatch is dropped. `inflight` microbatches run at once (threads), so servers of every
stage are busy: by default two per live server, as SWARM keeps many microbatches in flight
(with fewer, least-expected-finish routing keeps every hop on the fastest chain and slower
servers idle; BENCHMARKS.md, SWARM). Loss, served microbatches per server, reroutes and
bans are reported.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
from covey.swarm import compute
from covey.swarm.config import SwarmConfig
from covey.swarm.costs import TrainerCosts
from covey.swarm.reports import TrainerStats, send_report
from covey.swarm.routing import NoServerError, Router, StateWatch
from covey.swarm.wire import WireError, encode_tensor, pack, reply_message, sha
from covey.trust.identity import Identity, IdentityError, peer_id_of, verify

log = logging.getLogger("covey.swarm.trainer")
MAX_EVIDENCE = 4096  # agreed checks kept for reports while the coordinator is unreachable


class Dropped(Exception):
    """A microbatch given up: no server of a stage answered, or a check disagreed."""


@dataclass
class Hop:
    server: str
    state: str
    reply: bytes
    sig: str
    compute_s: float | None = None  # the server's X-Covey-Compute (covey.swarm.costs)


def training_tokens(cfg: SwarmConfig) -> torch.Tensor:
    """The run's training stream, tokenized as the run names (covey's bytes, or the hf:
    model's own tokenizer.json: SwarmConfig.tokenizer_source). ValueError naming the
    values when the tokenizer's vocabulary is larger than the model's embedding, and
    before any of it is sent, when the spec names data files but this machine's corpus of
    them does not have the spec's fingerprint: a coordinator naming a file it does not
    know (a key, a password store) would otherwise receive it as token ids at stage 0."""
    from covey.data.corpus import load_corpus

    corpus = load_corpus(list(cfg.data_paths) or None, tokenizer=cfg.tokenizer_source())
    if cfg.data_paths and corpus.fingerprint != cfg.data_fingerprint:
        raise ValueError(
            f"the run's data_paths ({', '.join(cfg.data_paths)}) give this machine a corpus "
            f"with fingerprint {corpus.fingerprint}, the run names "
            f"{cfg.data_fingerprint or 'none'}: a trainer sends only the data the run's "
            "spec was made with"
        )
    if cfg.model.startswith("hf:"):
        rows = model_dims(cfg)[0]
        if corpus.vocab_size > rows:
            raise ValueError(
                f"tokenizer {cfg.tokenizer_source()} has {corpus.vocab_size} tokens, the "
                f"model's embedding {rows} rows"
            )
    return corpus.train


class SwarmTrainer:
    def __init__(
        self,
        coordinator: str,
        *,
        name: str = "trainer",
        inflight: int | None = None,
        seed: int = 0,
        fixed: bool = False,
        progress: Callable[[str], None] | None = None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """`fixed`: the GPipe-style baseline for benchmarks: fixed pipelines wired once
        from the servers first seen (pipeline j takes the j-th server of every stage), each
        worker thread bound to one pipeline; never rerouted, so a dead server stalls its
        pipeline. `inflight`: microbatches at once; None: `auto_inflight()` when training
        starts."""
        if inflight is not None and inflight < 1:
            raise ValueError(f"inflight ({inflight}) must be at least 1")
        self.name, self.inflight, self.fixed = name, inflight, fixed
        self.identity = Identity.generate()
        self.client = CoordinatorClient(coordinator, identity=self.identity, lost_s=30.0)
        self.http = httpx.Client(trust_env=False)
        self.rng = random.Random(seed)
        self.router = Router(seed=seed, slow_s=5.0, service_time=True)
        self.urls: dict[str, str] = {}
        self.keys: dict[str, str] = {}  # server -> the public key its replies are signed with
        self.pinned: dict[int, list[str]] = {}
        self.chain = threading.local()
        self.stats = TrainerStats()
        self.spent = TrainerCosts()  # the run's decentralization multiplier, this trainer's part
        self.served: dict[str, int] = {}
        self.evidence: list[dict[str, Any]] = []  # agreed checks not reported yet
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.halted: str | None = None  # the owner's reason, once the run is halted
        self.progress = progress or (lambda line: log.info("%s", line))
        spec = self.client.get("/v1/swarm/spec")
        self.run_id, self.cfg = spec["run_id"], SwarmConfig.received(spec["spec"])
        # an honest server's new state is agreed within a heartbeat of its round's apply,
        # but a dead member counts in the vote until dead_after_s: the grace covers both
        c = self.cfg
        self.states = StateWatch(grace_s=c.dead_after_s + c.round_timeout_s + 2 * c.heartbeat_s)
        self.dims = model_dims(self.cfg)
        # `tokens`: the run's training stream loaded once already (benchmarks start many)
        self.tokens = tokens if tokens is not None else training_tokens(self.cfg)
        self._next = self._join()  # a restart goes on after its name's last reported batch
        self.first = self._next
        # once running, a call to a coordinator that is down fails within a request timeout:
        # hops go straight to the servers meanwhile, reports wait for the next try
        self.client.configure(self.cfg.request_timeout_s, self.cfg.request_timeout_s)
        self.wired = False

    def _join(self) -> int:
        """Join as a trainer; the microbatch index to start from."""
        reply = self.client.post(
            "/v1/swarm/join",
            {
                "run_id": self.run_id,
                "peer_id": self.identity.peer_id,
                "role": "trainer",
                "public_key": self.identity.public_key,
                "name": self.name,
                "stake": 0.0,
            },
        )
        return int(reply.get("resume", 0))

    # -- the server list ---------------------------------------------------------------------

    def refresh(self) -> None:
        """Take the coordinator's list of live servers; keep the last one while the
        coordinator cannot be reached (it may be restarting)."""
        try:
            view = self.client.get("/v1/swarm/servers", quiet=True)
        except (CoordinatorLost, PeerRejected) as e:
            log.warning("[%s] server list unavailable, routing on the last one: %s", self.name, e)
            return
        seen = set()
        with self.lock:
            for k, servers in enumerate(view["stages"]):
                for s in servers:
                    if not _keyed(s):  # its replies could not be checked: not used
                        log.warning("[%s] server %s has no valid key", self.name, s["peer_id"])
                        continue
                    seen.add(s["peer_id"])
                    self.urls[s["peer_id"]], self.keys[s["peer_id"]] = s["url"], s["public_key"]
                    self.router.add_server(s["peer_id"], k)
                if self.fixed and not self.wired:  # by name: the wiring does not race joins
                    self.pinned[k] = [
                        s["peer_id"] for s in sorted(servers, key=lambda s: s["name"]) if _keyed(s)
                    ]
            self.wired = self.wired or (self.fixed and len(self.pinned) == len(view["stages"]))
            agreed = {k: list(ids) for k, ids in enumerate(view.get("agreed", []))}
            self.states.agree(agreed, time.monotonic())
            for p in list(self.router.servers):
                if p not in seen and self.router.servers[p].banned is None:
                    self.router.remove_server(p)

    # -- one hop, one microbatch -----------------------------------------------------------

    def _send(self, server: str, k: int, kind: str, body: bytes, check: bool = False) -> Hop:
        """One request; raises TimeoutError (reroute) or WireError (invalid: ban). `check`:
        the duplicate of a hop (the server does not accumulate it a second time)."""
        url = self.urls[server]
        headers = {"X-Covey-Stage": str(k), **({"X-Covey-Check": "1"} if check else {})}
        try:
            r = self.http.post(
                f"{url}/v1/swarm/{kind}",
                content=body,
                headers=headers,
                timeout=self.cfg.request_timeout_s,
            )
        except httpx.HTTPError as e:
            raise TimeoutError(f"{type(e).__name__}: {e}") from None
        if r.status_code in (409, 503):
            raise TimeoutError(f"HTTP {r.status_code}: {r.text[:100]}")
        if r.status_code != 200:
            raise WireError(f"HTTP {r.status_code}: {r.text[:100]}")
        state, _, sig = r.headers.get("X-Covey-Signature", "").partition(" ")
        # an unsigned reply could never be disputed (the referee settles signed ones only)
        message = reply_message(k, state, sha(body), sha(r.content))
        if not verify(self.keys.get(server, ""), message, sig):
            raise WireError(f"reply signature on state {state[:12]} does not verify")
        # malformed, or not what the next hop takes: WireError, before it is passed on
        compute.check_reply(self.cfg, k, kind, r.content, self.dims)
        with self.lock:
            why = self.states.refusal(server, k, state, time.monotonic())
        if why is not None:  # skipped rounds or serves old weights: rerouted, not banned
            raise TimeoutError(f"replies on state {state[:12]} of stage {k}: {why}")
        return Hop(server, state, r.content, sig, _seconds(r.headers.get("X-Covey-Compute")))

    def hop(self, k: int, kind: str, body: bytes, rows: int, exclude: str | None = None) -> Hop:
        deadline = time.monotonic() + 3 * self.cfg.request_timeout_s
        while not self.stop.is_set():
            now = time.time()
            with self.lock:
                try:
                    server = self._pinned(k) if self.fixed else self._choose(k, now, exclude)
                except (NoServerError, KeyError):
                    server = None
                if server is not None:
                    self._note("started", server)
            if server is None:
                if exclude is not None or time.monotonic() > deadline:
                    raise Dropped(f"stage {k}: no server")
                time.sleep(0.2)
                self.refresh()
                continue
            t0 = time.monotonic()
            try:
                h = self._send(server, k, kind, body, check=exclude is not None)
            except TimeoutError as e:
                self.spent.hop("failed", time.monotonic() - t0)
                with self.lock:
                    self._note("timed_out", server, time.time())
                log.warning(
                    "[%s] stage %d %s on %s: %s; rerouting", self.name, k, kind, server[:8], e
                )
                if time.monotonic() > deadline:
                    raise Dropped(f"stage {k}: {e}") from None
                # never spin: a dead server answers at once; with no other server of the
                # stage to try (all slow or dead, or fixed wiring), wait longer
                with self.lock:
                    other = any(s.stage == k and s.banned is None and s.slow_until <= time.time()
                                for s in self.router.servers.values())  # fmt: skip
                self.stop.wait(0.05 if other and not self.fixed else 0.5)
                continue
            except WireError as e:
                self.spent.hop("invalid", time.monotonic() - t0)
                with self.lock:
                    self._note("invalid", server, str(e)[:200])
                log.warning("[%s] banned %s: %s", self.name, server[:8], e)
                continue
            wall = max(time.monotonic() - t0, 1e-6)
            self.spent.hop("hop" if exclude is None else "check", wall, h.compute_s)
            with self.lock:
                self._note("finished", server, rows, wall)
            return h
        raise Dropped("stopped")

    def _pinned(self, k: int) -> str:
        chain = self.pinned[k]
        return chain[getattr(self.chain, "id", 0) % len(chain)]

    def _note(self, event: str, server: str, *args: Any) -> None:
        """Tell the router, unless a refresh dropped the server meanwhile."""
        if server in self.router.servers:
            getattr(self.router, event)(server, *args)

    def _choose(self, k: int, now: float, exclude: str | None) -> str:
        if exclude is None:
            return self.router.choose(k, now)
        others = [
            s.server
            for s in self.router.servers.values()
            if s.stage == k and s.banned is None and s.server != exclude and s.slow_until <= now
        ]
        if not others:
            raise NoServerError(f"stage {k}: no second server")
        return min(others, key=lambda s: (self.router.expected_finish(s), s))

    def checked_hop(self, k: int, kind: str, body: bytes, rows: int) -> Hop:
        h = self.hop(k, kind, body, rows)
        if self.fixed or self.rng.random() >= self.cfg.verify_rate:
            return h
        try:
            h2 = self.hop(k, kind, body, rows, exclude=h.server)
        except Dropped:
            return h  # no second server now: unchecked
        with self.lock:
            self.stats.checks += 1
        if h2.state != h.state:
            # a round applied between the two, or a server behind or ahead: nothing to
            # compare, and only a reply on the newest agreed state is used (one on the
            # previous state may be a stale server's, used for ever if it were taken)
            with self.lock:
                newest = self.states.newest_state(k)
            for x in (h, h2):
                if newest is None or x.state == newest:
                    return x
            raise Dropped(f"stage {k}: replies on states {h.state[:12]} and {h2.state[:12]}")
        if compute.reply_distance(h.reply, h2.reply) <= self.cfg.tolerance:
            with self.lock:  # the evidence both servers are paid on (covey.swarm.evidence)
                self.evidence.append(
                    {"stage": k, "kind": kind, "request": base64.b64encode(body).decode(),
                     "replies": [_reply(h), _reply(h2)]}
                )  # fmt: skip
                del self.evidence[:-MAX_EVIDENCE]  # a long outage: the oldest go unpaid
            return h
        self.stats.disputes += 1
        self.spent.disputed()
        verdict = self.client.post(
            "/v1/swarm/dispute",
            {
                "run_id": self.run_id,
                "peer_id": self.identity.peer_id,
                "stage": k,
                "kind": kind,
                "request": base64.b64encode(body).decode(),
                "replies": [_reply(h), _reply(h2)],
            },
        )
        with self.lock:
            for liar in verdict["liars"]:
                self._note("invalid", liar, f"convicted by the referee: {verdict['detail']}")
        log.warning("[%s] stage %d %s disagreement: %s", self.name, k, kind, verdict["detail"])
        raise Dropped(f"stage {k} replies disagreed")

    def microbatch(self, i: int) -> float:
        """Forward and backward microbatch `i`; its loss. Dropped when it cannot finish."""
        from covey.data.batches import sample_batch

        cfg = self.cfg
        batch = sample_batch(
            self.tokens,
            batch_size=cfg.microbatch,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            round=0,
            worker=self.name,
            step=i,
        )
        rows, S = batch.shape[0], cfg.stages
        inputs, used = [encode_tensor(batch[:, :-1], cfg.codec)], []
        for k in range(S - 1):
            h = self.checked_hop(k, "forward", pack(inputs[k]), rows)
            out, _ = _parts(h.reply)
            inputs.append(out)
            self.stats.bytes_between_stages += len(out)
        h = self.checked_hop(
            S - 1, "backward", pack(inputs[-1], encode_tensor(batch[:, 1:], "")), rows
        )
        used.append(h.server)
        grad, _ = _parts(h.reply)
        loss = float(json.loads(_parts(h.reply)[1])["loss"])  # checked in _send
        for k in range(S - 2, -1, -1):
            self.stats.bytes_between_stages += len(grad)
            h = self.checked_hop(k, "backward", pack(inputs[k], grad), rows)
            used.append(h.server)
            grad, _ = _parts(h.reply)
        with self.lock:
            for s in used:
                self.served[s] = self.served.get(s, 0) + 1
        return loss

    # -- the loop ----------------------------------------------------------------------------

    def auto_inflight(self) -> int:
        """Two microbatches per live server (at least two): one being served, one queued,
        so no server idles while a reply is on the wire."""
        with self.lock:
            live = sum(s.banned is None for s in self.router.servers.values())
        return max(2, 2 * live)

    def train(self, *, samples: int | None = None, seconds: float | None = None) -> TrainerStats:
        """Train until `samples` samples or `seconds` passed (either may be None, not both)."""
        if samples is None and seconds is None:
            raise ValueError("give samples or seconds (or both)")
        self.refresh()
        end = None if seconds is None else time.monotonic() + seconds
        st = self.stats

        def more() -> bool:
            done = samples is not None and st.samples >= samples
            return not done and (end is None or time.monotonic() < end) and not self.stop.is_set()

        def worker(chain: int) -> None:
            self.chain.id = chain
            while more():
                with self.lock:
                    i, self._next = self._next, self._next + 1
                self.spent.begin()
                try:
                    loss = self.microbatch(i)
                except Dropped as e:
                    self.spent.end(trained=False)
                    with self.lock:
                        st.dropped += 1
                    log.warning("[%s] microbatch %d dropped: %s", self.name, i, e)
                    continue
                except Exception:  # a bug or an unforeseen reply: this microbatch only
                    self.spent.end(trained=False)
                    with self.lock:
                        st.dropped += 1
                    log.exception("[%s] microbatch %d failed", self.name, i)
                    continue
                self.spent.end(trained=True)
                with self.lock:
                    st.microbatches += 1
                    st.samples += self.cfg.microbatch
                    st.losses.append(loss)

        n = self.inflight or self.auto_inflight()
        threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(n)]
        for t in threads:
            t.start()
        last = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(0.1)
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                self.refresh()
                self.report()
        self.report()
        return st

    def loss(self, last: int = 10) -> float | None:
        tail = self.stats.losses[-last:]
        return sum(tail) / len(tail) if tail else None

    def report(self) -> None:
        """Report progress and served work (covey.swarm.reports.send_report)."""
        send_report(self)

    def close(self) -> None:
        self.stop.set()
        self.http.close()
        self.client.close()


def _seconds(header: str | None) -> float | None:
    """A reply's X-Covey-Compute: finite, non-negative seconds, or None."""
    try:
        x = float(header) if header is not None else None
    except ValueError:
        return None
    return x if x is not None and math.isfinite(x) and x >= 0 else None


def _reply(h: Hop) -> dict[str, str]:
    return {"server": h.server, "state": h.state, "sig": h.sig,
            "reply": base64.b64encode(h.reply).decode()}  # fmt: skip


def _parts(reply: bytes) -> tuple[bytes, bytes]:
    from covey.swarm.wire import unpack

    out, meta = unpack(reply, 2)
    return out, meta


def model_dims(cfg: SwarmConfig) -> tuple[int, int]:
    """(vocab, hidden) of the run's model: covey's GPT (bytes, n_embd) or the hf: config's."""
    if cfg.model.startswith("hf:"):
        from covey.models.hf import hf_config

        c = hf_config(cfg.model[3:])
        return int(c.vocab_size), int(c.hidden_size)
    return 256, cfg.n_embd


def _keyed(server: dict[str, Any]) -> bool:
    """Whether a servers-view entry carries the public key its peer id is the hash of."""
    try:
        return peer_id_of(str(server.get("public_key", ""))) == server["peer_id"]
    except IdentityError:
        return False
