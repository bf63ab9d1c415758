"""Sparse tensor codecs: top-k of the vector (``TopKCodec``) and top-k of its DCT, 1-D per
chunk (``DctCodec``, DeMo-style) or 2-D per block (``Dct2Codec``). The contract, header and
value formats are covey.algorithms.codec_base's; ``get_codec`` (covey.algorithms.codecs)
builds them from a spec."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from torch import Tensor

from covey.algorithms.codec_base import (
    VALUE_FORMATS,
    Body,
    Codec,
    CodecError,
    _decode_values,
    _encode_values,
    _np,
    _peak,
    _value_bound,
    _value_format,
    _values_nbytes,
)
from covey.algorithms.dct import (
    dct2_chunks,
    dct_chunks,
    idct2_chunks,
    idct2_sparse,
    idct_chunks,
    idct_sparse,
    to_chunks,
)


class TopKCodec(Codec):
    """Keep the k = min(numel, max(1, ceil(ratio * numel))) largest |x| (k = 0 if numel = 0).
    Parameters: float64 ratio, uint8 value format (0 fp32, 1 fp16, 2 int8 = the kept-values
    vector block-quantized by the int8 quantizer with block 64).  Body: k uint32 indices,
    strictly ascending, then the k values.  numel must be <= 2^32.
    Bound: max(largest dropped |x|, value-format error of the kept values), the latter being
    0 (fp32), max|x| * 2^-11 + 2^-24 (fp16) or the Int8Codec bound of max|x| (int8)."""

    codec_id = 6
    params_struct = struct.Struct("<dB")

    def __init__(self, ratio: float, values: str | int = "fp32") -> None:
        ratio = float(ratio)
        if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.ratio, self.values = ratio, _value_format(values)
        self.name = f"topk:{ratio!r}" + ("" if self.values == "fp32" else f":{self.values}")
        self.lossless = ratio == 1.0 and self.values == "fp32"

    def _params(self) -> tuple:
        return (self.ratio, VALUE_FORMATS.index(self.values))

    def k(self, numel: int) -> int:
        """Number of entries kept out of ``numel``."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def _body_nbytes(self, numel: int) -> int:
        return 4 * self.k(numel) + _values_nbytes(self.k(numel), self.values)

    def _select(self, x: np.ndarray) -> np.ndarray:
        """Ascending indices of the k largest |x| (argpartition: O(n), deterministic)."""
        n, k = x.size, self.k(x.size)
        if n > 2**32:
            raise CodecError(f"top-k indices are uint32; {n} elements is too many")
        idx = np.argpartition(np.abs(x), n - k)[n - k :] if k < n else np.arange(n)
        return np.sort(idx)

    def _encode_body(self, x: np.ndarray) -> Body:
        idx = self._select(x)
        return [idx.astype("<u4"), *_encode_values(x[idx], self.values)]

    def _on_device(self, x: Tensor) -> Body:
        """Select on x's device (torch.topk; ties may pick other indices than the host's
        argpartition, equally valid); only the k indices and values cross to the host."""
        n, k = x.numel(), self.k(x.numel())
        if n > 2**32:
            raise CodecError(f"top-k indices are uint32; {n} elements is too many")
        if n and not bool(torch.isfinite(x).all()):
            raise CodecError(f"tensor of {n} elements contains NaN or Inf")
        if k < n:
            idx = torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values
        else:
            idx = torch.arange(n, device=x.device)
        vals = x[idx].cpu().numpy()
        return [idx.cpu().numpy().astype("<u4"), *_encode_values(vals, self.values)]

    def _parts(self, buf: memoryview, offset: int, numel: int) -> tuple[Tensor, Tensor]:
        """(checked indices int64, values) of a payload, on the host."""
        if numel > 2**32:
            raise CodecError(f"top-k payload claims {numel} elements; uint32 indices allow 2^32")
        k = self.k(numel)
        idx = _np(buf, "<u4", k, offset).astype(np.int64)
        if k > 1 and not (np.diff(idx) > 0).all():
            raise CodecError("top-k indices are not strictly ascending")
        if k and idx[-1] >= numel:
            raise CodecError(f"top-k index {idx[-1]} out of range for {numel} elements")
        return torch.from_numpy(idx), _decode_values(buf, offset + 4 * k, k, self.values)

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = vals
        return out

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)  # k entries cross, not numel
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        out[idx.to(device)] = vals.to(device)
        return out

    def _bound(self, x: np.ndarray) -> float:
        dropped = np.ones(x.size, dtype=bool)
        dropped[self._select(x)] = False
        return max(_peak(x[dropped]), _value_bound(_peak(x), self.values))


class DctCodec(Codec):
    """DeMo-style DCT top-k (arXiv 2411.19870): zero-pad to chunks of ``chunk``, orthonormal
    DCT-II per chunk, keep the k largest |coeff| of every chunk.  Parameters: uint32 chunk
    (1..65536), uint32 k (1..chunk), uint8 value format (as TopKCodec).  Body: n_chunks * k
    indices (uint8 if chunk <= 256, else uint16; strictly ascending within a chunk), then the
    n_chunks * k values, chunk-major.  Inputs whose coefficients overflow float32 raise.
    Bound: the transform is orthonormal, so a chunk's l2 reconstruction error equals the l2 norm
    of its coefficient error, and l_inf <= l2.  Per chunk: sqrt(||dropped||^2 + k * e^2), e the
    value-format error at max|coeff|; the bound is the max over chunks plus the worst-case
    float32 round-off of both transforms, (chunk^1.5 + sqrt(chunk) * (k + 2)) * (2^-24 * max
    chunk l2 norm + sqrt(chunk) * 2^-149) (relative error 2^-24 per operation, or up to
    2^-150 absolute among subnormals; the inverse sums the k kept terms one by one in a fixed
    order, so that decoding is bit-exact on every thread count and CPU).
    Subclasses change only the transform: ``dims`` and ``_transform``/``_inverse``."""

    codec_id = 7
    params_struct = struct.Struct("<IIB")
    head, size_name, max_size, dims = "dct", "chunk", 65536, 1

    def __init__(self, chunk: int = 64, k: int = 8, values: str | int = "fp32") -> None:
        size, what = chunk, f"{self.head.upper()} {self.size_name}"
        if not isinstance(size, int) or not 1 <= size <= self.max_size:
            raise ValueError(f"{what} must be an int in [1, {self.max_size}], got {size!r}")
        self.size, self.chunk = size, size**self.dims  # transform length; elements per chunk
        if not isinstance(k, int) or not 1 <= k <= self.chunk:
            raise ValueError(f"DCT k must be an int in [1, {self.chunk}] for {what} {size}: {k!r}")
        self.k, self.values = k, _value_format(values)
        self.index_dtype = "u1" if self.chunk <= 256 else "<u2"
        fmt = "" if self.values == "fp32" else f":{self.values}"
        self.name = f"{self.head}:{size}:{k}{fmt}"

    def _params(self) -> tuple:
        return (self.size, self.k, VALUE_FORMATS.index(self.values))

    def _transform(self, x: Tensor) -> Tensor:
        return dct_chunks(x, self.chunk)

    def _inverse(self, coeffs: Tensor, numel: int) -> Tensor:
        return idct_chunks(coeffs, numel)

    def _inverse_sparse(self, idx: Tensor, vals: Tensor, numel: int) -> Tensor:
        return idct_sparse(idx, vals, numel, self.chunk)

    def _body_nbytes(self, numel: int) -> int:
        kept = -(-numel // self.chunk) * self.k
        return kept * np.dtype(self.index_dtype).itemsize + _values_nbytes(kept, self.values)

    def _select(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(coefficients, kept indices ascending within each chunk), shared by encode and bound."""
        coeffs = self._transform(torch.from_numpy(x)).numpy()
        if not np.isfinite(coeffs).all():
            raise CodecError("DCT coefficients overflow float32")
        idx = np.argpartition(np.abs(coeffs), self.chunk - self.k, axis=1)[:, self.chunk - self.k :]
        return coeffs, np.sort(idx, axis=1)

    def _encode_body(self, x: np.ndarray) -> Body:
        coeffs, idx = self._select(x)
        vals = np.take_along_axis(coeffs, idx, axis=1).reshape(-1)
        return [idx.astype(self.index_dtype), *_encode_values(vals, self.values)]

    def _on_device(self, x: Tensor) -> Body:
        """Transform and select on x's device; only the kept coefficients cross to the
        host. The device's matmul rounds differently from the host's, so the payload may
        differ from a host encode of the same vector within the stated bound."""
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise CodecError(f"tensor of {x.numel()} elements contains NaN or Inf")
        coeffs = self._transform(x)
        if not bool(torch.isfinite(coeffs).all()):
            raise CodecError("DCT coefficients overflow float32")
        idx = torch.sort(torch.topk(coeffs.abs(), self.k, dim=1, sorted=False).indices).values
        vals = torch.gather(coeffs, 1, idx).reshape(-1).cpu().numpy()
        return [idx.cpu().numpy().astype(self.index_dtype), *_encode_values(vals, self.values)]

    def _decode_to(self, buf: memoryview, offset: int, numel: int, device: torch.device) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)  # the kept coefficients cross, not numel
        out = self._inverse_sparse(idx.to(device), vals.to(device), numel)
        if not bool(torch.isfinite(out).all()):
            raise CodecError("DCT reconstruction overflows float32")
        return out

    def _parts(self, buf: memoryview, offset: int, numel: int) -> tuple[Tensor, Tensor]:
        """(checked indices (n_chunks, k) int64, values (n_chunks, k) float32), on the host."""
        n_chunks = -(-numel // self.chunk)
        kept = n_chunks * self.k
        idx = _np(buf, self.index_dtype, kept, offset).astype(np.int64).reshape(n_chunks, self.k)
        if kept and idx.max() >= self.chunk:
            raise CodecError(f"DCT index {idx.max()} out of range for chunk {self.chunk}")
        if not (np.diff(idx, axis=1) > 0).all():
            raise CodecError("DCT indices are not strictly ascending within a chunk")
        offset += kept * np.dtype(self.index_dtype).itemsize
        vals = _decode_values(buf, offset, kept, self.values).reshape(n_chunks, self.k)
        return torch.from_numpy(idx), vals.float()

    def _decode_body(self, buf: memoryview, offset: int, numel: int) -> Tensor:
        idx, vals = self._parts(buf, offset, numel)
        # from the kept coefficients alone, in a fixed order: bit-exact on every thread
        # count and CPU, which the canonical weights hash needs (covey/algorithms/dct.py)
        out = self._inverse_sparse(idx, vals, numel)
        if not np.isfinite(out.numpy()).all():
            raise CodecError("DCT reconstruction overflows float32")
        return out

    def _bound(self, x: np.ndarray) -> float:
        coeffs, idx = self._select(x)
        dropped = coeffs.astype(np.float64)
        np.put_along_axis(dropped, idx, 0.0, axis=1)
        e = _value_bound(_peak(coeffs), self.values)
        per_chunk = np.sqrt(np.square(dropped).sum(axis=1) + self.k * e * e)
        norms = np.linalg.norm(to_chunks(torch.from_numpy(x).double(), self.chunk).numpy(), axis=1)
        # The forward transform is dims matmul passes with dot products of length ``size``:
        # l2 error per chunk <= dims * size^1.5 * 2^-24 * norm. The inverse (decode, dct.py)
        # adds the k kept terms one after another, each from at most 2 multiplies, and their
        # absolute values sum to at most the chunk's norm (Cauchy-Schwarz on an orthonormal
        # basis): per element <= (k + 2) * 2^-24 * norm, l2 <= sqrt(chunk) times that.
        # Subnormal operands add up to 2^-149 absolute per operation.
        forward = self.dims * self.size**1.5
        inverse = math.sqrt(self.chunk) * (self.k + 2)
        roundoff = (forward + inverse) * 2.0**-24 * float(norms.max())
        subnormal = (forward + inverse) * math.sqrt(self.chunk) * 2.0**-149
        return float(per_chunk.max()) + roundoff + subnormal


class Dct2Codec(DctCodec):
    """2-D block DCT top-k, the transform DeMo (arXiv 2411.19870) applies to weight matrices:
    zero-pad to chunks of side * side elements, view each as a row-major (side, side) matrix X,
    take the separable orthonormal 2-D DCT-II C @ X @ C.T (C = dct_basis(side)) and keep the k
    largest |coeff| of every block.  For a row-major matrix exactly ``side`` columns wide each
    block is a side x side sub-block of the matrix, as in DeMo; otherwise a block is ``side``
    consecutive runs of ``side`` elements, stacked, still transformed orthonormally.
    Parameters: uint32 side (1..256), uint32 k (1..side^2), uint8 value format.  Body as
    DctCodec with chunk = side^2 (so uint8 indices if side <= 16, else uint16); the index of
    coefficient (r, c) of a block is r * side + c.
    Bound: as DctCodec with chunk = side^2, except that the forward transform's round-off is
    2 * side^1.5 (two length-side matmul passes) in place of chunk^1.5; the inverse's, a
    fixed-order sum of the k kept terms, is as DctCodec's."""

    codec_id = 9
    head, size_name, max_size, dims = "dct2", "side", 256, 2

    def __init__(self, side: int = 64, k: int = 32, values: str | int = "fp32") -> None:
        super().__init__(side, k, values)
        self.side = side

    def _transform(self, x: Tensor) -> Tensor:
        return dct2_chunks(x, self.side)

    def _inverse(self, coeffs: Tensor, numel: int) -> Tensor:
        return idct2_chunks(coeffs, numel, self.side)

    def _inverse_sparse(self, idx: Tensor, vals: Tensor, numel: int) -> Tensor:
        return idct2_sparse(idx, vals, numel, self.side)
