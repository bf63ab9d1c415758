"""The seam between algorithms and everything that moves bytes.

A strategy runs on one worker and exposes three operations that both the simulator and
the real peers drive, identically:

    inner_step(batch) -> loss                  local training on this worker's data
    make_contribution() -> Contribution        what this worker sends (bytes + metadata)
    apply_round(start_state, contributions)    PURE: the new canonical TrainState

`apply_round` depends only on its arguments (never on the worker's local model), so every
peer that receives the same accepted set computes bit-identical weights, and a verifier can
recompute it. Two more calls move canonical state into the worker: `load_state` (a full
reset: at start or when joining) and `adopt` (after each round; Streaming DiLoCo merges
one fragment here instead of copying everything).

For verification (covey/trust/verify.py) a strategy also exposes its worker-local state:
`local_state()` is everything the next inner steps depend on besides the round's canonical
start (parameters, inner optimizer moments, error-feedback residuals, DeMo's momentum), and
`load_local_state` puts it back so that training continues bit for bit.

The local-state chain. Every round starts with `begin_round(start_state, previous_end,
accepted)`, a pure function of committed inputs: the canonical start W_r, the local state
this worker had at the end of its previous round (`local_state()` right after
`make_contribution`, committed by content id in that round's signed contribution), and
whether the certificate accepted that contribution. With no previous end (a fresh peer, or
one that missed round r-1) it is the algorithm's deterministic init: W_r and zero
moments/residuals. `adopt(state, accepted)` is the same transition applied live. State that
only a certificate may advance (the error-feedback residual, what DeMo subtracts from its
momentum) waits in the end state as "pending" and moves on only when `accepted`: a rejected
contribution's residual is restored. Every strategy whose `carries_local_state` is False
(DDP, DiLoCo with inner_state "reset" and no error feedback) starts every round fresh,
so its round is a function of (W_r, batches) alone. With the chain, every strategy is
`reexecutable`: a validator re-runs `begin_round` from the committed end state and trains.

What the chain binds (the worker chooses its own local state; these are its limits):
- exactly, by content id at intake: the start state a contribution names is the end state
  the same peer's recorded contribution to round r-1 (the certified attempt) named, or
  none (fresh) when it has no such contribution; the end state is a blob of a local
  state's exact size, named in the signed contribution;
- exactly, by re-execution: commitment 0 is the hash of `begin_round(W_r, that end state,
  the certificate's accept flag)`; the flag comes from the signed certificate, never from
  the worker; a start that is not the committed one disagrees at segment 0;
- within the tolerance, by re-execution: the published end state against the validator's
  (a disagreement in the last segment), as every later commitment and the payload are.
Not bound: an end state is checked only when its own round is sampled. A worker that
forges its end state (a residual, moments, Streaming's local weights) in an unsampled round
starts its next round from the forgery legitimately; the forgery is fraud in the round
that produced it and is caught at that round's sampling rate, as a forged payload is, and
what it can do meanwhile passes through this worker's contributions only (robust
aggregation bounds those). Nor are deviations below the tolerance (honest rounding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from covey.algorithms.aggregation import Aggregator, WeightedMean
from covey.algorithms.codec_base import Codec, CodecError
from covey.algorithms.device_round import choose_round_device, fits
from covey.algorithms.lazy_aggregation import aggregate_lazily, drop_mapped_pages
from covey.algorithms.state import Contribution, RoundError, TrainState
from covey.algorithms.tensors import (
    is_broadcast,
    param_dict,
    same_bits,
    unflatten,
)
from covey.devices import autocast, maybe_compile

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Strategy(ABC):
    """Base for every algorithm. One instance per worker; see the module docstring."""

    #: inner steps between two contributions
    steps_per_round: int = 1
    #: whether a slow worker may take fewer inner steps in a round (weighted by tokens)
    flexible_steps: bool = False
    #: inner steps of the next round that run while this round's bytes are in flight
    overlap_steps: int = 0
    #: whether `apply_round` can compute on the training device (the DiLoCo family's
    #: outer step; covey.algorithms.device_round); others compute where the state lives
    device_round: bool = False
    #: where the round result computes: None chooses (`round_device`); a device, True or
    #: False forces it (covey.algorithms.device_round.choose_round_device)
    round_on: torch.device | bool | None = None
    #: where the last `aggregate` computed (None: where the state lives)
    round_computed_on: torch.device | None = None

    @property
    def round_device(self) -> torch.device | None:
        """The device `apply_round` decodes, aggregates and steps on, or None: where the
        canonical state lives (the host for networked peers). The bits are the same."""
        if not self.device_round:
            return None
        return choose_round_device(self.device, self.round_on)

    @property
    def reexecutable(self) -> bool:
        """Whether a round's contribution is a pure function of (the round's start state,
        the worker's committed previous end state, the certificate's accept flag, its
        batches): then a validator holding them can recompute it (see `begin_round`)."""
        return False

    @property
    def carries_local_state(self) -> bool:
        """Whether a round's start depends on the worker's previous round (moments kept,
        residuals, merged weights): then contributions commit their end local state and the
        next round's start is derived from it. False: every round starts fresh."""
        return False

    @property
    def local_params_carried(self) -> bool:
        """Whether the parameters of a local state matter to the next round: False when
        `adopt` loads the round's canonical start over them (DiLoCo, DeMo), so only the
        strategy's own tensors (moments, residuals) are private state a validator cannot
        recompute; True when the worker's own weights carry on (Streaming DiLoCo)."""
        return True

    def carries_entry(self, name: str) -> bool:
        """Whether local-state entry `name` matters to the next round (what a worker
        publishes for verification): the parameters only when `local_params_carried`, the
        strategy's own tensors unless the next `begin_round` resets them."""
        return self.local_params_carried or not name.startswith("param/")

    def names_local(self) -> list[str]:
        """The names of `local_state()`'s entries (`local_state_layout()`'s keys)."""
        return list(self.local_state_layout())

    def evidence_layout(self) -> dict[str, torch.Tensor]:
        """`local_state_layout()` as it is published for verification: the entries the
        next round depends on alone (`carries_entry`)."""
        return {k: v for k, v in self.local_state_layout().items() if self.carries_entry(k)}

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, codec: Codec, aggregator: Aggregator | None = None
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.codec = codec
        self.aggregator = aggregator or WeightedMean()
        self.names = [n for n, _ in model.named_parameters()]
        self.tokens = 0  # since the last contribution
        self.steps = 0
        self.precision = "fp32"  # of the forward pass: "bf16" autocasts it (set_compute)
        self._forward = loss_fn  # loss_fn, or its torch.compile'd version
        # what the loss is computed through: the model, or a DistributedDataParallel wrapper
        # of it when the peer is a torchrun group (covey/peer/group.py); names stay the model's
        self.forward_module: nn.Module = model

    @property
    def device(self) -> torch.device:
        """Where this worker computes: its model's device (covey/devices.py). Batches,
        optimizer state and residuals live there; the canonical TrainState lives where the
        caller keeps it (the host for networked peers, whose weights hash must match the
        coordinator's), and `apply_round` computes where that state is."""
        return next(self.model.parameters()).device

    def set_compute(self, precision: str = "fp32", compile: bool = False) -> None:
        """The inner step's precision ("fp32", or "bf16": autocast of the forward pass, fp32
        weights, gradients and optimizer state) and whether its forward pass is
        torch.compile'd. Call it before training; contributions of a run that is verified
        by re-execution must all use the run's precision."""
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r} is not one of fp32, bf16")
        self.precision = precision
        self._forward = maybe_compile(self.loss_fn, compile)

    # -- worker side ----------------------------------------------------------------------

    def init_state(self) -> TrainState:
        """The canonical state at round 0, from the model's current (seeded) parameters."""
        return TrainState(param_dict(self.model))

    def load_state(self, state: TrainState) -> None:
        """Full reset of the worker's model to the canonical state."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state.params[name])
        self.tokens = self.steps = 0

    def adopt(self, state: TrainState, accepted: bool = True) -> None:
        """Take the new canonical state after a round (default: full copy). `accepted`:
        whether this worker's contribution to that round was certified; the pending part of
        its local state advances only then (see the module docstring)."""
        self.load_state(state)

    def reset_local(self) -> None:
        """The algorithm's deterministic init of the strategy's own local tensors (fresh
        optimizer, zero residual/momentum); the parameters are not touched."""
        return None

    def begin_round(
        self,
        start_state: TrainState,
        previous_end: dict[str, torch.Tensor] | None = None,
        accepted: bool = True,
    ) -> None:
        """Put the worker at the start of a round, as a pure function of committed inputs:
        `start_state` (W_r), the local state at the end of this worker's previous round
        (None: fresh start) and whether that round accepted its contribution.

        ValueError (from `load_local_state`) for a previous_end of the wrong names, shapes,
        dtypes or with NaN/Inf; the strategy is then at the fresh start."""
        self.load_state(start_state)
        self.reset_local()
        if previous_end is None or not self.carries_local_state:
            return
        if any(not self.carries_entry(k) and k not in previous_end for k in self.names_local()):
            # published without what the next round does not depend on (`evidence_layout`:
            # the parameters `adopt` loads W_r over, moments that are reset): the round's
            # start and the fresh state stand in for those entries, and only for those (a
            # missing entry it carries is refused below)
            fresh = self.local_state(copy=False)
            previous_end = {
                **{k: v for k, v in fresh.items() if not self.carries_entry(k)},
                **previous_end,
            }
        self.load_local_state(previous_end)
        self.adopt(start_state, accepted)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Loss (detached, where the model computes: never read on the host here) and
        gradients on one batch; counts the batch's tokens."""
        if not self.model.training:  # covey switches the whole model (evaluate.py)
            self.model.train()
        for p in self.model.parameters():
            p.grad = None
        batch = batch.to(self.device, non_blocking=True)
        with autocast(self.device, self.precision):  # backward outside, as torch advises
            loss = self._forward(self.forward_module, batch)
        loss.backward()
        self.tokens += batch[:, 1:].numel()
        self.steps += 1
        return loss.detach()

    @abstractmethod
    def inner_step(self, batch: torch.Tensor) -> torch.Tensor:
        """One step of local training; the batch's loss as a 0-dim tensor on the model's
        device. An inner step makes no device-to-host synchronization (tests/test_hostsync.py):
        read the loss on the host outside it, once for many steps (`tensors.host_sum`)."""

    # -- worker-local state (verification) -------------------------------------------------

    def local_state(
        self, copy: bool = True, start: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Everything the next inner steps depend on, besides the round's canonical start
        (which `load_state` sets): "param/<name>" for each parameter plus the strategy's own
        tensors (see `_local_extras`). Names and shapes are fixed for a given model and
        config, whatever has happened so far, so any two local states can be compared.

        copy=False returns the live tensors (or zeros standing in for state not created
        yet): read them at once; writing to them writes the strategy's state. A copy holds
        only what training could change: the zeros standing in for state not created
        yet are broadcast views of one zero, never written, so they are not
        copied; and with `start` (the round's start parameters, which nothing changes in
        place), a parameter with exactly the bits of its start entry is that tensor, not
        a copy (at a round's first commitment the whole model is)."""
        out = {f"param/{n}": p.detach() for n, p in self.model.named_parameters()}
        out.update(self._local_extras())
        if not copy:
            return out
        unchanged = {
            f"param/{n}": start[n]
            for n, p in self.model.named_parameters()
            if start is not None and same_bits(p.detach(), start.get(n))
        }
        return {
            k: unchanged[k] if k in unchanged else v if is_broadcast(v) else v.clone()
            for k, v in out.items()
        }

    def end_local_state(self) -> dict[str, torch.Tensor]:
        """`local_state()` at the end of a round whose next step follows a `begin_round`
        (which resets what the strategy holds of its own): the strategy may hand over its
        own tensors instead of copying them and let go of them (`free_round_memory`).
        Default: a copy, then `free_round_memory(optimizer=True)`."""
        state = self.local_state()
        self.free_round_memory(optimizer=True)
        return state

    def free_round_memory(self, optimizer: bool = False, start: bool = False) -> None:
        """Let go of what only this round's inner steps use: the gradients
        (the next inner step makes its own: numerics do not change), and with `optimizer`
        the strategy's own training state (a DiLoCo worker's AdamW moments: two model
        sizes). `optimizer` only when the next inner step follows a `begin_round` or
        `load_state`, which reset that state anyway, and after the round's end local state
        was taken where it is needed (`end_local_state`). `start`: also the reference to
        the round's start weights the strategy keeps (DiLoCo's pseudo-gradient's), which
        keeps them alive once its caller has let them go; only after
        `make_contribution`, and before the next `begin_round` or `load_state`."""
        for p in self.model.parameters():
            p.grad = None
        if optimizer:
            self._free_local_extras()
        if start:
            self._free_round_start()

    def _free_local_extras(self) -> None:
        """Drop the strategy's own training state (see `free_round_memory`); none by default."""
        return None

    def _free_round_start(self) -> None:
        """Drop the round's start weights the strategy keeps (see `free_round_memory`);
        none by default."""
        return None

    def local_state_layout(self) -> dict[str, torch.Tensor]:
        """`local_state()`'s names, shapes and dtypes as tensors on the meta device: a
        template to check a local state against that holds no bytes (the zeros standing in
        for a fresh optimizer's moments are never made: 1 GB at 124M)."""
        meta = {f"param/{n}": p for n, p in self.model.named_parameters()}
        meta.update(self._local_extras(fresh_device="meta"))
        return {k: torch.empty_like(v, device="meta") for k, v in meta.items()}

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a `local_state()` exactly: the next inner steps are then bit-identical to
        those of the strategy it was taken from. Call `load_state(start_state)` first: the
        canonical start is not part of the local state.

        ValueError naming the first missing, unexpected, mis-shaped, mis-typed or
        non-finite entry; nothing changes then."""
        expected = self.local_state_layout()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"local state lacks {missing[0]!r} ({len(missing)} entries missing)")
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise ValueError(f"local state has unexpected entry {unexpected[0]!r}")
        for name in sorted(expected):
            got, want = state[name], expected[name]
            if not isinstance(got, torch.Tensor):
                raise ValueError(f"local state entry {name!r} is a {type(got).__name__}")
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(
                    f"local state entry {name!r} is {tuple(got.shape)} {got.dtype}, "
                    f"expected {tuple(want.shape)} {want.dtype}"
                )
            if got.is_floating_point() and not bool(torch.isfinite(got).all()):
                raise ValueError(f"local state entry {name!r} has NaN or Inf values")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state[f"param/{n}"])
        self._load_local_extras({k: v for k, v in state.items() if not k.startswith("param/")})

    def _local_extras(self, fresh_device: str | None = None) -> dict[str, torch.Tensor]:
        """The strategy's own local tensors (live), named "optim/..."; none by default.
        `fresh_device`: where to make the zeros of state not created yet ("meta": shapes
        only); by default the parameters' device."""
        return {}

    def _load_local_extras(self, extras: dict[str, torch.Tensor]) -> None:
        """Install checked `_local_extras` tensors (copies of them); nothing by default."""
        return None

    def make_contribution(self) -> Contribution:
        """This round's work as a Contribution; resets the token and step counters.

        RuntimeError before any inner_step, raised before any local state changes."""
        if self.steps == 0:
            raise RuntimeError("make_contribution before any inner_step")
        payload, fragment = self.encode_work()
        c = Contribution(payload, self.tokens, self.steps, fragment)
        self.tokens = self.steps = 0
        return c

    @abstractmethod
    def encode_work(self) -> tuple[bytes, int | None]:
        """The codec bytes of the work since the last contribution, and the fragment they
        cover (None: the whole model). Called once per round by make_contribution."""

    # -- canonical side (pure) ------------------------------------------------------------

    def round_fragment(self, round: int) -> int | None:
        """The fragment a round's contributions must cover (None: the whole model)."""
        return None

    def fragment_names(self, fragment: int | None) -> list[str]:
        return list(self.names)

    def validate(self, start_state: TrainState, contribution: Contribution) -> None:
        """Check one contribution against the round it claims to belong to, before anyone
        aggregates it: fragment, claimed work, payload format, element count and finite
        values. RoundError says what is wrong; nothing changes."""
        c = contribution
        want = self.round_fragment(start_state.round)
        if c.fragment != want:
            raise RoundError(f"round {start_state.round} takes fragment {want}, got {c.fragment}")
        if c.tokens <= 0 or c.inner_steps <= 0:
            raise RoundError(f"claims {c.tokens} tokens in {c.inner_steps} inner steps")
        numel = sum(start_state.params[n].numel() for n in self.fragment_names(want))
        try:
            vector = self.codec.decode(c.payload, numel)
        except CodecError as e:
            raise RoundError(f"payload rejected: {e}") from None
        finally:  # a mapped payload's pages are not held once decoded
            drop_mapped_pages(c.payload)
        if not bool(torch.isfinite(vector).all()):
            raise RoundError("payload decodes to NaN or Inf values")

    @abstractmethod
    def apply_round(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState: ...

    def apply_round_consuming(
        self, start_state: TrainState, contributions: Sequence[Contribution]
    ) -> TrainState:
        """`apply_round`, the same new state bit for bit, taking start_state's tensors out
        of it as they are replaced, so that the old and the new state are not both in
        memory: for a caller that drops the start state anyway (a worker whose
        result replaces it). start_state may be left empty, also when this raises after
        aggregating. Default: `apply_round`, start_state untouched."""
        return self.apply_round(start_state, contributions)

    def aggregate(
        self,
        state: TrainState,
        contributions: Sequence[Contribution],
        names: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Decode, validate and aggregate the contributions into one tensor per named
        parameter (default: all of them), on `round_device` when there is one and the round
        fits there, else where the state lives (`round_computed_on` says which); the same
        bits either way. RoundError if any contribution is unusable."""
        names = self.names if names is None else names
        params = [state.params[n] for n in names]
        device = params[0].device if params else None  # aggregate where the state lives
        numel = sum(p.numel() for p in params)
        weights = self.check_tokens(contributions)
        on = self.round_device  # or on the training device: the same bits
        if on is not None and fits(on, numel, len(contributions)):
            device = on
        else:
            on = None
        self.round_computed_on = on

        def load(i: int) -> torch.Tensor:
            try:
                payload, kernels = contributions[i].payload, on is not None
                return self.codec.decode(payload, numel, device=device, device_kernels=kernels)
            except CodecError as e:
                raise RoundError(f"contribution {i}: {e}") from None
            finally:  # a mapped payload's pages are not held once decoded
                drop_mapped_pages(contributions[i].payload)

        # one decoded contribution in memory at a time, the rule's exact bits; on a device
        # the per-coordinate rules keep the N there instead of spilling them to the host
        n = len(contributions)
        flat = aggregate_lazily(self.aggregator, n, load, weights, spill=on is None)
        update = unflatten(flat, params)
        return dict(zip(names, update, strict=True))

    @staticmethod
    def check_tokens(contributions: Sequence[Contribution]) -> list[float]:
        """The contributions' weights (tokens); RoundError for none or a non-positive one."""
        if not contributions:
            raise RoundError("a round needs at least one contribution")
        for i, c in enumerate(contributions):
            if c.tokens <= 0:
                raise RoundError(f"contribution {i} claims {c.tokens} tokens")
        return [float(c.tokens) for c in contributions]

    def decode_all(
        self,
        contributions: Sequence[Contribution],
        numel: int,
        device: torch.device | None = None,
    ) -> tuple[list[torch.Tensor], list[float]]:
        """Decode and validate every payload (onto `device`, default the host); RoundError
        names the first bad one."""
        if not contributions:
            raise RoundError("a round needs at least one contribution")
        vectors, weights = [], []
        for i, c in enumerate(contributions):
            if c.tokens <= 0:
                raise RoundError(f"contribution {i} claims {c.tokens} tokens")
            try:
                vectors.append(self.codec.decode(c.payload, numel, device=device))
            except CodecError as e:
                raise RoundError(f"contribution {i}: {e}") from None
            weights.append(float(c.tokens))
        return vectors, weights
