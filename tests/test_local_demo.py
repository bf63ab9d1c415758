"""`covey demo` for real: a coordinator and workers as processes on 127.0.0.1, stopped with
real signals; chaos kills workers with SIGKILL and training must go on."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from covey.config import load_run_config, to_toml
from covey.io import audit
from covey.local.demo import HOUSE, METHODS, UNCHECKED, demo_spec, run_local_demo
from covey.local.demo_house import house_slots

pytestmark = [pytest.mark.network, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_demo_spec_loads_as_a_run_config(tmp_path: Path) -> None:
    for method in METHODS:
        path = tmp_path / f"{method}.toml"
        path.write_text(to_toml(demo_spec(method)))
        cfg = load_run_config(path)
        assert cfg.algorithm.method == method
        assert cfg.rounds.max_rounds is None  # bounded by time
        assert cfg.data.batch_size == 8
    with pytest.raises(ValueError, match="not one of"):
        demo_spec("allreduce")


@pytest.mark.parametrize(
    ("workers", "adversaries", "min_peers"), [(4, 0, 1), (4, 1, 3), (4, 2, 2), (6, 2, 3), (2, 2, 1)]
)
def test_a_demo_with_cheaters_waits_for_several_workers_but_not_for_more_than_the_honest(
    workers: int, adversaries: int, min_peers: int
) -> None:
    spec = demo_spec("diloco", workers=workers, adversaries=adversaries)
    assert spec["rounds"]["min_peers"] == min_peers


@pytest.mark.parametrize(("workers", "adversaries", "min_peers"), [(4, 1, 2), (6, 2, 3), (3, 1, 1)])
def test_a_demo_with_cheaters_does_not_wait_for_its_house_worker(
    workers: int, adversaries: int, min_peers: int
) -> None:
    # a house worker leaves at each reveal of its canary: a round never waits for it
    spec = demo_spec("diloco", workers=workers, adversaries=adversaries, house_workers=1)
    assert spec["rounds"]["min_peers"] == min_peers
    big = demo_spec("diloco", workers=workers, adversaries=adversaries, house_workers=1,
                    inner_steps=4)  # fmt: skip
    assert big["rounds"]["min_peers"] == workers - adversaries - 1


@pytest.mark.parametrize(
    ("workers", "adversaries", "validators", "asked", "slots"),
    [(4, 0, 1, 1, 1), (4, 1, 1, 1, 1), (2, 0, 1, 1, 1), (1, 0, 1, 1, 0), (2, 1, 1, 1, 0),
     (4, 0, 0, 1, 0), (4, 0, 1, 0, 0), (4, 0, 1, 9, 3)],
)  # fmt: skip
def test_house_workers_take_honest_places_but_never_the_last_or_unchecked(
    workers: int, adversaries: int, validators: int, asked: int, slots: int
) -> None:
    assert house_slots(workers, adversaries, validators, asked) == slots


def _children_running_covey() -> list[str]:
    """Command lines of this process's children that still run `covey`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and "covey" in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def _assert_all_stopped(summary: dict[str, Any]) -> None:
    for name, proc in summary["processes"].items():
        assert proc["exit_code"] is not None, f"{name} (pid {proc['pid']}) was never reaped"
    assert _children_running_covey() == []


def test_demo_trains_and_leaves_a_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # w1 is the house worker; every round is a canary round of its key, so the first one it
    # contributes (a new key's: always checked) is a canary the validator must catch
    canary_rate = {"trust": {"canary_rate": 1.0}}
    s = run_local_demo(
        workers=2, minutes=0.35, out_dir=tmp_path, progress=False, overrides=canary_rate
    )
    out = capsys.readouterr().out
    assert out.count(f"w1 is the run owner's house worker: {HOUSE}") == 1
    assert UNCHECKED not in out  # its validator meets canaries

    # every canary drawn is in the ledger ("house canary"), still out, or never drawn for a
    # check (kept secret: not revealed, its key kept); the validator caught those it was
    # given (the referee convicted its disputes), which are no honest disputes
    trust = s["trust"]
    c = trust["canaries"]
    entries, _, _ = audit.load(tmp_path / "coordinator")
    revealed = [e.payload for e in entries if e.type == "house canary"]
    unsampled = c["unchecked"] - sum(p["outcome"] == "unchecked" for p in revealed)
    assert c["drawn"] == len(revealed) + c["pending"] + unsampled and c["drawn"] >= 1, c
    db = sqlite3.connect(tmp_path / "coordinator" / "coordinator.db")
    rows = db.execute("SELECT round, peer_id FROM house_canaries WHERE status = 'unsampled'")
    secret = set(rows.fetchall())
    db.close()
    assert len(secret) == unsampled  # never drawn for a check: no reveal, so no key burned
    assert not secret & {(p["round"], p["peer_id"]) for p in revealed}
    assert c["caught"] == sum(p["outcome"] == "caught" for p in revealed) >= 1, revealed
    assert c["passed"] == 0, revealed  # the validator is honest: it agrees with no canary
    assert trust["disputes"] == 0 and trust["banned"] == [], trust
    assert s["house_workers"][0] == "w1" and set(s["house_workers"]) <= set(s["processes"])
    assert re.search(rf"canaries +{c['drawn']} drawn .* {c['caught']} caught by a valid", out)

    assert s["rounds_committed"] >= 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == s["rounds_committed"]
    assert [r["round"] for r in records] == list(range(s["rounds_committed"]))
    losses = [r["val_loss"] for r in records if r["val_loss"] is not None]
    assert losses[-1] < losses[0], losses
    assert (s["first_val_loss"], s["last_val_loss"]) == (losses[0], losses[-1])
    assert s["bytes_total"] == sum(r["bytes"] for r in records) > 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC
    # the decentralization multiplier: workers' compute is useful, the rest is booked
    costs = s["decentralization"]
    assert costs["useful_s"] > 0 and costs["multiplier"] >= 1.0
    assert costs["multiplier"] == pytest.approx(1 + sum(v or 0 for v in costs["adds"].values()))

    db = tmp_path / "coordinator" / "coordinator.db"
    with sqlite3.connect(db) as con:
        (committed,) = con.execute(
            "SELECT COUNT(*) FROM rounds WHERE status = 'committed'"
        ).fetchone()
    assert committed == s["rounds_committed"]
    if s["rounds_committed"] >= 5:
        assert list((tmp_path / "coordinator" / "checkpoints").glob("round-*.safetensors"))
        assert s["paths"]["checkpoints"]
    # w1's key is banned at its canary's reveal: the next house key joins as w2, w3, ...
    assert {"w0", "w1"} <= set(s["peers_seen"]) <= {"w0", *s["house_workers"]}
    assert json.loads((tmp_path / "summary.json").read_text())["run_id"] == s["run_id"]

    _assert_all_stopped(s)
    # SIGTERM'd workers leave cleanly: status 0, and the coordinator recorded the deathrattle;
    # a house worker leaves with status 1 once its key is banned, the last one on SIGTERM
    *burned, last = s["house_workers"]
    assert [s["processes"][name]["exit_code"] for name in burned] == [1] * len(burned)
    assert s["processes"]["w0"]["exit_code"] == 0
    # 0 on SIGTERM, 1 if banned in the last second; a replacement that had not joined yet
    # (still importing torch when the demo stopped) dies of the SIGTERM itself
    allowed = (0, 1) if last in s["peers_seen"] else (0, 1, -signal.SIGTERM)
    assert s["processes"][last]["exit_code"] in allowed, (last, s["peers_seen"])
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    joined = s["processes"][last]["exit_code"] == 0 and last in s["peers_seen"]
    for name in ("w0", last)[: 1 + joined]:
        assert re.search(rf"\[{name} [0-9a-f]{{8}}\] left: shutdown", log), name


@pytest.mark.long  # over a minute: `scripts/dev.py test --all`
def test_chaos_kills_workers_and_training_goes_on(tmp_path: Path) -> None:
    # first kill 6-8 s after the start (or after the first commit, if later); 36 s in all
    s = run_local_demo(
        workers=2,
        minutes=0.6,
        out_dir=tmp_path,
        chaos=True,
        chaos_every_s=(6.0, 8.0),
        progress=False,
    )

    assert s["kills"] > 0
    assert s["rounds_after_first_kill"] > 0, s["kill_events"]
    for k in s["kill_events"]:
        assert s["processes"][k["killed"]]["exit_code"] == -9  # SIGKILL, no deathrattle
        assert k["replacement"] in s["processes"]
    # replacements join the run (one started in the last seconds may not have yet)
    assert {k["replacement"] for k in s["kill_events"]} & set(s["peers_seen"])
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == s["rounds_committed"]
    _assert_all_stopped(s)
