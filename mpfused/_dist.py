"""torch.distributed awareness: DTensor params and grads (FSDP2, HSDP, tensor parallel) for the fused
optimizers and the scaler.

mpfused's kernels take plain tensors. A DTensor's kernel input is its local shard (``to_local()``): the
element-wise updates need nothing else, so an FSDP2 step is the same single fused pass over the shards,
with no gather. What does need the other ranks is a reduction, and a DTensor's placements say which:

- a sum over the elements (the squares of a global grad norm) sums the local parts over the mesh dims
  where the tensor is ``Shard``-ed (or ``Partial``), and not over those where it is ``Replicate``-d
  (there every rank holds the same values: summing would count them once per replica);
- a flag (found_inf) is reduced with MAX over every rank of the mesh, so that every rank skips together
  even when one replica's values differ from another's.

Nothing here imports torch.distributed.tensor: a DTensor can only exist once its module is imported, so
the checks look it up in ``sys.modules`` and cost nothing in a program that never uses it.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch


def warn_drawn_seed() -> None:
    """Where torch.distributed runs several ranks: a warning that a seed drawn from this rank's own torch
    generator is the same on every rank only when every rank seeded torch alike (scripts often seed each
    rank its own way, for dropout or data order: then DDP replicas round apart and drift from the first
    step). Agreeing on one would need a collective at the optimizer's construction, which hangs any rank
    that builds its optimizer alone."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    import warnings

    warnings.warn("rounding='stochastic' with seed=None under torch.distributed: the seed is drawn from this "
                  "rank's torch generator, so ranks seeded differently round differently and DDP/FSDP replicas "
                  "drift apart; pass the same seed= on every rank", UserWarning, stacklevel=4)


def dtensor_type():
    """torch's DTensor class if its module is loaded (else no DTensor exists), or None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same memory: an in-place write to it writes the DTensor), or t itself.
    Reads the shard directly: ``to_local()`` is an autograd function, a few microseconds per call."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def describe(t) -> str:
    """A DTensor's mesh and placements, for error messages."""
    return f"DTensor on {t.device_mesh} with placements {tuple(t.placements)}"


def sum_dims(t) -> tuple[int, ...]:
    """The mesh dims over which a sum of ``t``'s elements adds the local parts: those where ``t`` is sharded
    (Shard, _StridedShard), not those where it is replicated. A Partial tensor's local parts are addends
    of its values, not parts of them (its squares do not add up): a NotImplementedError."""
    dims = []
    for i, p in enumerate(t.placements):
        if p.is_partial():
            raise NotImplementedError(f"a {describe(t)} holds pending sums (Partial): redistribute it to Shard or "
                                      "Replicate placements first")
        if not p.is_replicate():
            dims.append(i)
    return tuple(dims)


def _check_row_sharding(t, where: str, what: str) -> None:
    """Only plain Shard and Replicate placements cut a tensor into blocks of rows that compute_local_shape_
    and_global_offset describes; _StridedShard (FSDP2 over tensor parallel) interleaves them."""
    if any(type(p).__name__ == "_StridedShard" for p in t.placements):
        raise NotImplementedError(f"{where}: {what} needs a DTensor whose shards are blocks of the global tensor, "
                                  f"got a {describe(t)} (strided sharding)")


def mesh_ranks(mesh) -> frozenset:
    return frozenset(int(r) for r in mesh.mesh.flatten().tolist())


def check_same_spec(where: str, p, g) -> None:
    """A DTensor param's grad must be a DTensor on the same mesh with the same placements and local shape
    (the kernels pair their shards element by element)."""
    if not is_dtensor(g):
        raise TypeError(f"{where}: the param is a {describe(p)} but its grad is a plain {type(g).__name__}; "
                        "a DTensor param needs a DTensor grad with its placements")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(f"{where}: the grad is a {describe(g)} but the param is a {describe(p)}; the fused update "
                         "pairs local shards element by element, so both need the same mesh and placements "
                         "(redistribute the grad)")
    if g.shape != p.shape or local(g).shape != local(p).shape:
        raise ValueError(f"{where}: grad shape {tuple(g.shape)} (local {tuple(local(g).shape)}) differs from param shape "
                         f"{tuple(p.shape)} (local {tuple(local(p).shape)})")


def flat_offset(t, where: str) -> int:
    """The row-major index, in the global tensor, of the first element of ``t``'s local shard, when that
    shard is one contiguous range of the global tensor (dim-0 sharding, FSDP2's, or replication); a
    NotImplementedError otherwise. Stochastic rounding keys each element's random bits by this global
    index, so that a result does not depend on how the params are sharded."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _check_row_sharding(t, where, "rounding='stochastic'")
    shape = tuple(t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
    if not local(t).is_contiguous():
        raise NotImplementedError(f"{where}: rounding='stochastic' needs a DTensor param whose local shard is "
                                  f"contiguous, got strides {local(t).stride()}")
    if 0 in local_shape:
        return 0
    first = next((d for d in range(len(shape)) if local_shape[d] != shape[d]), None)
    if first is None:  # the whole tensor (replicated)
        return 0
    contiguous = (all(shape[d] == 1 for d in range(first))
                  and all(local_shape[d] == shape[d] for d in range(first + 1, len(shape))))
    if not contiguous:
        raise NotImplementedError(f"{where}: rounding='stochastic' keys each element by its index in the global "
                                  f"param, which needs a local shard that is one contiguous range of it (sharding "
                                  f"on dim 0, as FSDP2 does), got a {describe(t)}")
    index, stride = 0, 1
    for d in reversed(range(len(shape))):
        index += offset[d] * stride
        stride *= shape[d]
    return index


def shard_like(full: torch.Tensor, ref) -> "torch.Tensor":
    """The DTensor with ``ref``'s mesh and placements whose global value is ``full`` (a plain tensor of
    ref's global shape), built from this rank's slice of ``full``: no communication. The local shard takes
    the memory layout of ref's (the kernels pair them element by element)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ._layout import is_dense, like

    _check_row_sharding(ref, "loading a state tensor", "cutting a whole tensor into shards")
    local_shape, offset = compute_local_shape_and_global_offset(tuple(ref.shape), ref.device_mesh, ref.placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
    lref = local(ref)
    piece = like(piece, lref, full.dtype) if is_dense(lref) else piece.to(device=lref.device).contiguous()
    return type(ref).from_local(piece, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                stride=ref.stride())


def all_reduce_max(flag: torch.Tensor, mesh=None, group=None, skip_dims: tuple[int, ...] = ()) -> None:
    """MAX of a flag over every rank of ``mesh`` (one collective per mesh dim of size > 1, except
    ``skip_dims``: reduced already) or of ``group``."""
    import torch.distributed as dist

    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return
    for d in range(mesh.ndim):
        if mesh.size(d) > 1 and d not in skip_dims:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(d))


def all_reduce_sum(value: torch.Tensor, mesh, dims: tuple[int, ...]) -> None:
    """SUM of ``value`` over the mesh dims ``dims`` (one collective per dim of size > 1)."""
    import torch.distributed as dist

    for d in dims:
        if mesh.size(d) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group(d))


def covers(outer, inner) -> bool:
    """Whether every rank of mesh ``inner`` is a rank of mesh ``outer`` (a mesh covers its sub-meshes)."""
    return inner == outer or mesh_ranks(inner) <= mesh_ranks(outer)


def common_mesh(meshes) -> Optional[object]:
    """The one mesh among ``meshes`` that covers all others, or None."""
    meshes = list(dict.fromkeys(meshes))
    for m in meshes:
        if all(covers(m, other) for other in meshes):
            return m
    return None
