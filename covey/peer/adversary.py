"""Misbehaving workers, for tests and demos (`covey worker --behavior ...`).

Each behavior is one way a participant can lie; covey must reject it at intake, or detect
it by re-execution and slash it (../shared/DESIGN.md, "Trust"):

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
"""

from __future__ import annotations

from typing import Any

import torch

from covey.algorithms.codecs import HEADER_BYTES, Codec

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
)
# behaviors that alter what honest training produced, after the fact
PAYLOAD_CHEATS = ("noise", "sign-flip", "scaled", "free-rider", "nan")


def steps_taken(behavior: str, assigned: int) -> int:
    """How many inner steps the worker really takes (it claims `assigned`)."""
    if behavior == "free-rider":
        return 0
    if behavior == "lazy":
        return max(1, assigned // 2)
    return assigned


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
