"""Horovod's and BytePS's ``Compression``: what a gradient is turned into before it is summed."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class Compressor:
    """Horovod's interface: ``compress(tensor) -> (compressed, ctx)`` and
    ``decompress(compressed, ctx) -> tensor``. Subclass it (static methods) to
    pass your own to :func:`allreduce` or :func:`DistributedOptimizer`."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Returns the compressed tensor and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns the tensor :meth:`compress` was given, from its compressed form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default): the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _Cast16(Compressor):
    """Floating-point tensors are cast to a 16-bit type and back; others pass."""

    dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        dtype: Optional[torch.dtype] = ctx
        if dtype is not None and dtype.is_floating_point:
            return tensor.to(dtype)
        return tensor


class FP16Compressor(_Cast16):
    """Floating-point tensors are rounded to float16 (Horovod's ``Compression.fp16``).

    In this version the 16-bit values do not travel as 16 bits: every rank
    rounds its tensor to float16 on the Python side, the values are summed in
    float32 (in rank order, like every float32 sum of Tidewire's servers) and
    :meth:`decompress` casts the result back to the tensor's dtype. So the
    result is the float32 sum of float16-rounded values; Horovod's sums float16
    values in float16 (rounding at every addition). What goes over the wire is
    not smaller yet."""

    dtype = torch.float16


class BF16Compressor(_Cast16):
    """Floating-point tensors are rounded to bfloat16 (``Compression.bf16``);
    summed in float32 like :class:`FP16Compressor` (not smaller on the wire yet)."""

    dtype = torch.bfloat16


class Compression:
    """Optional compression of the tensors a collective sums (Horovod's and BytePS's names)."""

    #: No compression (the default).
    none = NoneCompressor
    #: Round floating-point tensors to float16 before the sum (see :class:`FP16Compressor`).
    fp16 = FP16Compressor
    #: Round floating-point tensors to bfloat16 before the sum (see :class:`BF16Compressor`).
    bf16 = BF16Compressor


def _check_compression(compression: Any) -> Any:
    """``compression`` if it has Horovod's ``compress``/``decompress``; raises otherwise."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(
            f"compression={compression!r}: want tidewire.torch.Compression.none, .fp16, .bf16, or a class with "
            "Horovod's compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
        )
    return compression


def _round_trip(compression: Any, tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``decompress(compress(tensor))`` as ``tensor``'s dtype and shape, or None for no compression."""
    if compression is NoneCompressor:
        return None
    c, ctx = compression.compress(tensor)
    out = compression.decompress(c, ctx)
    if not isinstance(out, torch.Tensor) or out.shape != tensor.shape:
        raise TypeError(f"{compression!r}: decompress(compress(t)) must give a tensor of t's shape")
    return out.to(tensor.dtype)
