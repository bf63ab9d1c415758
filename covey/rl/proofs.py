"""TOPLOC-style proofs of inference (after Ong et al., arXiv:2501.16007), covey's own code.

For each chunk of `chunk` (32) generated tokens, the worker commits to the k (128) entries
of largest magnitude among ALL the chunk's last hidden states (the (chunk, D) block
flattened), with their flat indices. Encoding (TOPLOC's polynomial trick): a modulus m is
chosen so the indices are distinct mod m; the polynomial p over GF(65521) of degree < k with
p(index mod m) = fp16 bits of the value is stored as k 16-bit coefficients. A chunk proof is
2 + 2k bytes (258 for k = 128): the indices cost nothing extra, since a verifier only ever
asks "what value did you commit for this index?" by evaluating p there.

The validator recomputes the hidden states with one prefill of prompt + tokens, takes ITS
top-k indices per chunk and evaluates p at them. An index the worker did not commit gives
a pseudo-random 16-bit pattern, which almost never lands near the true value; a committed
one gives the worker's fp16 value. A chunk is accepted when enough of the top-k agree
(`min_overlap`) and the agreeing values differ by few fp16 units in the last place on
average (`max_mean_ulp`). Thresholds come from `python -m covey.rl.calibrate`.

A partial last chunk of n < 32 tokens commits k_n = floor((k + 1) n / 32) - 1 values
(`chunk_k`: 47 for 12 tokens, 3 for 1), so it costs 2 + 2 k_n <= 258 n / 32 bytes and a
proof never exceeds 258 bytes per 32 tokens, whatever the completion length (a full 258 B
for a 12-token answer was 688 B per 32 tokens). The committed density stays ~4 values per
token. Trade-off: a short chunk's verdict rests on fewer values, so it forgives one fp16
ulp in total (`PARTIAL_ULP_SLACK`) and two missed indices (`PARTIAL_MISS_SLACK`, counted
as agreeing in its overlap): one honest rounding flip among 3 values would read as mean
0.33 ulp, above fp32's 0.1, and one honest top-k swap in a bf16 run (measured: 1 of 7
values) as overlap 0.86 < 0.9. A weight cheat moves nearly every value by >= 1 ulp (mean
>= 1.09), so even 3 values sum above the slack; other tokens, prompts or hidden states
agree on almost no index (a pseudo-random 16-bit value lands within 5% of the true one
with p ~ 0.002), so two forgiven misses still leave them far below 0.9. Full chunks are
judged exactly as before. Measured: `covey.bench.rl_verify` (docs/rl.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

PRIME = 65521  # largest prime below 2**16: coefficients fit in 16 bits
CHUNK = 32
TOPK = 128
_FP16_MAX = 65504.0


class ProofError(ValueError):
    """A proof is malformed: wrong length or an impossible header."""


PARTIAL_ULP_SLACK = 1.0  # fp16 ulps a partial chunk's agreeing values may differ for free
PARTIAL_MISS_SLACK = 2  # top-k indices a partial chunk may miss for free (bf16 swaps)


def chunk_k(n_tokens: int, hidden_dim: int, chunk: int = CHUNK, k: int = TOPK) -> int:
    """Values committed for a chunk of `n_tokens` (1..chunk) tokens of hidden size
    `hidden_dim`: k for a full chunk; floor((k + 1) n / chunk) - 1 (at least 1) for a
    partial one, so its 2 + 2 k_n bytes stay within the full chunk's bytes per token;
    never more than the chunk holds. ValueError on n_tokens outside 1..chunk."""
    if not 1 <= n_tokens <= chunk:
        raise ValueError(f"a chunk holds 1..{chunk} tokens, got {n_tokens}")
    k_n = k if n_tokens == chunk else max(1, (k + 1) * n_tokens // chunk - 1)
    return min(k_n, n_tokens * hidden_dim)


def chunk_proof_bytes(n_values: int, k: int = TOPK) -> int:
    """Bytes of one chunk's proof: 2 (modulus) + 2 per committed value."""
    return 2 + 2 * min(k, n_values)


def proof_size(n_tokens: int, hidden_dim: int, chunk: int = CHUNK, k: int = TOPK) -> int:
    """Total bytes of a proof for `n_tokens` generated tokens of hidden size `hidden_dim`:
    at most 258 per 32 tokens (k = 128) for any n_tokens (see `chunk_k`)."""
    full, rest = divmod(n_tokens, chunk)
    size = full * chunk_proof_bytes(chunk * hidden_dim, k)
    return size + (chunk_proof_bytes(chunk_k(rest, hidden_dim, chunk, k)) if rest else 0)


def _fp16_bits(values: torch.Tensor) -> list[int]:
    half = values.detach().float().clamp(-_FP16_MAX, _FP16_MAX).half().cpu().numpy()
    return half.view(np.uint16).astype(np.int64).tolist()


def _bits_to_float(bits: list[int]) -> torch.Tensor:
    half = np.asarray(bits, dtype=np.int64).astype(np.uint16).view(np.float16)
    return torch.from_numpy(half.astype(np.float32))


def _injective_modulus(indices: list[int]) -> int:
    for m in range(PRIME, len(indices) - 1, -1):
        if len({i % m for i in indices}) == len(indices):
            return m
    raise ProofError(f"no modulus makes {len(indices)} indices distinct")  # unreachable


_INV: np.ndarray | None = None  # modular inverses of 0..PRIME-1 (0 -> 0), built once


def _inverses() -> np.ndarray:
    global _INV
    if _INV is None:  # Fermat: x^(p-2), square-and-multiply over the whole field at once
        base = np.arange(PRIME, dtype=np.int64)
        acc, e = np.ones(PRIME, dtype=np.int64), PRIME - 2
        while e:
            if e & 1:
                acc = acc * base % PRIME
            base, e = base * base % PRIME, e >> 1
        _INV = acc
    return _INV


def _interpolate(xs: list[int], ys: list[int]) -> list[int]:
    """Monomial coefficients (low degree first) over GF(PRIME) through the points (xs
    distinct). Newton form, vectorised: O(n) array steps instead of O(n^2) Python ones."""
    n = len(xs)
    x = np.asarray(xs, dtype=np.int64) % PRIME
    a = np.asarray(ys, dtype=np.int64) % PRIME
    inv = _inverses()
    for j in range(1, n):  # divided differences: a[i] = (a[i] - a[i-1]) / (x[i] - x[i-j])
        a[j:] = (a[j:] - a[j - 1 : -1]) % PRIME * inv[(x[j:] - x[: n - j]) % PRIME] % PRIME
    poly = np.zeros(n + 1, dtype=np.int64)
    poly[0] = a[n - 1]
    for j in range(n - 2, -1, -1):  # poly = poly * (X - x[j]) + a[j]
        poly[1:] = (poly[:-1] - poly[1:] * x[j]) % PRIME  # new c_d = c_{d-1} - x c_d
        poly[0] = (a[j] - poly[0] * x[j]) % PRIME
    return poly[:n].tolist()


def _evaluate_many(coeffs: list[int], points: list[int]) -> list[int]:
    """The polynomial at each point, over GF(PRIME): a (points x degree) power table built by
    doubling (log2(k) array steps), then one multiply-sum. Products stay below PRIME**2 and
    a row sums k of them: well inside int64."""
    x = np.asarray(points, dtype=np.int64) % PRIME
    n = len(coeffs)
    if n == 0:
        return [0] * len(points)
    powers = np.ones((len(x), n), dtype=np.int64)
    width, x_width = 1, x.copy()  # x_width = x ** width
    while width < n:
        take = min(width, n - width)
        powers[:, width : width + take] = powers[:, :take] * x_width[:, None] % PRIME
        x_width, width = x_width * x_width % PRIME, 2 * width
    return ((powers * np.asarray(coeffs, dtype=np.int64)).sum(axis=1) % PRIME).tolist()


def _evaluate(coeffs: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):
        acc = (acc * x + c) % PRIME
    return acc


def _top(block: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    flat = block.float().reshape(-1)
    idx = torch.topk(flat.abs(), min(k, flat.numel())).indices
    return idx.tolist(), flat[idx]


def _chunks(hidden: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    if hidden.dim() != 2:
        raise ProofError(f"hidden states must be (tokens, dim), got {tuple(hidden.shape)}")
    return [hidden[i : i + chunk] for i in range(0, hidden.shape[0], chunk)]


def build_proof(hidden: torch.Tensor, chunk: int = CHUNK, k: int = TOPK) -> bytes:
    """The proof of the generated tokens' last hidden states (n, D): one commitment per
    chunk of `chunk` tokens, concatenated (see `proof_size`)."""
    out = bytearray()
    for block in _chunks(hidden, chunk):
        indices, values = _top(block, chunk_k(block.shape[0], block.shape[1], chunk, k))
        m = _injective_modulus(indices)
        coeffs = _interpolate([i % m for i in indices], _fp16_bits(values))
        out += m.to_bytes(2, "little")
        for c in coeffs:
            out += c.to_bytes(2, "little")
    return bytes(out)


@dataclass(frozen=True)
class ChunkCheck:
    overlap: float  # share of the recomputed top-k whose committed value agrees (*)
    mean_ulp: float  # mean |fp16 units| between committed and recomputed agreeing values (*)
    # (*) a partial chunk's counts PARTIAL_MISS_SLACK misses as agreeing and its mean
    # forgives PARTIAL_ULP_SLACK ulps in total (see the module doc)


@dataclass(frozen=True)
class ProofThresholds:
    """A chunk passes when overlap >= min_overlap and mean_ulp <= max_mean_ulp.

    The defaults are an fp32 run's (`covey.rl.batch.TOLERANCES`, calibrated by
    `python -m covey.bench.rl_verify` and `python -m covey.rl.calibrate`): honest
    recomputation across 1/2 threads and generation/prefill batch sizes gives overlap 1.000
    and mean_ulp <= 0.016 per chunk; weights perturbed by 1e-3 relative or rounded to bf16
    give mean_ulp >= 1.09 (calibrate's 4-layer GPT) / 1.57 (the bench's), an older policy
    far more. 0.1 sits 6x above the honest worst and 11x below the closest cheat. A bf16
    run has its own (TOLERANCES["bf16"])."""

    min_overlap: float = 0.9
    max_mean_ulp: float = 0.1
    agree_rel: float = 0.05  # a committed value "agrees" within this relative error


@dataclass(frozen=True)
class ProofVerdict:
    ok: bool
    chunks: list[ChunkCheck]
    reason: str = ""


def compare_proof(
    proof: bytes,
    hidden: torch.Tensor,
    thresholds: ProofThresholds = ProofThresholds(),
    chunk: int = CHUNK,
    k: int = TOPK,
) -> ProofVerdict:
    """Check `proof` against recomputed hidden states (n, D) of the same generated tokens.
    A malformed proof (wrong length, bad modulus) is a failed verdict, never an exception."""
    blocks = _chunks(hidden, chunk)
    expected = proof_size(hidden.shape[0], hidden.shape[1], chunk, k)
    if len(proof) != expected:
        return ProofVerdict(False, [], f"proof is {len(proof)} bytes, expected {expected}")
    checks: list[ChunkCheck] = []
    pos = 0
    for n, block in enumerate(blocks):
        k_n = chunk_k(block.shape[0], block.shape[1], chunk, k)
        size = chunk_proof_bytes(k_n)
        raw = proof[pos : pos + size]
        pos += size
        m = int.from_bytes(raw[:2], "little")
        if not k_n <= m <= PRIME:
            return ProofVerdict(False, checks, f"chunk {n}: bad modulus {m}")
        coeffs = [int.from_bytes(raw[i : i + 2], "little") for i in range(2, size, 2)]
        indices, values = _top(block, k_n)
        claimed = _bits_to_float(_evaluate_many(coeffs, [i % m for i in indices]))
        mine_bits = torch.tensor(_fp16_bits(values), dtype=torch.int64)
        claimed_bits = torch.tensor(_fp16_bits(claimed), dtype=torch.int64)
        mine = _bits_to_float(mine_bits.tolist())
        agree = (claimed - mine).abs() <= thresholds.agree_rel * mine.abs()
        agree &= torch.isfinite(claimed)
        partial = block.shape[0] < chunk
        forgiven = PARTIAL_MISS_SLACK if partial else 0
        overlap = min(1.0, (int(agree.sum()) + forgiven) / agree.numel())
        # same sign when agreeing, so fp16 bit patterns are monotone: their gap is in ULPs
        ulp = (claimed_bits - mine_bits).abs()[agree].float()
        slack = PARTIAL_ULP_SLACK if partial else 0.0
        mean_ulp = max(float(ulp.sum()) - slack, 0.0) / ulp.numel() if ulp.numel() else math.inf
        checks.append(ChunkCheck(overlap, mean_ulp))
        if overlap < thresholds.min_overlap:
            return ProofVerdict(
                False, checks, f"chunk {n}: top-k overlap {overlap:.3f} < {thresholds.min_overlap}"
            )
        if mean_ulp > thresholds.max_mean_ulp:
            return ProofVerdict(
                False,
                checks,
                f"chunk {n}: mean value error {mean_ulp:.3f} fp16 ulp > {thresholds.max_mean_ulp}",
            )
    return ProofVerdict(True, checks)


def verify_proof(
    model: torch.nn.Module,
    prompt: list[int],
    tokens: list[int],
    proof: bytes,
    thresholds: ProofThresholds = ProofThresholds(),
    chunk: int = CHUNK,
    k: int = TOPK,
) -> ProofVerdict:
    """Recompute the generated tokens' hidden states with one prefill of prompt + tokens
    and compare them with `proof` (see `compare_proof`)."""
    from covey.rl.sampling import prefill

    if not tokens:
        ok = len(proof) == 0
        return ProofVerdict(ok, [], "" if ok else "proof for an empty completion")
    _, hidden = prefill(model, [prompt + tokens])[0]
    return compare_proof(proof, hidden[len(prompt) :], thresholds, chunk, k)
