"""The round result on the training device: the accepted payloads decoded, aggregated and
DiLoCo's outer step taken where the worker trains, bit for bit what the host computes.

Why it can move: every part is element-wise (docs/device-paths.md, "The round result").
Decoding widens stored values (fp16, bf16, int8/int4 times a block scale, a DCT basis
row times a coefficient) with single IEEE float32 operations; the aggregation rules
(covey.algorithms.aggregation) are built from element-wise minimum, maximum, where, a
multiply and an add as separate kernels, in an order the code fixes, never a reduction or
a sort whose order depends on the device; the outer step (`optim.nesterov_sgd`) is a
multiply and an add or subtract per term, separate kernels, so no fused multiply-add.
IEEE 754 rounds each such operation alike on any device, so the result's bits are the
host's (tests/test_device_round.py compares them, payload by payload and codec by codec).

What crosses: the payloads' wire bytes go host -> device (page-locked staging on CUDA);
the new parameters and outer momentum, which are the state's hash inputs, come back
device -> host once, into page-locked memory (`HostCopies`), where the digest and the
served state file are made. A few scalars are read on the host on the way (each payload's
validity check, the clip's norms, a finiteness check per parameter). The start weights and
momentum go host -> device one parameter at a time as the step reaches them.

Device memory while it runs: the N decoded contributions for the per-coordinate rules
(trimmed mean, median: 4 N bytes per coordinate), one for the mean, plus one parameter's
start, momentum and results at a time. When that does not fit in what the device has
free, the round computes on the host as before (`fits`): the same bits either way.
"""

from __future__ import annotations

import os

import torch

#: "1": compute the round result on the training device even when that is the CPU (tests,
#: `covey bench hostsync`); "0": always on the host. Unset: on the device when it is not
#: the CPU. The bits are the same either way, so this changes no run's outcome.
ROUND_ON_DEVICE_ENV = "COVEY_ROUND_ON_DEVICE"


def choose_round_device(
    model_device: torch.device, forced: torch.device | bool | None = None
) -> torch.device | None:
    """Where a round result computes: a device, or None for where the canonical state
    lives (the host path). `forced`: a device, True (the model's device), False (the
    host); None reads ROUND_ON_DEVICE_ENV, else the model's device unless that is the CPU
    or the meta device (which has no values). ValueError for another value of the env."""
    if isinstance(forced, torch.device):
        return forced
    if forced is None:
        env = os.environ.get(ROUND_ON_DEVICE_ENV, "")
        if env not in ("", "0", "1"):
            raise ValueError(f"{ROUND_ON_DEVICE_ENV} is {env!r}; use 1 (device), 0 (host)")
        forced = {"": None, "0": False, "1": True}[env]
    if forced is None:
        forced = model_device.type not in ("cpu", "meta")
    return model_device if forced else None


def fits(device: torch.device, numel: int, contributions: int) -> bool:
    """Whether a round result over `numel` coordinates and `contributions` payloads fits
    in what `device` has free (CUDA; any other device: assumed to), with a quarter spare:
    the decoded contributions and three parameter-sized temporaries, all float32."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 4 * numel * (contributions + 3) * 5 // 4 <= free


def to_round_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A tensor of the start state on the round's device (asynchronously when it is in
    page-locked host memory)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned())


class HostCopies:
    """The new state's tensors brought back to the host: each copy is queued into a fresh
    page-locked buffer (CUDA) and `done()` waits for all of them once; elsewhere each
    copy is a plain one. These are the only full tensors the device path moves to the host
    (tests/test_device_round.py counts the bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def __call__(self, t: torch.Tensor, home: torch.device) -> torch.Tensor:
        if t.device == home:
            return t
        if home.type != "cpu":
            return t.to(home)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        out.copy_(t, non_blocking=self.cuda)
        return out

    def done(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
