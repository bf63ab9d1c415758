"""A SWARM stage server: `covey swarm server --coordinator URL`.

Joins (signed), is assigned a stage, builds it from the run's seed or fetches the stage's
agreed state from its peers by content id (hash-checked), and serves
`POST /v1/swarm/forward` and `/v1/swarm/backward` (covey.swarm.compute) over stdlib HTTP,
one request at a time (a device). Every reply is signed over (stage, state id, request
hash, reply hash). Heartbeats carry measured throughput, queue and pending samples; the
reply says when to join an averaging round (snapshot the accumulated gradient sum into a
blob, report it), apply a committed one (fetch every member's blob, hash-checked, apply
their mean with AdamW), resync, or move to another stage. `slowdown` and `emulate_s`
emulate a slower device by sleeping; `behavior` makes it an adversary for tests.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from covey.blobs import BlobClient, BlobError, BlobServer, BlobStore
from covey.devices import device_name, resolve_device
from covey.peer.client import CoordinatorClient, CoordinatorLost, PeerRejected
from covey.protocol.swarm import MAX_THROUGHPUT
from covey.swarm import compute, subspace
from covey.swarm.config import SwarmConfig
from covey.swarm.stage import Stage
from covey.swarm.wire import (
    WireError,
    build_stage,
    encode_tensor,
    load_state,
    pack,
    reply_message,
    sha,
    state_bytes,
    unpack,
)
from covey.trust.identity import Identity

log = logging.getLogger("covey.swarm.server")
BEHAVIORS = ("honest", "wrong", "noise", "zero", "stale", "subtle", "shade")
#: "subtle": one request in SUBTLE_EVERY is answered with an error of relative L2
#: SUBTLE_NOISE (1.4x the default tolerance) along a direction drawn from the request's
#: hash; "shade", its accomplice, answers the same requests with SHADE of that error: within
#: the tolerance of the truth and of the liar's reply, so a check pairing the two agrees
SUBTLE_EVERY, SUBTLE_NOISE, SHADE = 5, 0.07, 0.5
MAX_BODY = 64 << 20
# the seconds the last request this thread handled took to compute (StageServer.handle)
SPENT = threading.local()


class StageServer:
    def __init__(
        self,
        coordinator: str,
        *,
        name: str,
        slowdown: float = 1.0,
        emulate_s: float = 0.0,
        behavior: str = "honest",
        stake: float = 0.0,
        port: int = 0,
        seed: int = 0,
        stage: int | None = None,
        device: str = "cpu",
        model: str | None = None,
        identity: Identity | None = None,
    ) -> None:
        """`device` (covey.devices.resolve_device; DeviceError naming a bad or absent one)
        holds the stage's weights, optimizer state, activations and gradients. `model`:
        this machine's copy of the run's `hf:DIR` model (its config.json must have the
        run's digest); default: the path the run's spec names. `identity`: the server's
        key (one the run's owner funded, to stake); default: a fresh one."""
        if behavior not in BEHAVIORS:
            raise ValueError(f"behavior {behavior!r} must be one of {BEHAVIORS}")
        if slowdown < 1:
            raise ValueError(f"slowdown ({slowdown}) must be >= 1")
        self.device = resolve_device(device)
        self.name, self.slowdown, self.emulate_s = name, slowdown, emulate_s
        self.behavior, self.stake, self.port, self.wanted = behavior, stake, port, stage
        self.model = model
        self.identity = identity or Identity.generate()
        self.stop = threading.Event()
        self.client = CoordinatorClient(
            coordinator, identity=self.identity, lost_s=90.0, stop=self.stop
        )
        self.tmp = tempfile.TemporaryDirectory(prefix="covey-swarm-")
        self.store = BlobStore(Path(self.tmp.name) / "blobs")
        self.blobs = BlobServer(self.store)
        self.fetcher = BlobClient(timeout_s=10.0, retries=2)
        self.lock = threading.Lock()  # the device: one computation or state change at a time
        self._dlock = threading.Lock()
        self._directive: tuple[tuple[int, int, str | None], dict[str, Any] | None] | None = None
        self._wake = threading.Event()
        self.rng = random.Random(seed)
        self.stage: Stage | None = None
        self.k = -1
        self.state: str | None = None
        self.throughput, self.waiting, self.reported = 0.0, 0, -1
        # seconds computing requests, and when heartbeats began (covey.swarm.costs)
        self.busy_s, self.since = 0.0, time.monotonic()
        self.cfg: SwarmConfig | None = None
        self.halted: str | None = None  # the owner's reason, once the run is halted

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.blobs.start()
        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        spec = self.client.get("/v1/swarm/spec")
        self.run_id, self.cfg = spec["run_id"], SwarmConfig.received(spec["spec"])
        if self.model is not None:
            if not self.cfg.model:
                raise ValueError(f"--model {self.model}: this run trains covey's GPT, not hf:")
            # the local path only; build_hf_stage checks its config.json by the run's digest
            self.cfg = self.cfg.model_copy(update={"model": self.model})
        self._join()
        log.info("[%s] serving stage %d (%s, x%.1f)", self.name, self.k, self.behavior,
                 self.slowdown)  # fmt: skip

    def _join(self) -> None:
        body = {
            "run_id": self.run_id, "peer_id": self.identity.peer_id, "role": "server",
            "public_key": self.identity.public_key, "name": self.name, "stake": self.stake,
            "url": f"http://127.0.0.1:{self.http.server_address[1]}",
            "blob_url": self.blobs.url, "device": device_name(self.device)[:80],
            # a server the coordinator forgot (late heartbeats) asks for its stage back
            "stage": self.wanted if self.wanted is not None else (self.k if self.k >= 0 else None),
        }  # fmt: skip
        reply = self.client.post("/v1/swarm/join", body)
        if int(reply["stage"]) != self.k:
            self._become(int(reply["stage"]), None, [])

    def run(self) -> None:
        """Act on the coordinator's directives until stopped. Heartbeats go from their own
        thread, so slow work here (fetching blobs, applying a round, loading a state) never
        makes this server look dead; a directive is acted on only if nothing changed since
        the heartbeat it answers (stage, step, state), so none is applied twice."""
        assert self.cfg is not None
        threading.Thread(target=self._beats, daemon=True, name="heartbeat").start()
        while not self.stop.is_set():
            self._wake.wait(self.cfg.heartbeat_s)
            self._wake.clear()
            with self._dlock:
                item, self._directive = self._directive, None
            if item is None:
                continue
            basis, d = item
            try:
                if d is None:
                    self._join()
                elif basis == self._basis():
                    self._act(d)
            except (httpx.HTTPError, WireError, BlobError, PeerRejected, CoordinatorLost) as e:
                log.warning("[%s] %s failed: %s", self.name, "rejoin" if d is None else "step", e)

    def _basis(self) -> tuple[int, int, str | None]:
        return self.k, -1 if self.stage is None else self.stage.steps, self.state

    def _beats(self) -> None:
        """Heartbeat every heartbeat_s; keep the latest reply for `run`. Stop the server
        when banned (403) or when no heartbeat got through for 90 s."""
        assert self.cfg is not None
        last_ok = self.since = time.monotonic()
        while not self.stop.wait(self.cfg.heartbeat_s):
            k, step, state = basis = self._basis()
            stage = self.stage
            body = {
                "run_id": self.run_id, "peer_id": self.identity.peer_id, "stage": k,
                "step": step, "state": state, "pending": 0 if stage is None else stage.samples,
                # a claim within the schema's bound (covey.protocol.swarm.SwarmHeartbeat)
                "throughput": min(self.throughput, MAX_THROUGHPUT), "queue": self.waiting,
                # this server's time in the run and its compute (covey.swarm.costs)
                "uptime_s": round(time.monotonic() - self.since, 3),
                "busy_s": round(self.busy_s, 3),
            }  # fmt: skip
            try:
                d: dict[str, Any] | None = self.client.post_once(
                    "/v1/swarm/heartbeat", body, timeout_s=10.0
                )
                last_ok = time.monotonic()
            except PeerRejected as e:
                if e.status in (403, 410):  # banned, or the run was halted by its owner
                    log.error("[%s] %s: %s", self.name, _GONE[e.status], e.message)
                    self.halted = e.message if e.status == 410 else None
                    self.stop.set()
                    return
                log.warning("[%s] heartbeat refused (%s); joining again", self.name, e.message)
                d = None  # run() rejoins
            except httpx.HTTPError as e:
                if time.monotonic() - last_ok > 90.0:
                    log.error("[%s] coordinator unreachable for 90 s: %s", self.name, e)
                    self.stop.set()
                    return
                continue
            with self._dlock:
                self._directive = (basis, d)
            self._wake.set()

    def close(self) -> None:
        """Stop serving. A computation under way finishes first (up to 30 s), and none
        starts after it: a process ending while torch computes in a handler's thread
        aborts instead of exiting with its status."""
        self.stop.set()
        self.http.shutdown()
        self.lock.acquire(timeout=30.0)  # kept: requests still queued never compute
        self.blobs.close()
        self.tmp.cleanup()

    # -- state -------------------------------------------------------------------------------

    def _publish(self) -> None:
        assert self.stage is not None
        self.state = self.store.put(state_bytes(self.stage))

    def _become(self, k: int, agreed: str | None, providers: list[str]) -> None:
        """Serve stage `k` at the agreed state (fetched, hash-checked) or the seed's."""
        assert self.cfg is not None
        stage = build_stage(self.cfg, k, self.device)
        if agreed is not None:
            load_state(stage, self.fetcher.fetch(agreed, providers))
        with self.lock:
            self.stage, self.k, self.reported = stage, k, -1
            self._publish()
            if agreed is not None:
                self.state = agreed if self.behavior == "stale" else self.state

    def _act(self, d: dict[str, Any]) -> None:
        """Move, copy the agreed state up, report to a round, apply one, or resync."""
        assert self.stage is not None
        providers = [*d["providers"], self.client.base_url]
        if int(d["stage"]) != self.k:
            log.info("[%s] moved: stage %d -> %d", self.name, self.k, d["stage"])
            self._become(int(d["stage"]), d.get("agreed"), providers)
            return
        if d.get("want_state") and d["want_state"] == self.state and self.store.has(self.state):
            self._upload_state(self.state)
        if d.get("round") and d["round"]["id"] != self.reported:
            self._report(d["round"])
        if d.get("apply"):
            self._apply(d["apply"])
        elif d.get("resync"):
            if self.behavior == "stale":
                self.state = d["resync"]  # claims the agreed state, keeps its old weights
                self.stage.steps = int(d["step"])
            else:
                log.info("[%s] resync stage %d to %s", self.name, self.k, d["resync"][:12])
                self._become(self.k, d["resync"], providers)

    def _upload_state(self, cid: str) -> None:
        body = {"run_id": self.run_id, "peer_id": self.identity.peer_id, "stage": self.k,
                "cid": cid, "data": base64.b64encode(self.store.get(cid)).decode()}  # fmt: skip
        try:
            self.client.post("/v1/swarm/state", body)
        except PeerRejected as e:  # the agreed state moved on meanwhile
            log.info("[%s] state copy refused: %s", self.name, e.message)

    def _report(self, rnd: dict[str, Any]) -> None:
        assert self.stage is not None
        with self.lock:  # snapshot: later microbatches accumulate for the next round
            s = self.stage
            grads = {
                f"g.{i}": (torch.zeros_like(p) if p.grad is None else p.grad).cpu().clone()
                for i, p in enumerate(s.params)
            }
            samples = s.samples
            for p in s.params:
                p.grad = None
            s.samples = 0
        grads["samples"] = torch.tensor([samples], dtype=torch.int64)
        cid = self.store.put(st_save(grads))
        self.reported = rnd["id"]
        body = {
            "run_id": self.run_id,
            "peer_id": self.identity.peer_id,
            "stage": self.k,
            "round": rnd["id"],
            "cid": cid,
            "samples": samples,
            "data": base64.b64encode(self.store.get(cid)).decode(),
        }
        try:
            self.client.post("/v1/swarm/round", body)
        except PeerRejected as e:
            log.warning("[%s] round %d report refused: %s", self.name, rnd["id"], e.message)

    def _apply(self, rnd: dict[str, Any]) -> None:
        """Apply a committed round: the mean of every member's gradient sum."""
        assert self.stage is not None
        s = self.stage
        if s.steps != rnd["step"]:
            return  # applied already
        total, acc = 0, [torch.zeros_like(p) for p in s.params]
        for peer, r in sorted(rnd["reports"].items()):
            data = (
                self.store.get(r["cid"])
                if self.store.has(r["cid"])
                else self.fetcher.fetch(r["cid"], [r["url"] or self.client.base_url])
            )
            t = st_load(data)
            n = int(t["samples"][0])
            if n != r["samples"]:
                raise WireError(f"round {rnd['id']}: {peer[:8]}'s blob holds {n} samples")
            total += n
            for i, a in enumerate(acc):
                a.add_(t[f"g.{i}"].to(a.device))
        with self.lock:
            if self.behavior != "stale":
                saved, saved_n = [p.grad for p in s.params], s.samples
                for p, a in zip(s.params, acc, strict=True):
                    p.grad = a / total
                s.optimizer.step()
                for p, g in zip(s.params, saved, strict=True):
                    p.grad = g
                s.samples = saved_n
            s.steps += 1
            if self.behavior != "stale":
                self._publish()

    # -- requests ----------------------------------------------------------------------------

    def handle(self, kind: str, k: int, body: bytes, check: bool = False) -> tuple[bytes, str]:
        """(reply, signature) for a forward or backward request for stage `k`. `check`: a
        trainer's duplicate of a hop another server ran, answered and signed the same but
        not accumulated: the microbatch counts once in the stage's update. The seconds its
        compute took (the emulated slowdown included) are left in this thread's `SPENT`:
        the reply's X-Covey-Compute, which trainers book (covey.swarm.costs)."""
        assert self.cfg is not None
        self.waiting += 1
        try:
            with self.lock:
                if k != self.k or self.stage is None or self.state is None:
                    raise LookupError(f"this server serves stage {self.k}, not {k}")
                t0 = time.perf_counter()
                run = compute.forward if kind == "forward" else compute.backward
                s = self.stage
                kept = (s.samples, [p.grad for p in s.params]) if check else None
                if kept is not None:  # backward adds into .grad: let it add into copies
                    for p in s.params:
                        p.grad = None if p.grad is None else p.grad.clone()
                try:
                    out = run(self.cfg, k, s, body)
                finally:
                    if kept is not None:
                        s.samples = kept[0]
                        for p, g in zip(s.params, kept[1], strict=True):
                            p.grad = g
                reply = misbehave(self.behavior, kind, out, self.cfg.codec, body)
                busy = time.perf_counter() - t0
                extra = (self.slowdown - 1) * busy + self.slowdown * self.emulate_s
                if extra > 0:
                    time.sleep(extra)
                rows = _rows(body)
                rate = rows / (busy + extra)
                self.throughput = (
                    rate if not self.throughput else 0.7 * self.throughput + 0.3 * rate
                )
                sig = self.identity.sign(reply_message(k, self.state, sha(body), sha(reply)))
                SPENT.seconds = busy + max(0.0, extra)
                self.busy_s += SPENT.seconds
                return reply, self.state + " " + sig
        finally:
            self.waiting -= 1


def misbehave(behavior: str, kind: str, reply: bytes, codec: str, request: bytes = b"") -> bytes:
    """An adversary's version of an honest reply to `request`: random outputs ("wrong"),
    outputs plus noise of half their spread ("noise"), zero input gradients and sketch on
    backward ("zero"), and, for one request in SUBTLE_EVERY (chosen by the request's
    sha256, so a duplicate of it is answered alike), outputs moved SUBTLE_NOISE of their
    norm along a direction seeded by that hash ("subtle"), or SHADE of that move ("shade",
    the same direction). "honest" and "stale" (old weights, claimed current) and the
    requests "subtle" and "shade" leave alone return it unchanged."""
    if behavior in ("honest", "stale"):
        return reply
    if behavior in ("subtle", "shade") and int(sha(request)[:8], 16) % SUBTLE_EVERY:
        return reply
    out, meta = unpack(reply, 2)
    meta_d = json.loads(meta)
    ids = subspace.decode_payload(out)[0] if subspace.is_payload(out) else None
    if kind == "backward" and (behavior == "zero" or not out):
        meta_d["sketch"] = [0.0 for _ in meta_d["sketch"]]
    if not out:
        return pack(out, json.dumps(meta_d).encode())
    x = compute.decode_any(out)
    if behavior == "wrong":
        x = torch.randn_like(x)
    elif behavior == "noise":
        x = x + 0.5 * x.std() * torch.randn_like(x)
    elif behavior in ("subtle", "shade"):
        g = torch.Generator().manual_seed(int(sha(request)[8:23], 16))
        way = torch.randn(x.shape, generator=g, dtype=torch.float32).to(x.dtype)
        size = SUBTLE_NOISE * (SHADE if behavior == "shade" else 1.0)
        x = x + size * x.norm() * way / way.norm()
    elif behavior == "zero" and kind == "backward":
        x = torch.zeros_like(x)
    payload = (
        subspace.encode_payload(ids, x)
        if ids is not None
        else encode_tensor(x, "plain" if codec == "subspace" else codec)
    )
    return pack(payload, json.dumps(meta_d).encode())


def _rows(body: bytes) -> int:
    try:
        first = unpack(body, int.from_bytes(body[:4], "little"))[0]
        return int(compute.decode_any(first).shape[0])
    except (WireError, ValueError):
        return 1


def _handler(server: StageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

        def do_POST(self) -> None:
            kind = self.path.rsplit("/", 1)[-1]
            try:
                n = int(self.headers.get("Content-Length", "-1"))
                k = int(self.headers.get("X-Covey-Stage", "-1"))
                if kind not in ("forward", "backward") or not 0 <= n <= MAX_BODY:
                    return self._send(404 if n >= 0 else 411, b"no such request")
                check = self.headers.get("X-Covey-Check") == "1"
                SPENT.seconds = None
                reply, sig = server.handle(kind, k, self.rfile.read(n), check)
                headers = {"X-Covey-Signature": sig}
                if SPENT.seconds is not None:
                    headers["X-Covey-Compute"] = f"{SPENT.seconds:.6f}"
                self._send(200, reply, headers)
            except LookupError as e:
                self._send(409, str(e).encode())
            except (WireError, ValueError) as e:
                self._send(400, str(e).encode())

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            try:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                for key, v in (headers or {}).items():
                    self.send_header(key, v)
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the trainer gave up: rerouted
                log.debug("reply to a caller that left")

    return Handler


_GONE = {403: "banned", 410: "the run was halted by its owner; stopping"}


def serve(server: StageServer) -> None:
    """Start, heartbeat until SIGTERM/SIGINT (the caller sets `server.stop`), close."""
    server.start()
    try:
        server.run()
    finally:
        server.close()
