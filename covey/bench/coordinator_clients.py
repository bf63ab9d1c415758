"""The client processes of `covey bench coordinator` (covey.bench.coordinator starts them):
each an asyncio loop holding its share of the simulated peers, over hand-written keep-alive
HTTP/1.1 connections, recording every request's latency and every error by operation."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

OPS = ("heartbeat", "round", "round wake", "upload", "submit")  # the operations timed


class _Conn:
    """One keep-alive HTTP/1.1 connection for one peer's heartbeats or polls: a request
    written by hand and its reply read by Content-Length. httpx costs the client ~10x more
    CPU a request, and at 1000 peers on 2 cores the client, not the coordinator, would be
    what is measured. Reconnects after any error."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"{method} {target} HTTP/1.1\r\nHost: {self.host}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        try:
            self.writer.write(head.encode() + b"\r\n" + body)
            status_line = await self.reader.readuntil(b"\r\n")
            headers = await self.reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in headers.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            payload = await self.reader.readexactly(length)
        except BaseException:
            self.close()
            raise
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def client_main(
    url: str,
    run_id: str,
    indices: list[int],
    submitters: int,
    heartbeat_s: float,
    poll_s: float,
    round_wait_s: float,
    warmup_s: float,
    duration_s: float,
    go: Any,
    results: Any,
) -> None:
    """One client process: its peers join, then run until `warmup_s` + `duration_s`
    after `go`, measuring the last `duration_s`."""
    try:
        client = _Client(
            url, run_id, indices, submitters, heartbeat_s, poll_s, round_wait_s, warmup_s
        )
        asyncio.run(client.run(duration_s, go, results))
    except BaseException as e:  # reported, so the parent fails with the reason
        results.put(("failed", f"{type(e).__name__}: {e}"))


class _Client:
    def __init__(
        self,
        url: str,
        run_id: str,
        indices: list[int],
        submitters: int,
        heartbeat_s: float,
        poll_s: float,
        round_wait_s: float,
        warmup_s: float,
    ) -> None:
        from covey.trust.identity import Identity

        self.url, self.run_id = url, run_id
        self.keys = {i: Identity.generate() for i in indices}
        self.submitting = [i for i in indices if i < submitters]
        self.heartbeat_s, self.poll_s, self.round_wait_s = heartbeat_s, poll_s, round_wait_s
        self.warmup_s = warmup_s
        self.first_seen: dict[str, float] = {}  # round tag -> when a peer here first saw it
        self.samples: dict[str, list[float]] = {op: [] for op in OPS}
        self.sent: dict[str, list[float]] = {op: [] for op in OPS}
        self.errors: dict[str, int] = dict.fromkeys(OPS, 0)
        self.reasons: dict[str, int] = {}
        self.late = 0
        self.long_polls = 0  # answered round long-polls (not timed: they last until news)
        self.measuring = False
        self.last_failure = ""

    async def run(self, duration_s: float, go: Any, results: Any) -> None:
        import httpx

        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(
            base_url=self.url, limits=limits, timeout=30.0, trust_env=False
        ) as http:
            self.http = http
            self.numel = (await http.get("/v1/run")).json()["parameters"]
            host, port = http.base_url.host, http.base_url.port
            assert port is not None
            self.conns = {(i, op): _Conn(host, port) for i in self.keys for op in ("hb", "poll")}
            self.conns |= {(i, "submit"): _Conn(host, port) for i in self.submitting}
            gate = asyncio.Semaphore(16)
            await asyncio.gather(*(self._join(i, gate) for i in self.keys))
            results.put(("joined",))
            while not await asyncio.to_thread(go.wait, 1.0):
                pass
            # the first `warmup_s`: every peer's first heartbeat and round poll land at
            # once (a start-up herd, not the steady state this bench measures)
            stop_at = time.monotonic() + self.warmup_s + duration_s
            asyncio.get_running_loop().call_later(self.warmup_s, self._start_measuring)
            tasks = [self._every(self.heartbeat_s, stop_at, self._heartbeat, i) for i in self.keys]
            if self.round_wait_s > 0:  # as workers do: a long-poll, sent again when answered
                tasks += [self._watch(i, stop_at) for i in self.keys]
            else:
                tasks += [self._every(self.poll_s, stop_at, self._poll, i) for i in self.keys]
            tasks += [self._submit_loop(i, stop_at) for i in self.submitting]
            await asyncio.gather(*tasks)
            for conn in self.conns.values():
                conn.close()
        results.put(
            ("done", self.samples, self.errors, self.reasons, self.late, self.sent, self.long_polls)
        )

    def _start_measuring(self) -> None:
        self.measuring, self.reasons = True, {}

    async def _post(self, op: str, path: str, i: int, body: dict[str, Any], round: int) -> Any:
        from covey.trust.identity import request_purpose

        signed = self.keys[i].sign_request(body, round, purpose=request_purpose(path))
        return await self._timed(op, self.http.post(path, json=signed))

    async def _timed(self, op: str, request: Any) -> Any:
        start = time.perf_counter()
        try:
            resp = await request
        except Exception as e:
            self._error(op, type(e).__name__)
            return None
        elapsed = time.perf_counter() - start
        if resp.status_code != 200:
            self._error(op, f"{resp.status_code} {resp.text[:80]}")
            return None
        if self.measuring:
            self.samples[op].append(elapsed)
            self.sent[op].append(time.time() - elapsed)
        return resp.json()

    def _error(self, op: str, reason: str) -> None:
        if self.measuring:
            self.errors[op] += 1
        else:
            self.last_failure = f"{op}: {reason}"
        key = f"{op}: {reason}"
        self.reasons[key] = self.reasons.get(key, 0) + 1

    async def _join(self, i: int, gate: asyncio.Semaphore) -> None:
        key = self.keys[i]
        body = {
            "run_id": self.run_id,
            "peer_id": key.peer_id,
            "public_key": key.public_key,
            "name": f"sim-{i}",
            "step_time_s": 0.01,
        }
        async with gate:
            if await self._post("join", "/v1/join", i, body, -1) is None:
                raise RuntimeError(f"peer sim-{i} could not join: {self.last_failure}")

    async def _every(self, period: float, stop_at: float, action: Any, i: int) -> None:
        """Call action(i) every `period` s (random phase, no drift) until `stop_at`; a tick
        missed because the previous request was still out is skipped and counted late."""
        next_at = time.monotonic() + random.uniform(0, period)
        while next_at < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await action(i)
            next_at += period
            now = time.monotonic()
            while next_at < now:  # the reply came after the next tick: skip it
                self.late += 1
                next_at += period

    async def _lean(
        self,
        op: str,
        conn: _Conn,
        method: str,
        target: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> Any:
        start = time.perf_counter()
        try:
            request = conn.request(method, target, body, headers)
            status, payload = await asyncio.wait_for(request, 30.0 + self.round_wait_s)
        except Exception as e:
            self._error(op, type(e).__name__)
            return None
        elapsed = time.perf_counter() - start
        if status != 200:
            self._error(op, f"{status} {payload[:80]!r}")
            return None
        if self.measuring:
            self.samples[op].append(elapsed)
            self.sent[op].append(time.time() - elapsed)
        return payload

    async def _heartbeat(self, i: int) -> None:
        from covey.trust.identity import request_purpose

        body = {"run_id": self.run_id, "peer_id": self.keys[i].peer_id}
        signed = self.keys[i].sign_request(body, -1, purpose=request_purpose("/v1/heartbeat"))
        data = json.dumps(signed).encode()
        await self._lean("heartbeat", self.conns[(i, "hb")], "POST", "/v1/heartbeat", data)

    async def _poll(self, i: int, conn: str = "poll") -> Any:
        target = f"/v1/round?peer_id={self.keys[i].peer_id}"
        payload = await self._lean("round", self.conns[(i, conn)], "GET", target, b"")
        return None if payload is None else json.loads(payload)

    async def _watch(self, i: int, stop_at: float) -> None:
        """Watch the round as a worker does: one plain poll, then long-polls past the tag
        last seen until `stop_at`, each sent as soon as the last is answered (a member
        that never trains: the most long-polls a peer holds). A reply with a new tag is
        timed as "round wake" from the first peer of this process that saw that tag."""
        from covey.trust.polls import ROUND_POLL, poll_headers

        await asyncio.sleep(random.uniform(0, self.heartbeat_s))  # first polls spread out
        info = await self._poll(i)
        tag = None if info is None else info.get("tag")
        while (left := stop_at - time.monotonic()) > 0.05:
            if tag is None:  # no view yet (an error): poll again, not in a tight loop
                await asyncio.sleep(min(1.0, left))
                info = await self._poll(i)
                tag = None if info is None else info.get("tag")
                continue
            wait = round(min(self.round_wait_s, left), 3)
            target = f"/v1/round?peer_id={self.keys[i].peer_id}&after={tag}&wait={wait}"
            signed = poll_headers(self.keys[i], self.run_id, path=ROUND_POLL)
            conn = self.conns[(i, "poll")]
            try:
                request = conn.request("GET", target, b"", signed)
                status, payload = await asyncio.wait_for(request, wait + 30.0)
            except Exception as e:
                self._error("round", f"long-poll: {type(e).__name__}")
                tag = None
                continue
            if status != 200:
                self._error("round", f"long-poll: {status} {payload[:80]!r}")
                tag = None
                continue
            if self.measuring:
                self.long_polls += 1
            view, now = json.loads(payload), time.monotonic()
            new = view.get("tag")
            woken = new != tag and view.get("member")  # woken by news: a round it is in
            if woken:
                first = self.first_seen.setdefault(new, now)
                if self.measuring:
                    self.samples["round wake"].append(now - first)
                    self.sent["round wake"].append(time.time() - (now - first))
            tag = new  # and at once the next long-poll (a member that never trains)

    async def _submit_loop(self, i: int, stop_at: float) -> None:
        """Submit to every round this peer is a member of, then wait for its certificate."""
        import torch

        from covey.algorithms.codecs import get_codec
        from covey.blobs.client import upload_headers
        from covey.protocol.content import content_id
        from covey.trust.polls import poll_headers

        key, done = self.keys[i], None
        generator = torch.Generator().manual_seed(i)
        while time.monotonic() < stop_at:
            info = await self._poll(i, "submit")  # its own connection: one request at a time
            if info is None or info.get("phase") != "open" or not info.get("member"):
                await asyncio.sleep(0.25)
                continue
            this = (info["round"], info["attempt"])
            if this == done:
                await asyncio.sleep(0.25)
                continue
            payload = get_codec("fp32").encode(torch.randn(self.numel, generator=generator) * 1e-4)
            cid = content_id(payload)
            headers = upload_headers(key, self.run_id, cid, len(payload))
            put = self.http.put(f"/v1/blobs/{cid}", content=payload, headers=headers)
            if await self._timed("upload", put) is None:
                done = this
                continue
            steps = info["assignment"]["inner_steps"]
            body = {
                "run_id": self.run_id,
                "round": info["round"],
                "attempt": info["attempt"],
                "peer_id": key.peer_id,
                "cid": cid,
                "start_hash": info["start_hash"],
                "size": len(payload),
                "tokens": 4 * 64 * steps,
                "inner_steps": steps,
            }
            path = f"/v1/rounds/{info['round']}/contributions"
            await self._post("submit", path, i, body, info["round"])
            done = this
            wait = max(0.0, min(5.0, stop_at - time.monotonic()))
            if wait > 0:  # the worker's long-poll: not timed (it lasts until the commit)
                cert = f"/v1/rounds/{info['round']}/certificate"
                with_wait = {"wait": wait, "peer_id": key.peer_id}
                signed = poll_headers(key, self.run_id, info["round"])  # counted per peer
                try:
                    await self.http.get(cert, params=with_wait, headers=signed, timeout=wait + 10)
                except Exception as e:
                    self._error("submit", f"certificate long-poll: {type(e).__name__}")
