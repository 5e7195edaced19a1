"""Memory layouts that mpfused's element-wise kernels can take: a tensor whose elements fill one block of
memory without overlap (contiguous in some order of its dims: contiguous, channels_last, a transpose of a
contiguous tensor, ...). Element-wise work is free to read such a tensor as a flat array, provided every
tensor it pairs with (grad, master weight, optimizer state) lays out its elements the same way."""

from __future__ import annotations

import torch


def is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one block of memory without overlap (contiguous in some dim order)."""
    return _dense(t.shape, t.stride())


def _dense(shape, strides) -> bool:
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(shape, strides) if s != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view of its memory (in memory order), for element-wise work and
    sums whose order is free. Under torch.compile, through a permute to memory order (dynamo fails on a
    transposed ``.grad``'s storage_offset(), as on its stride(): see grad_strides)."""
    if t.is_contiguous():
        return t
    if torch.compiler.is_compiling():
        strides = grad_strides(t)
        return t.permute(sorted(range(t.dim()), key=lambda d: -strides[d])).view(-1)  # (a view, never a copy)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def same_layout(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """True when t has ref's shape and the same stride in every dim of size > 1 (a size-1 dim's stride never
    addresses memory), so that element i of both flat arrays is the same logical element."""
    return _same(t.shape, t.stride(), ref)


def _same(shape, strides, ref: torch.Tensor) -> bool:
    if shape != ref.shape:
        return False
    ref_strides = ref.stride()
    return strides == ref_strides or all(s == 1 or a == b for s, a, b in zip(ref.shape, strides, ref_strides))


def grad_strides(t: torch.Tensor) -> tuple:
    """t.stride(), also for a ``.grad`` under torch.compile: there dynamo (torch 2.13) fails on stride() of a
    grad that is a view of part of a buffer or a transposed tensor (DDP's gradient_as_bucket_view gives such
    grads: "Cannot construct ConstantVariable for value of type SymInt"), and reads an alias's strides."""
    return torch.ops.aten.alias(t).stride() if torch.compiler.is_compiling() else t.stride()


def dense_grad(t: torch.Tensor) -> bool:
    """is_dense for a ``.grad`` (see grad_strides)."""
    return t.is_contiguous() or _dense(t.shape, grad_strides(t))


def layouts_match(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """same_layout for a ``.grad`` ``t`` and its param ``ref`` of the same shape (see grad_strides)."""
    return (t.is_contiguous() and ref.is_contiguous()) or _same(t.shape, grad_strides(t), ref)


def like(value: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """value's elements as a new ``dtype`` tensor on ref's device with ref's memory layout (ref dense)."""
    return torch.empty_like(ref, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
