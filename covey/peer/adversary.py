"""How a misbehaving worker lies, for tests and demos (`covey worker --behavior ...`): the
behaviors, their schedules, and the forgeries they send. covey.peer.cheater.CheatingWorker
plays them; the honest worker imports none of this.

Each behavior is one way a participant can lie; covey must reject it at intake, or detect
it by re-execution and slash it:

    honest       does the work it claims
    noise        trains, then sends random noise of the same norm
    sign-flip    trains, then sends the negated update
    scaled       trains, then sends the update x100
    free-rider   trains nothing, sends zeros and made-up commitments
    stale        from its second round on, resends its previous contribution's bytes
    replay       from its second round on, resends an old signed request verbatim
    copycat      submits another peer's contribution from the last certificate as its own
    wrong-data   trains on data other than its assignment
    lazy         takes half the assigned steps, claims all of them
    nan          sends an update full of NaN
    forged-state from its second round on, trains from a local state of its own making
                 (its committed end state, moments and residuals x1.5) but names the
                 committed one (caught by re-execution, commitment 0)
    unchained    from its second round on, trains from that forged state and names it
                 (refused at intake, the state is not its previous round's end state)
    withhold     trains honestly and names its end local state, but never serves it
                 (refused as withheld whenever drawn for verification, which costs it
                 reputation, so it is drawn ever after)

Cheaters that pick their moment (`Schedule`, what a careful attacker does once it knows
that new peers are always checked and old ones only sampled):

    late:<kind>:R            honest in rounds 0..R-1 of the run, <kind> from round R on
    intermittent:<kind>:p    <kind> in a fraction p of rounds, honest in the others; which
                             rounds is a hash of (peer id, round), so reproducible

<kind> is one of `SCHEDULED_KINDS`: cheats whose rounds are independent of each other
(stale, replay and copycat reuse earlier rounds; the state cheats break a chain for good).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from covey.algorithms.codec_base import HEADER_BYTES, Codec

BEHAVIORS = (
    "honest",
    "noise",
    "sign-flip",
    "scaled",
    "free-rider",
    "stale",
    "replay",
    "copycat",
    "wrong-data",
    "lazy",
    "nan",
    "forged-state",
    "unchained",
    "withhold",
)
# behaviors that start a round from a local state not chained to their previous round
STATE_CHEATS = ("forged-state", "unchained")
# behaviors that alter what honest training produced, after the fact
PAYLOAD_CHEATS = ("noise", "sign-flip", "scaled", "free-rider", "nan")
# what a late or intermittent cheater may do in its cheating rounds
SCHEDULED_KINDS = ("noise", "sign-flip", "scaled", "free-rider", "nan", "wrong-data", "lazy")


@dataclass(frozen=True)
class Schedule:
    """When a scheduled cheater cheats: `kind` from run round `start` on, in a fraction
    `rate` of those rounds (1.0: every one)."""

    kind: str
    start: int = 0
    rate: float = 1.0

    def cheats(self, round: int, peer_id: str) -> bool:
        """Whether this peer cheats in `round`: a pure function of (schedule, peer, round)."""
        if round < self.start:
            return False
        if self.rate >= 1.0:
            return True
        h = hashlib.sha256(f"covey-intermittent/{peer_id}/{round}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < self.rate


def parse_behavior(spec: str) -> Schedule | None:
    """The schedule of a `late:` or `intermittent:` spec; None for a plain behavior in
    BEHAVIORS. ValueError naming the spec and what is wrong otherwise."""
    if spec in BEHAVIORS:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in ("late", "intermittent"):
        raise ValueError(
            f"unknown behavior {spec!r}; one of {', '.join(BEHAVIORS)}, "
            f"late:<kind>:<round> or intermittent:<kind>:<fraction>"
        )
    mode, kind, arg = parts
    if kind not in SCHEDULED_KINDS:
        raise ValueError(f"{spec!r}: <kind> must be one of {', '.join(SCHEDULED_KINDS)}")
    try:
        value = int(arg) if mode == "late" else float(arg)
    except ValueError:
        want = "a round number" if mode == "late" else "a fraction"
        raise ValueError(f"{spec!r}: {arg!r} is not {want}") from None
    if mode == "late":
        if value < 0:
            raise ValueError(f"{spec!r}: the first cheating round must be >= 0, got {value}")
        return Schedule(kind, start=int(value))
    if not 0 < value <= 1:
        raise ValueError(f"{spec!r}: the fraction of rounds must be in (0, 1], got {value}")
    return Schedule(kind, rate=value)


def check_behavior(spec: str) -> None:
    """ValueError unless `spec` is a behavior or a valid late/intermittent schedule."""
    parse_behavior(spec)


def behavior_at(spec: str, round: int, peer_id: str) -> str:
    """What a worker started with `--behavior spec` does in `round`: a plain behavior is
    itself every round; a schedule is its kind in its cheating rounds, else "honest"."""
    schedule = parse_behavior(spec)
    if schedule is None:
        return spec
    return schedule.kind if schedule.cheats(round, peer_id) else "honest"


def steps_taken(behavior: str, assigned: int) -> int:
    """How many inner steps the worker really takes (it claims `assigned`)."""
    if behavior == "free-rider":
        return 0
    if behavior == "lazy":
        return max(1, assigned // 2)
    return assigned


def forge_local_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A made-up local state: every floating tensor but the parameters x1.5 (moments,
    error-feedback residuals, DeMo's momentum), the parameters moved by 1%."""
    return {
        k: (v * 1.01 if k.startswith("param/") else v * 1.5) if v.is_floating_point() else v
        for k, v in state.items()
    }


def data_key(behavior: str, assigned_key: str) -> str:
    return assigned_key[::-1] if behavior == "wrong-data" else assigned_key


def forge_payload(behavior: str, payload: bytes, codec: Codec, numel: int, seed: int) -> bytes:
    """The payload a payload cheat sends instead of the honest one."""
    honest = codec.decode(payload, numel)
    if behavior == "noise":
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(numel, generator=g)
        return codec.encode(noise * (honest.norm() / noise.norm().clamp_min(1e-12)))
    if behavior == "sign-flip":
        return codec.encode(-honest)
    if behavior == "scaled":
        return codec.encode(honest * 100)
    if behavior == "free-rider":
        return codec.encode(torch.zeros(numel))
    if behavior == "nan":
        # a codec refuses to encode NaN, so forge the bytes: a valid header and parameters,
        # then every body byte 0xff, which reads as NaN in each float format (fp32, fp16,
        # bf16 values and quantization scales)
        zeros = codec.encode(torch.zeros(numel))
        head = HEADER_BYTES + codec.params_struct.size
        return zeros[:head] + b"\xff" * (len(zeros) - head)
    raise ValueError(f"{behavior} does not forge payloads")


def pad_commitments(done: list[dict[str, Any]], claimed_steps: list[int]) -> list[dict[str, Any]]:
    """Commitments for steps never taken, made up by repeating the last real one (what a
    lazy worker or a free-rider must send to claim the whole assignment)."""
    out = [c for c in done if c["step"] in claimed_steps]
    last = out[-1] if out else done[0]
    for step in claimed_steps[len(out) :]:
        out.append({**last, "step": step})
    return out
