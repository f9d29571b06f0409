"""Horovod's and BytePS's collective functions on Tidewire's utility session:
allreduce (in place, async, grouped), allgather, allgather_object, broadcast's
async forms, alltoall, reducescatter, join, the async handles (poll,
synchronize), and BytePS's push_pull family. See ``_reduce`` for the arithmetic.

Every function here is collective: every rank calls the same ones, with the
same names, dtypes and element counts, in the same order. They run in the
order a rank called them: an async one is queued, and the queue runs (in the
caller's thread) before the next blocking collective and at ``poll`` or
``synchronize``.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ._collectives import _broadcast_flat
from ._compression import Compression, _check_compression
from ._reduce import (
    ReduceOp,
    _allgather_now,
    _allgather_object_now,
    _allreduce_now,
    _alltoall_now,
    _check_splits,
    _check_tensor,
    _GATHER,
    _gather_equal,
    _reducescatter_now,
    _check_adasum,
    _resolve_op,
    _snapshot,
)
from ._runtime import _require
from ._utility import _OP_JOIN, _tag

#: Horovod's reduction operations.
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

Handle = int


# --------------------------------------------------------------------------- handles


class _Pending:
    __slots__ = ("future", "finish")

    def __init__(self, future: "Future[Any]", finish: Callable[[Any], Any]) -> None:
        self.future = future
        self.finish = finish


_lock = threading.Lock()
_pending: Dict[int, _Pending] = {}
_ids = itertools.count(1)


def _launch(job: Callable[[], Any], finish: Callable[[Any], Any]) -> Handle:
    """Queues ``job``; ``finish`` turns its result into what :func:`synchronize` returns."""
    _, util = _require()
    fut = util.submit(job)
    with _lock:
        h = next(_ids)
        _pending[h] = _Pending(fut, finish)
    return h


def _run_queued() -> None:
    _, util = _require()
    util.run_queued()


def poll(handle: Handle) -> bool:
    """Whether the async operation ``handle`` has finished (then
    :func:`synchronize` returns without waiting). In this version the queued
    collectives run in the caller's thread: ``poll`` first runs every queued
    one (waiting for the other ranks to reach them) and so returns True."""
    with _lock:
        p = _pending.get(handle)
    if p is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    if not p.future.done():
        _run_queued()
    return p.future.done()


def synchronize(handle: Handle) -> Any:
    """Waits for the async operation ``handle`` and returns its result (the
    output tensor; for an in-place operation the tensor it was given, now
    holding the result; a list for grouped operations). Raises what the
    operation raised (:class:`TidewireError` when the ranks disagreed or a
    peer failed). A handle is synchronized once."""
    with _lock:
        p = _pending.pop(handle, None)
    if p is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    if not p.future.done():
        _run_queued()
    return p.finish(p.future.result())


def _to_like(like: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: out.to(device=like.device, dtype=like.dtype)


def _into(tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def finish(out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(out.reshape(tensor.shape))
        return tensor

    return finish


def _scales(prescale_factor: float, postscale_factor: float) -> Tuple[float, float]:
    pre, post = float(prescale_factor), float(postscale_factor)
    for what, v in (("prescale_factor", pre), ("postscale_factor", post)):
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"{what}={v}: want a finite number")
    return pre, post


def _reduce_job(
    tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
    prescale_factor: float, postscale_factor: float, what: str,
) -> Callable[[], torch.Tensor]:
    """Checks the arguments now (in the caller) and returns the job that reduces a snapshot."""
    env, _ = _require()
    _check_tensor(tensor, what)
    rop = _check_adasum(_resolve_op(op, average), env.size, tensor.dtype, what)
    pre, post = _scales(prescale_factor, postscale_factor)
    snap = _snapshot(tensor)
    return lambda: _allreduce_now(snap, rop, pre, post, name)


# --------------------------------------------------------------------------- allreduce


def allreduce_async(
    tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Starts :func:`allreduce` and returns a handle for :func:`poll` and
    :func:`synchronize` (which returns the new tensor). The values are taken
    when it is called: changing ``tensor`` afterwards does not change the result."""
    job = _reduce_job(tensor, average, name, op, prescale_factor, postscale_factor, "allreduce_async")
    return _launch(job, _to_like(tensor))


def allreduce_async_(
    tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Starts an in-place :func:`allreduce`: :func:`synchronize` writes the
    result into ``tensor`` and returns it. Until then ``tensor`` is unchanged."""
    job = _reduce_job(tensor, average, name, op, prescale_factor, postscale_factor, "allreduce_async_")
    return _launch(job, _into(tensor))


class _AllreduceFn(torch.autograd.Function):
    """allreduce as an autograd function: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Optional[str]) -> Any:
        ctx.args = (op, pre, post)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        op, pre, post = ctx.args
        return synchronize(allreduce_async(grad, None, None, op, pre, post)), None, None, None, None


def allreduce(
    tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
    compression: Any = Compression.none, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> torch.Tensor:
    """``tensor`` reduced over every rank, as a new tensor of its shape, dtype
    and device (Horovod's ``allreduce``). ``op``: :data:`Average` (default),
    :data:`Sum`, :data:`Adasum`, :data:`Min`, :data:`Max`, :data:`Product`.
    ``average`` is Horovod's deprecated flag (True: Average, False: Sum).

    :data:`Adasum` (float32, float64, float16; a power-of-two number of ranks,
    else NotImplementedError, as Horovod): Horovod's pairwise combination over
    its tree (rank 0 with 1, 2 with 3, then the pairs' results, ...), computed
    on every rank from every rank's gathered tensor: float64 dot products and
    squared norms in element order, ``a*(1 - a.b/|a|^2/2) + b*(1 - a.b/|b|^2/2)``
    in float64 rounded to the dtype (float16: in float32 with one FMA, as
    Horovod's F16C kernel). ``prescale_factor``/``postscale_factor`` scale each
    rank's tensor and the result in the dtype, as Horovod's ``ScaleBuffer``.
    It moves ``size()`` times the bytes of a sum.

    ``prescale_factor`` multiplies each rank's tensor before the sum and
    ``postscale_factor`` the result (floating-point tensors only). Average is
    the sum times 1/size rounded to the tensor's dtype (Tidewire's servers'
    mean), then ``postscale_factor``; an integer Average is the exact sum
    divided by size, truncated toward zero.

    Exactness: float32 (and float16/bfloat16, widened exactly) Sum and
    Average go through Tidewire's servers, which sum in float32 in rank order;
    float64, integers, Min/Max/Product and Adasum are gathered bit for bit and reduced
    in the tensor's own dtype in rank order, so int64 sums are exact (beyond
    2**53 too). Every rank gets the same bits.

    ``compression`` (:class:`Compression`): the tensor is compressed before the
    reduction and the result decompressed (``Compression.fp16``: rounded to
    float16, summed in float32, rounded to float16, cast back).

    Differentiable: with ``requires_grad`` the backward pass allreduces the
    gradient with the same ``op`` and factors (collective too)."""
    _check_compression(compression)
    _check_tensor(tensor, "allreduce")
    c, cctx = compression.compress(tensor)
    rop = _resolve_op(op, average)
    if torch.is_grad_enabled() and c.requires_grad:
        out = _AllreduceFn.apply(c, rop, prescale_factor, postscale_factor, name)
    else:
        out = synchronize(allreduce_async(c, None, name, rop, prescale_factor, postscale_factor))
    return compression.decompress(out, cctx)


def allreduce_(
    tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> torch.Tensor:
    """:func:`allreduce` in place: ``tensor`` gets the result, and is returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def _grouped_job(
    tensors: Sequence[torch.Tensor], average: Optional[bool], name: Optional[str], op: Any,
    prescale_factor: float, postscale_factor: float, what: str,
) -> Callable[[], List[torch.Tensor]]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what}: want a non-empty list of tensors")
    jobs = [
        _reduce_job(t, average, f"{name or what}/{i}", op, prescale_factor, postscale_factor, what)
        for i, t in enumerate(tensors)
    ]
    return lambda: [j() for j in jobs]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Starts :func:`grouped_allreduce`; :func:`synchronize` returns the list of results."""
    ts = list(tensors)
    job = _grouped_job(ts, average, name, op, prescale_factor, postscale_factor, "grouped_allreduce")
    return _launch(job, lambda outs: [_to_like(t)(o) for t, o in zip(ts, outs)])


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Starts :func:`grouped_allreduce_`; :func:`synchronize` writes each result into its tensor."""
    ts = list(tensors)
    job = _grouped_job(ts, average, name, op, prescale_factor, postscale_factor, "grouped_allreduce_")
    return _launch(job, lambda outs: [_into(t)(o) for t, o in zip(ts, outs)])


def grouped_allreduce(
    tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
    compression: Any = Compression.none, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> List[torch.Tensor]:
    """:func:`allreduce` of each tensor in ``tensors`` (one job, in list order:
    the values are exactly those of one allreduce each). Not differentiable."""
    _check_compression(compression)
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([c for c, _ in pairs], average, name, op,
                                               prescale_factor, postscale_factor))
    return [compression.decompress(o, cctx) for o, (_, cctx) in zip(outs, pairs)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> List[torch.Tensor]:
    """:func:`grouped_allreduce` in place: each tensor gets its result."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor))


# --------------------------------------------------------------------------- gathers, broadcasts, all-to-all


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Starts :func:`allgather`; :func:`synchronize` returns the concatenation."""
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather: the tensor needs at least one dimension (the one it concatenates)")
    snap = _snapshot(tensor)
    return _launch(lambda: _allgather_now(snap, name), _to_like(tensor))


class _AllgatherFn(torch.autograd.Function):
    """allgather as an autograd function (Horovod's backward: the averaged gradient's rows of this rank)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str]) -> Any:
        ctx.rows = tensor.shape[0]
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        env, _ = _require()
        reduced = synchronize(allreduce_async(grad, None, None, Average))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64)))
        start = int(rows[: env.rank].sum())
        return reduced.narrow(0, start, ctx.rows), None


def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank
    order (Horovod's ``allgather``): the ranks' tensors have the same dtype and
    the same dimensions after the first, which may differ. Bit for bit, every
    dtype. Differentiable like Horovod's."""
    if isinstance(tensor, torch.Tensor) and torch.is_grad_enabled() and tensor.requires_grad:
        return _AllgatherFn.apply(tensor, name)
    return synchronize(allgather_async(tensor, name))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None) -> Handle:
    """Starts :func:`grouped_allgather`."""
    ts = list(tensors)
    for t in ts:
        _check_tensor(t, "grouped_allgather")
    snaps = [_snapshot(t) for t in ts]
    job = lambda: [_allgather_now(s, f"{name or 'grouped_allgather'}/{i}") for i, s in enumerate(snaps)]  # noqa: E731
    return _launch(job, lambda outs: [_to_like(t)(o) for t, o in zip(ts, outs)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None) -> List[torch.Tensor]:
    """:func:`allgather` of each tensor in ``tensors``, in one job."""
    return synchronize(grouped_allgather_async(tensors, name))


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Every rank's ``obj`` (pickled with ``torch.save``), as a list in rank
    order. Only within one job: unpickling runs the other ranks' code."""
    _, util = _require()
    return util.call(lambda: _allgather_object_now(obj, name))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Starts :func:`broadcast`; :func:`synchronize` returns rank ``root_rank``'s tensor."""
    _check_tensor(tensor, "broadcast_async")
    snap = _snapshot(tensor)
    return _launch(lambda: _broadcast_flat([snap], root_rank, name)[0], _to_like(tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Starts :func:`broadcast_`; :func:`synchronize` writes rank ``root_rank``'s values into ``tensor``."""
    _check_tensor(tensor, "broadcast_async_")
    snap = _snapshot(tensor)
    return _launch(lambda: _broadcast_flat([snap], root_rank, name)[0], _into(tensor))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Handle:
    """Starts :func:`alltoall`; :func:`synchronize` returns what it returns."""
    env, _ = _require()
    _check_tensor(tensor, "alltoall")
    s = _check_splits(tensor, splits, env.size)
    snap = _snapshot(tensor)
    like = _to_like(tensor)
    if splits is None:
        return _launch(lambda: _alltoall_now(snap, s, name), lambda r: like(r[0]))
    return _launch(lambda: _alltoall_now(snap, s, name), lambda r: (like(r[0]), r[1]))


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Horovod's ``alltoall``: rank r sends ``splits[q]`` rows of ``tensor``
    (first dimension, in order) to each rank q, and gets back the rows every
    rank sent it, concatenated in rank order. Without ``splits`` the first
    dimension is split into ``size()`` equal parts (it must divide). Returns
    the tensor, and with ``splits`` also an int32 tensor of the rows received
    from each rank. Bit for bit. In this version every rank receives every
    rank's whole tensor (an allgather) and keeps its rows. Not differentiable."""
    return synchronize(alltoall_async(tensor, splits, name))


def reducescatter_async(
    tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Starts :func:`reducescatter`."""
    env, _ = _require()
    _check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: the tensor needs at least one dimension (the one it splits)")
    rop = _resolve_op(op, None)
    if rop == ReduceOp.ADASUM:
        if env.size > 1:
            raise ValueError(
                "reducescatter: op=Adasum is refused, as Horovod refuses it ('Reducescatter currently only "
                "supports AVERAGE and SUM'); use allreduce(op=Adasum) and keep your rows"
            )
        rop = ReduceOp.SUM
    pre, post = _scales(prescale_factor, postscale_factor)
    snap = _snapshot(tensor)
    return _launch(lambda: _reducescatter_now(snap, rop, pre, post, name), _to_like(tensor))


def reducescatter(
    tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none, op: Any = Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Horovod's ``reducescatter``: ``tensor`` reduced over every rank like
    :func:`allreduce` (default Average), and this rank's part of the first
    dimension returned: ``d0 // size`` rows each, one more for the first
    ``d0 % size`` ranks. The values equal allreduce's; in this version every
    rank computes the whole reduction and keeps its rows. Not differentiable."""
    _check_compression(compression)
    c, cctx = compression.compress(tensor)
    out = synchronize(reducescatter_async(c, name, op, prescale_factor, postscale_factor))
    return compression.decompress(out, cctx)


def join(device: int = -1) -> int:
    """Returns when every rank has called it, with the rank that called it
    last (by each rank's wall clock at its call: exact on one host, as good as
    the hosts' clock sync across hosts). Unlike Horovod, a rank that has
    joined does not stand in (with zeros) for the collectives the other ranks
    still run: a rank that calls another collective while some rank waits in
    ``join`` gets a :class:`TidewireError` naming the mismatch, on every rank.
    So every rank must process the same number of batches (``device`` is
    accepted and unused: Tidewire's collectives run on the CPU)."""
    env, util = _require()
    now = torch.tensor([time.time()], dtype=torch.float64)

    def job() -> int:
        rows = _gather_equal(now, _tag(torch.float64, _GATHER), "join", _OP_JOIN)
        times = [float(r[0]) for r in rows]
        return max(range(env.size), key=lambda r: (times[r], r))

    return util.call(job)


# --------------------------------------------------------------------------- BytePS


def push_pull(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, version: int = 0, priority: int = 0,
    compression: Any = Compression.none,
) -> torch.Tensor:
    """BytePS's ``push_pull``: the sum (``average=True``: the average) of
    ``tensor`` over every rank, as a new tensor of its shape, dtype and device:
    :func:`allreduce` with ``op=Sum`` or ``Average``, with its exactness
    (float32 through the servers' float32 sum in rank order, float64 and
    integers gathered and summed exactly in their dtype; an integer average is
    truncated toward zero). ``version`` and ``priority`` are accepted and have
    no effect (the collectives run in call order). Collective: every rank calls
    it with the same dtype, element count and ``name``, in the same order; a
    mismatch raises :class:`TidewireError` on every rank."""
    _check_tensor(tensor, "push_pull")
    return allreduce(tensor, None, name, compression, Average if average else Sum)


def push_pull_async_inplace(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, version: int = 0, priority: int = 0
) -> Handle:
    """BytePS's ``push_pull_async_inplace``: starts an in-place sum
    (``average=True``: average) of ``tensor`` over every rank; :func:`synchronize`
    writes the result into ``tensor``. ``version`` and ``priority`` are
    accepted and have no effect (the collectives run in call order)."""
    return allreduce_async_(tensor, None, name, Average if average else Sum)


def push_pull_inplace(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, version: int = 0, priority: int = 0
) -> torch.Tensor:
    """BytePS's ``push_pull_inplace``: :func:`push_pull` into ``tensor``."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


def push_pull_async(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, version: int = 0, priority: int = 0
) -> Handle:
    """BytePS's ``push_pull_async``: starts :func:`push_pull`."""
    return allreduce_async(tensor, None, name, Average if average else Sum)


def declare(name: str) -> int:
    """BytePS's ``declare``: BytePS gives each tensor name a key before its
    first push_pull. Tidewire needs no declaration (every collective checks
    every rank's name when it runs), so this only checks that ``name`` is a
    string; returns 0 like BytePS's."""
    if not isinstance(name, str):
        raise TypeError(f"declare wants a tensor name (str), got {type(name).__name__}")
    return 0
