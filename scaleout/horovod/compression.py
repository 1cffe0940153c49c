"""Gradient compression for the wire, as in ``horovod.torch.Compression``: ``none`` and ``fp16``.

The wire dtypes are the core's: each compressor is named after an entry of the gradient reducer's
table (:data:`scaleout.parallel.reducer.COMPRESSION`, the vocabulary of ``comm.compression`` in a
config), so ``hvd.Compression.fp16`` and ``compression: fp16`` mean the same cast.
``hvd.Compression.bf16`` (not in Horovod) is the reducer's ``bf16``. :meth:`Compression.of` also
takes those names (``"fp16"``, ``"bf16"``, ``"none"``, ``None``) wherever the Horovod API takes a
compression.

What differs from the reducer is Horovod's arithmetic, kept on purpose: the compressed tensor is
summed on the wire as it is (the reducer divides by the world size before the cast, see its module
docstring); ``prescale_factor`` / ``gradient_predivide_factor`` are Horovod's way to do the same.
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.horovod.errors import HorovodValueError
from scaleout.parallel.reducer import COMPRESSION, compression_dtype


class Compressor:
    """Casts floating-point tensors to ``dtype`` for the wire and the result back to the input
    dtype; other dtypes pass through. ``dtype=None``: send the tensor as it is."""

    name: str = "none"
    dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if cls.dtype is None or not tensor.dtype.is_floating_point or tensor.dtype == cls.dtype:
            return tensor, None
        return tensor.to(cls.dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


def _compressor(name: str, doc: str) -> type[Compressor]:
    return type(
        f"{name.upper()}Compressor",
        (Compressor,),
        {"name": name, "dtype": compression_dtype(name), "__doc__": doc},
    )


NoneCompressor = _compressor("none", "Send the tensor as it is.")
FP16Compressor = _compressor(
    "fp16",
    "Floating-point tensors travel as fp16 (half the bytes), summed in fp16 as in Horovod: fine "
    "for gradients of moderate size and rank count, lossy for large sums (11 bits of mantissa, max "
    "65504).",
)
BF16Compressor = _compressor(
    "bf16",
    "Floating-point tensors travel as bf16 (fp32's range, 8 bits of mantissa); not in Horovod.",
)


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16`` (and ``bf16``, the reducer's other
    dtype)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def of(compression: Any) -> type[Compressor] | Any:
        """A compressor from a Horovod compressor (or any object with compress/decompress, returned
        as it is) or from one of the reducer's names."""
        if hasattr(compression, "compress") and hasattr(compression, "decompress"):
            return compression
        if compression is None or compression in COMPRESSION:
            return _BY_NAME[compression or "none"]
        raise HorovodValueError(
            f"compression={compression!r}: expected hvd.Compression.none/fp16/bf16 or one of "
            f"{sorted(k for k in COMPRESSION if k)}"
        )


_BY_NAME = {c.name: c for c in (NoneCompressor, FP16Compressor, BF16Compressor)}
