"""Gradient compression for the wire, as in ``horovod.torch.Compression``: ``none`` and ``fp16``."""

from __future__ import annotations

from typing import Any

import torch


class NoneCompressor:
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as fp16 (half the bytes); the result is cast back to the input dtype.

    The sum is accumulated in fp16 on the wire, as in Horovod: fine for gradients of moderate size and
    rank count, lossy for large sums (fp16 has 11 bits of mantissa, max 65504).
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
