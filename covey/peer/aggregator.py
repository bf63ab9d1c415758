"""The aggregator role of sharded aggregation, and a peer's shard fetch.

An aggregator is a staked validator key: validators are already staked, drawn from the
beacon, paid and slashed for checks, and do not train, so aggregating between rounds
takes no inner steps from anyone; a drawn re-aggregation is a check like the ones they
already do. For each committed round it reads the board (`GET /v1/shards/{r}`), and for
every shard that is its turn it reads ONLY that shard's byte ranges of every accepted
contribution from the blob plane (HTTP Range), aggregates and steps it
(covey.algorithms.shards.new_shard), serves the new shard from its own blob server and
publishes the hash, signed. For every shard it is the drawn checker of, it does the same
computation and reports its hash; a disagreement goes to the coordinator's referee.

A peer assembles the new state with `fetch_certified_state`: shard by shard, from each
shard's providers in turn, each blob checked against the coordinator-signed shard
certificate; a shard whose hash is not certified is refused and the next provider tried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from covey.algorithms.base import Strategy
from covey.algorithms.shards import (
    flat_state,
    new_shard,
    read_slice,
    shard_from_bytes,
    shard_hash,
    shard_to_bytes,
    state_from_flat,
)
from covey.algorithms.state import TrainState
from covey.blobs import BlobStore
from covey.config import DiLoCoConfig
from covey.protocol.checkpoint import state_from_bytes
from covey.protocol.content import content_id
from covey.trust.identity import Identity, canonical_json, request_purpose, verify
from covey.trust.shard_evidence import board_digest, reads_digest, recording

log = logging.getLogger("covey.aggregator")

#: how often an aggregator repeats its readiness (the coordinator's window is 60 s)
READY_EVERY_S = 10.0
#: concurrent range reads of one shard's slices of the contributions
READERS = 8


def computed_from(board: dict[str, Any], index: int) -> str:
    """The board digest of shard `index` of a `GET /v1/shards` board: what `compute` reads."""
    shard, inputs = board["shards"][index], board["inputs"]
    rows = zip(inputs["contributions"], inputs["weights"], strict=True)
    return board_digest(
        round=board["round"], start_hash=board["start_hash"], span=(shard["start"], shard["end"]),
        numel=board["numel"], inputs=[(c["peer_id"], c["cid"], w) for c, w in rows],
        norms=inputs["norms"],
    )  # fmt: skip


def shard_purpose(round: int, action: str) -> str:
    """The purpose tag an aggregator signs for `action` ("publish" | "check")."""
    return request_purpose(f"/v1/shards/{round}/{action}")


def certificate_message(body: dict[str, Any]) -> bytes:
    """The bytes of a shard certificate that the coordinator signs (signature left out)."""
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return f"covey-shard-certificate/v1\n{canonical_json(unsigned)}".encode()


class ShardFetchError(RuntimeError):
    """No provider delivered a shard whose hash the certificate names."""


def _request(
    http: httpx.Client, method: str, url: str, deadline_s: float, **kw: Any
) -> httpx.Response:
    """One request, retried while the coordinator's rate limiter answers 429 (its
    Retry-After honoured) or the connection fails, until `deadline_s` from now."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            resp = http.request(method, url, **kw)
            if resp.status_code != 429:
                return resp
            wait = float(resp.headers.get("Retry-After", "0.5"))
        except httpx.TransportError:
            wait = 0.5
        if time.monotonic() + wait > give_up:
            raise TimeoutError(f"{method} {url}: no answer but 429/errors for {deadline_s} s")
        time.sleep(min(wait, 2.0))


class ShardAggregator:
    """One aggregator key's work for a run (a lying one: covey.peer.cheater_aggregator)."""

    def __init__(
        self,
        coordinator: str,
        identity: Identity,
        run_id: str,
        strategy: Strategy,
        algorithm: DiLoCoConfig,
        store: BlobStore,
        blob_url: str,
        *,
        deadline_s: float = 60.0,
    ) -> None:
        self.coordinator, self.identity, self.run_id = coordinator.rstrip("/"), identity, run_id
        self.strategy, self.algorithm = strategy, algorithm
        self.store, self.blob_url, self.deadline_s = store, blob_url, deadline_s
        self.http = httpx.Client(timeout=30.0, trust_env=False)
        self.bytes_read = 0  # contribution bytes fetched: the shard's ranges only
        self.last_reads = ""  # the digest of the ranges `compute` read last (signed)
        self.shards_computed = 0
        self._start: tuple[str, TrainState] | None = None  # (cid, state): one per round
        self._ready_at = 0.0
        self._count = threading.Lock()
        self._flat: tuple[TrainState, str, torch.Tensor, torch.Tensor | None] | None = (
            None  # when this key last told the coordinator it aggregates
        )

    def close(self) -> None:
        self.http.close()

    def board(self, round: int) -> dict[str, Any]:
        resp = _request(self.http, "GET", f"{self.coordinator}/v1/shards/{round}", self.deadline_s)
        if resp.status_code != 200:
            raise RuntimeError(f"shard board of round {round}: {resp.status_code} {resp.text}")
        return resp.json()

    def _read(self, cid: str) -> Callable[[int, int], bytes]:
        def read(a: int, b: int) -> bytes:
            url = f"{self.coordinator}/v1/blobs/{cid}"
            headers = {"Range": f"bytes={a}-{b - 1}", "Accept-Encoding": "identity"}
            resp = _request(self.http, "GET", url, self.deadline_s, headers=headers)
            if resp.status_code != 206 or len(resp.content) != b - a:
                raise RuntimeError(f"range {a}-{b} of {cid[:12]}: {resp.status_code}")
            with self._count:
                self.bytes_read += b - a
            return resp.content

        return read

    def compute(
        self, board: dict[str, Any], index: int, start_state: TrainState
    ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """The new shard `index` of the board's round from the start state: (params,
        momentum, hash). ValueError if the start state is not the board's."""
        if self._flat is None or self._flat[0] is not start_state:  # once per start state
            self._flat = (
                start_state,
                start_state.digest(),
                *flat_state(start_state, self.strategy.names),
            )
        _, digest, params, momentum = self._flat
        if digest != board["start_hash"]:
            raise ValueError(f"start state {digest[:12]} is not the board's")
        shard, inputs = board["shards"][index], board["inputs"]
        self.shards_computed += 1
        start, end, numel = shard["start"], shard["end"], board["numel"]
        codec = self.strategy.codec
        readers = [recording(self._read(c["cid"])) for c in inputs["contributions"]]
        with ThreadPoolExecutor(READERS) as pool:  # range reads are round trips: overlap them
            slices = list(pool.map(lambda r: read_slice(codec, numel, start, end, r[0]), readers))
        self.last_reads = reads_digest([log for _, log in readers])  # signed with the hash
        new_p, new_m = new_shard(
            self.strategy.aggregator,
            slices,
            inputs["weights"],
            inputs["norms"],
            params[start:end],
            None if momentum is None else momentum[start:end],
            lr=self.algorithm.outer_lr,
            momentum_coef=self.algorithm.outer_momentum,
            nesterov=self.algorithm.nesterov,
        )
        return new_p, new_m, shard_hash(board["round"], index, start, new_p, new_m)

    def _post(self, round: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {"run_id": self.run_id, "peer_id": self.identity.peer_id, **body}
        signed = self.identity.sign_request(body, round, purpose=shard_purpose(round, action))
        url = f"{self.coordinator}/v1/shards/{round}/{action}"
        resp = _request(self.http, "POST", url, self.deadline_s, json=signed)
        if resp.status_code == 409:  # the board moved on (a turn passed, a fraud proven)
            return {"error": resp.json().get("error", "409")}
        if resp.status_code != 200:
            raise RuntimeError(f"shard {action} refused: {resp.status_code} {resp.text}")
        return resp.json()

    def work(self, round: int, start_state: TrainState) -> list[str]:
        """One pass over the board: publish each shard that is this key's turn, check each
        published shard this key was drawn to check. The board is read again after every
        post (a proven fraud moves turns and checkers); a 409 means it moved on under us,
        and the shard is left to the next pass. What it did, as log lines."""
        me, done = self.identity.peer_id, []
        board = self.board(round)
        for i in range(len(board["shards"])):
            shard = board["shards"][i]
            if shard["aggregator"] == me and shard["published"] is None:
                action = "publish"
            elif shard["checker"] == me and shard["published"] and not shard["agreed"]:
                action = "check"
            else:
                continue
            p, m, h = self.compute(board, i, start_state)
            cid = self.store.put(shard_to_bytes(p, m))  # checker: a second source if agreed
            # signed with the hash: what it was computed from, so the hash can be judged
            # only against that (covey.trust.shard_evidence)
            body = {"index": i, "hash": h, "cid": cid, "url": self.blob_url,
                    "board": computed_from(board, i), "reads": self.last_reads}  # fmt: skip
            answer = self._post(round, action, body)
            done.append(f"{action} shard {i}: {answer.get('outcome', answer.get('error'))}")
            board = self.board(round)
        return done

    def ready(self) -> None:
        """Tell the coordinator this key aggregates (`POST /v1/shards/ready`, signed): only
        keys that did so lately are drawn. RuntimeError when refused."""
        body = {"run_id": self.run_id, "peer_id": self.identity.peer_id}
        path = "/v1/shards/ready"
        signed = self.identity.sign_request(body, -1, purpose=request_purpose(path))
        resp = _request(
            self.http, "POST", f"{self.coordinator}{path}", self.deadline_s, json=signed
        )
        if resp.status_code != 200:
            raise RuntimeError(f"shard readiness refused: {resp.status_code} {resp.text[:200]}")
        self._ready_at = time.monotonic()

    def poll(self, template: TrainState) -> list[str]:
        """One look at the sharded round now waiting on its aggregators (`GET
        /v1/shards`): nothing when there is none or it is certified; else `work` on it,
        from its start state (fetched from the coordinator once per round, checked
        against the board's start hash)."""
        if time.monotonic() - self._ready_at > READY_EVERY_S:
            self.ready()
        resp = _request(self.http, "GET", f"{self.coordinator}/v1/shards", self.deadline_s)
        if resp.status_code == 404:
            return []
        if resp.status_code != 200:
            raise RuntimeError(f"pending shard board: {resp.status_code} {resp.text[:200]}")
        board = resp.json()
        if board.get("certificate") is not None:
            return []
        cid = board["inputs"]["start_cid"]
        if self._start is None or self._start[0] != cid:
            url = f"{self.coordinator}/v1/blobs/{cid}"
            got = _request(self.http, "GET", url, self.deadline_s)
            if got.status_code != 200 or content_id(got.content) != cid:
                raise RuntimeError(f"start state {cid[:12]}: {got.status_code}")
            state = state_from_bytes(got.content, template)
            if state.digest() != board["start_hash"]:
                raise RuntimeError(f"start state {cid[:12]} is not the board's start hash")
            self._start = (cid, state)
        return self.work(board["round"], self._start[1])


def check_certificate(certificate: dict[str, Any], coordinator_key: str) -> None:
    """ValueError unless the shard certificate carries the coordinator's signature."""
    signature = certificate.get("signature", "")
    if not verify(coordinator_key, certificate_message(certificate), signature):
        raise ValueError(f"shard certificate of round {certificate.get('round')} is not signed")


def certified_shard(
    certificate: dict[str, Any], index: int, data: bytes, with_momentum: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shard `index` in blob `data`, if its hash is the certified one; ValueError
    (naming both hashes) otherwise: a peer never takes an uncertified shard."""
    bounds = certificate["bounds"]
    start, end = bounds[index], bounds[index + 1]
    params, momentum = shard_from_bytes(data, end - start, with_momentum)
    got = shard_hash(certificate["round"], index, start, params, momentum)
    want = certificate["shards"][index]["hash"]
    if got != want:
        raise ValueError(f"shard {index} hashes to {got[:16]}, certified {want[:16]}: refused")
    return params, momentum


def fetch_certified_state(
    http: httpx.Client,
    certificate: dict[str, Any],
    coordinator_key: str,
    start_state: TrainState,
    names: list[str],
    with_momentum: bool,
    providers: Callable[[int], list[str]] | None = None,
) -> tuple[TrainState, list[str]]:
    """The round's new state, shard by shard from the shards' providers (the certificate's,
    or `providers(index)`), each checked with `certified_shard`: (state, refusals).
    ValueError for a certificate not signed by `coordinator_key` or of another start
    state; ShardFetchError when no provider of a shard delivers its certified bytes."""
    check_certificate(certificate, coordinator_key)
    if certificate["start_hash"] != start_state.digest():
        raise ValueError("the shard certificate starts from another state than ours")
    params, momenta, refusals = [], [], []
    for shard in certificate["shards"]:
        i = shard["index"]
        urls = providers(i) if providers is not None else shard["providers"]
        for url in urls:
            try:
                resp = http.get(f"{url.rstrip('/')}/v1/blobs/{shard['cid']}")
                if resp.status_code != 200:
                    raise ValueError(f"{url}: {resp.status_code}")
                p, m = certified_shard(certificate, i, resp.content, with_momentum)
            except (ValueError, httpx.HTTPError) as e:
                refusals.append(f"shard {i} from {url}: {e}")
                continue
            params.append(p)
            momenta.append(m)
            break
        else:
            raise ShardFetchError(f"shard {i}: no provider delivered it ({refusals[-3:]})")
    momentum = torch.cat(momenta) if with_momentum else None  # type: ignore[arg-type]
    return state_from_flat(start_state, names, torch.cat(params), momentum), refusals


def fetch_round_shards(
    board: dict[str, Any] | None,
    new_hash: str,
    coordinator_url: str,
    coordinator_key: str,
    start_state: TrainState,
    names: list[str],
    with_momentum: bool,
) -> TrainState | None:
    """A worker's new state of a sharded round: shard by shard from the providers of
    `board`'s signed certificate (the coordinator last), each shard checked against its
    hash, the whole against the round certificate's `new_hash`. None when the round was
    not sharded (no board, or a certificate of another state); ValueError or
    ShardFetchError when a certified state cannot be had (then take the canonical one)."""
    cert = (board or {}).get("certificate")
    if not cert or cert.get("new_hash") != new_hash:
        return None
    last = coordinator_url.rstrip("/")

    def providers(i: int) -> list[str]:
        return [p for p in cert["shards"][i]["providers"] if p and p != last] + [last]

    with httpx.Client(timeout=60.0, trust_env=False) as http:
        state, refusals = fetch_certified_state(
            http, cert, coordinator_key, start_state, names, with_momentum, providers
        )
    for r in refusals:
        log.warning("refused: %s", r)
    if state.digest() != new_hash:
        raise ValueError(f"assembled shards hash to {state.digest()[:12]}, not {new_hash[:12]}")
    return state
