"""Orthonormal DCT-II over fixed-width chunks of a flat tensor.

Contract:

* ``dct_basis(n)`` is the (n, n) orthonormal DCT-II matrix ``C`` with
  ``C[k, j] = a_k * cos(pi * (2j + 1) * k / (2n))``, ``a_0 = sqrt(1/n)``, ``a_k = sqrt(2/n)``,
  so ``C @ C.T == I`` and the inverse transform is ``C.T`` (DCT-III).  It is computed in float64,
  cast to the requested dtype, and cached per ``(n, dtype)``: treat it as read-only.
* ``to_chunks(x, chunk)`` reshapes a flat tensor into ``(ceil(numel / chunk), chunk)`` rows,
  zero-padding the end of the last row.
* ``dct_chunks(x, chunk)`` returns the per-row coefficients ``to_chunks(x, chunk) @ C.T``.
* ``idct_chunks(coeffs, numel)`` inverts ``dct_chunks`` and drops the padding.
* ``dct2_chunks(x, side)`` is the separable 2-D version: each row of
  ``to_chunks(x, side * side)`` is viewed as a row-major (side, side) matrix ``X`` and replaced
  by the row-major flattening of ``C @ X @ C.T`` (``C = dct_basis(side)``), giving
  ``(n_blocks, side * side)`` coefficients.  For a row-major matrix ``side`` columns wide, each
  block is a (side, side) sub-block of that matrix; otherwise each block is ``side`` consecutive
  runs of ``side`` elements, stacked.  Either way the transform is orthonormal.
* ``idct2_chunks(coeffs, numel, side)`` inverts ``dct2_chunks`` (``X = C.T @ Z @ C``) and
  drops the padding.

Used by the DeMo-style top-k DCT codec (Peng et al., "DeMo: Decoupled Momentum Optimization",
arXiv 2411.19870), which transforms each chunk and keeps only its largest coefficients, and
by its 2-D block variant (DeMo itself uses 2-D DCTs over blocks of each weight matrix).
Because ``C`` is orthonormal, the l2 norm of the coefficients a codec drops equals the l2 norm
of the reconstruction error of that chunk, which is what makes the codec's error bound cheap
to state.  Everything is one (1-D) or two (2-D) batched matmuls: no Python loop over chunks.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["dct2_chunks", "dct_basis", "dct_chunks", "idct2_chunks", "idct_chunks", "to_chunks"]


@functools.lru_cache(maxsize=64)
def dct_basis(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Return the (n, n) orthonormal DCT-II matrix (rows are basis vectors), cached; read-only."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"DCT size must be a positive int, got {n!r}")
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2.0 * j + 1.0) * k / (2.0 * n))
    basis *= math.sqrt(2.0 / n)
    basis[0] = math.sqrt(1.0 / n)
    return basis.to(dtype)


def _check_flat(x: Tensor, chunk: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"expected a flat 1-D tensor, got shape {tuple(x.shape)}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


def to_chunks(x: Tensor, chunk: int) -> Tensor:
    """Flat 1-D tensor -> (ceil(numel / chunk), chunk), zero-padded at the end."""
    _check_flat(x, chunk)
    n = x.numel()
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(n_chunks, chunk)


def dct_chunks(x: Tensor, chunk: int) -> Tensor:
    """Flat float tensor -> (n_chunks, chunk) orthonormal DCT-II coefficients of each chunk."""
    if not x.is_floating_point():
        raise ValueError(f"dct_chunks needs a floating-point tensor, got {x.dtype}")
    rows = to_chunks(x, chunk)
    basis = dct_basis(chunk, x.dtype).to(x.device)
    return rows @ basis.T


def _check_numel(numel: int, n_chunks: int, chunk: int) -> None:
    if not 0 <= numel <= n_chunks * chunk or numel <= (n_chunks - 1) * chunk:
        raise ValueError(
            f"numel {numel} does not fit {n_chunks} chunks of {chunk} "
            f"(needs {(n_chunks - 1) * chunk} < numel <= {n_chunks * chunk})"
        )


def idct_chunks(coeffs: Tensor, numel: int) -> Tensor:
    """Inverse of ``dct_chunks``: (n_chunks, chunk) coefficients -> flat tensor of ``numel``."""
    if coeffs.dim() != 2:
        raise ValueError(
            f"expected (n_chunks, chunk) coefficients, got shape {tuple(coeffs.shape)}"
        )
    n_chunks, chunk = coeffs.shape
    _check_numel(numel, n_chunks, chunk)
    basis = dct_basis(chunk, coeffs.dtype).to(coeffs.device)
    flat = (coeffs @ basis).reshape(-1)
    return flat[:numel] if numel < flat.numel() else flat


def _check_side(side: int) -> None:
    if not isinstance(side, int) or side < 1:
        raise ValueError(f"block side must be a positive int, got {side!r}")


def dct2_chunks(x: Tensor, side: int) -> Tensor:
    """Flat float tensor -> (n_blocks, side * side): row-major ``C @ X @ C.T`` of every block."""
    if not x.is_floating_point():
        raise ValueError(f"dct2_chunks needs a floating-point tensor, got {x.dtype}")
    _check_side(side)
    rows = to_chunks(x, side * side)
    basis = dct_basis(side, x.dtype).to(x.device)
    half = (rows.reshape(-1, side) @ basis.T).reshape(-1, side, side)  # X @ C.T, all rows at once
    return torch.matmul(basis, half).reshape(rows.shape)  # C @ (X @ C.T), batched over blocks


def idct2_chunks(coeffs: Tensor, numel: int, side: int) -> Tensor:
    """Inverse of ``dct2_chunks``: (n_blocks, side * side) or (n_blocks, side, side)
    coefficients -> flat tensor of ``numel``."""
    _check_side(side)
    if tuple(coeffs.shape[1:]) not in ((side * side,), (side, side)):
        raise ValueError(
            f"expected (n_blocks, {side * side}) or (n_blocks, {side}, {side}) coefficients, "
            f"got shape {tuple(coeffs.shape)}"
        )
    n_blocks = coeffs.shape[0]
    _check_numel(numel, n_blocks, side * side)
    basis = dct_basis(side, coeffs.dtype).to(coeffs.device)
    half = (coeffs.reshape(-1, side) @ basis).reshape(n_blocks, side, side)  # Z @ C
    flat = torch.matmul(basis.T, half).reshape(-1)  # C.T @ (Z @ C)
    return flat[:numel] if numel < flat.numel() else flat
