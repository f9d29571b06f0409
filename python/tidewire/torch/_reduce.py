"""The exact arithmetic behind Horovod's collectives: reductions, gathers and
their checks, run as one job each on the collective worker (``_Util.call``).

Two paths move the values:

- float32, float16 and bfloat16 with Sum or Average go through the servers'
  float32 sum (``push_pull``'s path): widened to float32 exactly, summed in
  rank order, Average multiplied by ``1/size`` rounded to float32 (the
  servers' ``ApplyOp::Mean``), then rounded once to the tensor's dtype;
- everything else (float64, the integer types, and Min, Max, Product for every
  dtype) is gathered bit for bit (each rank's bytes as 16-bit digits, which a
  float32 sum with zeros carries exactly) and reduced on every rank in the
  tensor's own dtype, in rank order: int64 sums are exact (wrapping on
  overflow, as integers do), float64 sums round like a float64 loop over the
  ranks, and every rank computes the same bits.

Adasum (float32, float64, float16) is gathered the same way and combined on
every rank by Horovod's pairwise rule over its power-of-two tree (``_adasum``).
"""

from __future__ import annotations

import enum
import io
import math
import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .._native import TidewireError
from ._collectives import _allgather_small, _from_digits, _to_digits
from ._runtime import _require
from ._utility import _OP_ALLGATHER, _OP_SUM, _PATH_DIGITS, _PATH_VALUES, _TAG_DTYPES, _tag, _untag


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations (the same numbers as Horovod's)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


_GATHER = 6  # the tag's "op" of a plain gather

#: Float types the servers' float32 sum carries exactly (widened without rounding).
_VIA_F32 = (torch.float32, torch.float16, torch.bfloat16)


def _resolve_op(op: Any, average: Optional[bool]) -> ReduceOp:
    """``op``, or the deprecated ``average`` flag (None: Average)."""
    if op is not None and average is not None:
        raise ValueError("pass op= or the deprecated average=, not both")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if isinstance(op, bool) or not isinstance(op, int):
        raise ValueError(f"op={op!r}: want tidewire.torch.Average, Sum, Adasum, Min, Max or Product")
    try:
        return ReduceOp(int(op))
    except ValueError:
        raise ValueError(f"op={op!r}: want tidewire.torch.Average, Sum, Adasum, Min, Max or Product") from None


#: The dtypes Horovod's Adasum takes (its CPU kernels: float16 in its AVX/F16C/FMA builds, which x86 builds are).
_ADASUM_DTYPES = (torch.float32, torch.float64, torch.float16)


def _check_adasum(op: ReduceOp, size: int, dtype: torch.dtype, what: str) -> ReduceOp:
    """Horovod's checks of ``op=Adasum``, in the caller (every rank raises the
    same): of one rank it is the tensor itself (a Sum of one, any dtype); with
    more, the world size must be a power of two and the dtype float32, float64
    or float16."""
    if op != ReduceOp.ADASUM:
        return op
    if size == 1:
        return ReduceOp.SUM
    if size & (size - 1):
        raise NotImplementedError(
            f"{what}: op=Adasum with {size} ranks: Horovod's Adasum combines the ranks pairwise over a binary "
            "tree (0 with 1, 2 with 3, then the pairs' results, ...) and refuses a world size that is not a power "
            "of two ('Running Adasum with non-power of 2 ranks is not supported yet'); Tidewire keeps that "
            "restriction rather than invent a tree Horovod does not define"
        )
    if dtype not in _ADASUM_DTYPES:
        raise TypeError(
            f"{what}: op=Adasum of {dtype}: Horovod's Adasum takes float32, float64 and float16 only "
            "(its kernels raise 'Unsupported data type' for the others)"
        )
    return op


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} wants a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported (densify with .to_dense())")
    if tensor.dtype not in _TAG_DTYPES:
        raise TypeError(f"{what}: {tensor.dtype} is not supported (float32/64/16, bfloat16, int8-64, uint8, bool)")
    return tensor


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values now, on the CPU, contiguous (a copy the caller may not change)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


# --------------------------------------------------------------------------- gathers


def _gather_equal(flat: torch.Tensor, tag: int, name: Optional[str], op: int = _OP_ALLGATHER) -> List[torch.Tensor]:
    """Every rank's ``flat`` (the same dtype and element count on every rank), bit for bit."""
    env, util = _require()
    d = _to_digits(flat)
    k = d.numel()
    data = torch.zeros(env.size * k, dtype=torch.float32)
    data[env.rank * k : (env.rank + 1) * k] = d
    out = util.run(op, _PATH_DIGITS, tag, flat.numel(), name, data, env.size * k)
    return [_from_digits(out[r * k : (r + 1) * k], flat) for r in range(env.size)]


def _gather_ints(values: Sequence[int], name: str) -> List[List[int]]:
    """Every rank's int64 ``values`` (the same count on every rank)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    return [r.tolist() for r in _gather_equal(t, _tag(torch.int64, _GATHER), name)]


def _gather_rows(t: torch.Tensor, name: Optional[str], what: str) -> Tuple[List[torch.Tensor], List[int]]:
    """Every rank's ``t`` (same dtype and trailing dimensions; the first may
    differ), bit for bit, and each one's first dimension. Three rounds: dtype
    and rank of the shape, the shapes, the bytes."""
    env, util = _require()
    base = name or what
    if t.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension (the one it concatenates)")
    tag = _tag(t.dtype, _GATHER)
    meta = _allgather_small([t.dim(), tag], f"{base}/meta")
    if any(m != meta[0] for m in meta):
        rows = "; ".join(f"rank {r}: {m[0]} dimensions, {_untag(m[1])}" for r, m in enumerate(meta))
        raise TidewireError(f"{what}: the ranks' tensors differ in dtype or number of dimensions ({rows})")
    shapes = _gather_ints(list(t.shape), f"{base}/shape")
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise TidewireError(
            f"{what}: the ranks' tensors differ beyond the first dimension: "
            + "; ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(shapes))
        )
    likes = [torch.empty(s, dtype=t.dtype) for s in shapes]
    lens = [(x.numel() * x.element_size() + 1) // 2 for x in likes]
    at = [sum(lens[:r]) for r in range(env.size)]
    total = sum(lens)
    data = torch.zeros(total, dtype=torch.float32)
    data[at[env.rank] : at[env.rank] + lens[env.rank]] = _to_digits(t)
    out = util.run(_OP_ALLGATHER, _PATH_DIGITS, tag, total, f"{base}/data", data, total)
    parts = [_from_digits(out[a : a + n], x) for a, n, x in zip(at, lens, likes)]
    return parts, [s[0] for s in shapes]


def _allgather_now(t: torch.Tensor, name: Optional[str]) -> torch.Tensor:
    parts, _ = _gather_rows(t, name, "allgather")
    return torch.cat(parts, 0)


def _allgather_object_now(obj: Any, name: Optional[str]) -> List[Any]:
    b = io.BytesIO()
    torch.save(obj, b)
    payload = torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)
    parts, _ = _gather_rows(payload, name or "allgather_object", "allgather_object")
    return [torch.load(io.BytesIO(p.numpy().tobytes()), weights_only=False) for p in parts]


# --------------------------------------------------------------------------- reductions


def _scale(x: torch.Tensor, f: float) -> torch.Tensor:
    return x if f == 1.0 else x.mul_(f)


def _average_(acc: torch.Tensor, size: int, postscale: float) -> torch.Tensor:
    """``acc`` times 1/size (rounded in its dtype, as the servers' mean), then
    ``postscale``; integers: divided by size, truncated toward zero."""
    if not acc.dtype.is_floating_point:
        return torch.div(acc, size, rounding_mode="trunc")
    inv = torch.tensor(1.0, dtype=acc.dtype) / size
    return _scale(acc.mul_(inv), postscale)


def _reduce_rows(rows: List[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The rows combined in rank order, in their own dtype."""
    acc = rows[0].clone()
    for r in rows[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            acc += r
        elif op == ReduceOp.MIN:
            acc = torch.minimum(acc, r)
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, r)
        else:
            acc *= r
    return acc


# --------------------------------------------------------------------------- Adasum

#: Horovod's threshold (``sqrt(DBL_MIN)``, 2**-511): a squared norm below it leaves its coefficient at 1.
_SQRT_DBL_MIN = math.sqrt(sys.float_info.min)


def _sum64(x: torch.Tensor) -> float:
    """The float64 sum of ``x`` in element order, as Horovod's loop
    ``s = 0.; s += x[i]`` rounds it: ``cumsum`` runs one sequential loop
    (``sum`` would not: its order follows the vector unit)."""
    if x.numel() == 0:
        return 0.0
    return 0.0 + float(torch.cumsum(x, 0)[-1])


def _fma32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """float32 ``fma(x, y, z)``, rounded once as the FMA instruction rounds:
    ``x*y`` is exact in float64, the sum is rounded to odd in float64 (the
    TwoSum error says which way the nearest rounding lost), and rounding to
    odd with 53 >= 24 + 2 bits makes the rounding to float32 exact (Boldo and
    Melquiond)."""
    p = x.double() * y.double()
    zz = z.double()
    s = p + zz
    bb = s - p
    err = (p - (s - bb)) + (zz - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.tensor(math.inf, dtype=torch.float64),
                         torch.tensor(-math.inf, dtype=torch.float64))
    s = torch.where((err != 0) & torch.isfinite(err) & even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def _scale_adasum(x: torch.Tensor, f: float) -> torch.Tensor:
    """Horovod's ``ScaleBuffer``: float64 times ``f``; float32 times ``(float)f``;
    float16 widened to float32, times ``(float)f``, rounded to float16."""
    if f == 1.0:
        return x
    if x.dtype == torch.float64:
        return x * f
    f32 = torch.tensor(f, dtype=torch.float64).to(torch.float32)
    return (x.float() * f32).to(x.dtype)


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Horovod's pairwise Adasum of two flat tensors of one dtype (``a`` from
    the lower ranks): with ``d = a.b``, ``|a|^2``, ``|b|^2`` summed in float64
    in element order, ``ca = 1 - d/|a|^2 * 0.5`` (1 when ``|a|^2 < 2**-511``),
    likewise ``cb``; float32/float64: ``ca*a + cb*b`` in float64, rounded once
    to the dtype; float16 (Horovod's F16C path): ``fma(float(cb), b,
    float(ca)*a)`` in float32, rounded to float16."""
    a64, b64 = a.double(), b.double()
    dot, an, bn = _sum64(a64 * b64), _sum64(a64 * a64), _sum64(b64 * b64)
    ca = 1.0 - dot / an * 0.5 if an >= _SQRT_DBL_MIN else 1.0
    cb = 1.0 - dot / bn * 0.5 if bn >= _SQRT_DBL_MIN else 1.0
    if a.dtype == torch.float16:
        ca32 = torch.tensor(ca, dtype=torch.float64).to(torch.float32)
        cb32 = torch.tensor(cb, dtype=torch.float64).to(torch.float32)
        return _fma32(cb32, b.float(), a.float() * ca32).to(torch.float16)
    return (a64 * ca + b64 * cb).to(a.dtype)


def _adasum_tree(rows: List[torch.Tensor]) -> torch.Tensor:
    """The ranks' tensors (a power of two of them, in rank order) combined as
    Horovod's vector-halving distance-doubling levels combine them: 0 with 1,
    2 with 3, ..., then (0,1) with (2,3), ...; each level's result is rounded to
    the dtype before the next."""
    level = list(rows)
    while len(level) > 1:
        level = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _adasum_now(
    flats: Sequence[torch.Tensor], prescale: float, postscale: float, name: Optional[str]
) -> List[torch.Tensor]:
    """Adasum of each flat tensor (one dtype) over every rank, each tensor on
    its own (its own dot products and norms, as Horovod's fused buffer keeps
    one per tensor), in one gather. Every rank computes the same bits."""
    counts = [f.numel() for f in flats]
    mine = torch.cat([_scale_adasum(f.reshape(-1), prescale) for f in flats])
    rows = _gather_equal(mine, _tag(mine.dtype, int(ReduceOp.ADASUM)), name)
    out, at = [], 0
    for n in counts:
        out.append(_scale_adasum(_adasum_tree([r[at : at + n] for r in rows]), postscale))
        at += n
    return out


def _allreduce_now(
    t: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, name: Optional[str]
) -> torch.Tensor:
    """``t`` (a CPU snapshot) reduced over every rank; a new tensor of its dtype and shape."""
    env, util = _require()
    floating = t.dtype.is_floating_point
    if (prescale != 1.0 or postscale != 1.0) and not floating:
        raise ValueError(f"prescale_factor/postscale_factor apply to floating-point tensors, not {t.dtype}")
    if t.dtype == torch.bool and op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.PRODUCT):
        raise TypeError(f"allreduce of bool tensors: only Min and Max (and, or), not {op.name.title()}")
    if op == ReduceOp.ADASUM:
        return _adasum_now([t.reshape(-1)], prescale, postscale, name)[0].reshape(t.shape)
    flat = _scale(t.reshape(-1).clone(), prescale) if prescale != 1.0 else t.reshape(-1)
    tag = _tag(t.dtype, int(op))
    if t.dtype in _VIA_F32 and op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        n = flat.numel()
        out = util.run(_OP_SUM, _PATH_VALUES, tag, n, name, flat.to(torch.float32), n)
        out = _average_(out, env.size, postscale) if op == ReduceOp.AVERAGE else _scale(out, postscale)
        return out.to(t.dtype).reshape(t.shape)
    acc = _reduce_rows(_gather_equal(flat, tag, name), op)
    if op == ReduceOp.AVERAGE:
        acc = _average_(acc, env.size, postscale)
    elif floating:
        acc = _scale(acc, postscale)
    return acc.reshape(t.shape)


def _split_rows(d0: int, size: int) -> List[int]:
    """Horovod's reducescatter split: ``d0 // size`` rows each, one more for the first ``d0 % size`` ranks."""
    return [d0 // size + (1 if r < d0 % size else 0) for r in range(size)]


def _reducescatter_now(
    t: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, name: Optional[str]
) -> torch.Tensor:
    env, _ = _require()
    if t.dim() == 0:
        raise ValueError("reducescatter: the tensor needs at least one dimension (the one it splits)")
    full = _allreduce_now(t, op, prescale, postscale, name)
    rows = _split_rows(t.shape[0], env.size)
    start = sum(rows[: env.rank])
    return full[start : start + rows[env.rank]].clone()


def _alltoall_now(
    t: torch.Tensor, splits: Optional[List[int]], name: Optional[str]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows from every rank, and how many came from each."""
    env, _ = _require()
    base = name or "alltoall"
    if splits is None:
        splits = [t.shape[0] // env.size] * env.size
    parts, _ = _gather_rows(t, base, "alltoall")
    every = _gather_ints(splits, f"{base}/splits")
    me = env.rank
    got = []
    for r, (part, s) in enumerate(zip(parts, every)):
        start = sum(s[:me])
        got.append(part[start : start + s[me]])
    received = torch.tensor([s[me] for s in every], dtype=torch.int32)
    return torch.cat(got, 0), received


def _check_splits(t: torch.Tensor, splits: Any, size: int) -> Optional[List[int]]:
    """``splits`` as a list of ``size`` row counts adding up to the first dimension (None: equal parts)."""
    if t.dim() == 0:
        raise ValueError("alltoall: the tensor needs at least one dimension (the one it splits)")
    d0 = t.shape[0]
    if splits is None:
        if d0 % size:
            raise ValueError(f"alltoall without splits: the first dimension ({d0}) must divide by size() ({size})")
        return None
    s = [int(x) for x in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(s) != size or any(x < 0 for x in s) or sum(s) != d0:
        raise ValueError(f"alltoall: splits={s} must be {size} counts >= 0 adding up to the first dimension ({d0})")
    return s
