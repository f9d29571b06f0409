"""The collectives on the utility session: the broadcasts, barrier, small allgathers
(push_pull and Horovod's collectives are in ``_horovod``)."""

from __future__ import annotations

import io
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .._native import TidewireError
from ._utility import _OP_ALLGATHER, _OP_BROADCAST, _OP_SUM, _PATH_DIGITS, _PATH_VALUES
from ._runtime import _require


def _flat_f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)


def _to_digits(t: torch.Tensor) -> torch.Tensor:
    """Any tensor's bytes as float32 values of its 16-bit digits (exact)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    nbytes = t.numel() * t.element_size()
    buf = torch.zeros(nbytes + (nbytes & 1), dtype=torch.uint8)
    if nbytes:
        buf[:nbytes] = t.view(torch.uint8)
    return buf.view(torch.int16).to(torch.float32)


def _from_digits(f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    b = f.to(torch.int16).view(torch.uint8)[:nbytes]
    return b.clone().view(like.dtype).reshape(like.shape)


def _broadcast_flat(tensors: Sequence[torch.Tensor], root_rank: int, name: Optional[str]) -> List[torch.Tensor]:
    """Rank ``root_rank``'s values of ``tensors``, packed into one collective."""
    env, util = _require()
    if not 0 <= root_rank < env.size:
        raise TidewireError(f"root_rank {root_rank} outside a world of {env.size}")
    tensors = list(tensors)
    if not tensors:
        return []
    exact = all(t.dtype == torch.float32 for t in tensors)
    root = env.rank == root_rank
    if exact:
        pieces = [_flat_f32(t) for t in tensors] if root else []
        lens = [t.numel() for t in tensors]
        path = _PATH_VALUES
    else:
        pieces = [_to_digits(t) for t in tensors] if root else []
        lens = [(t.numel() * t.element_size() + 1) // 2 for t in tensors]
        path = _PATH_DIGITS
    length = sum(lens)
    data = torch.cat(pieces) if root and length else None
    # x + 0 + ... + 0 is exact: the other ranks contribute zeros.
    out = util.run(_OP_BROADCAST, path, root_rank, length, name, data, length)
    res, at = [], 0
    for t, n in zip(tensors, lens):
        part = out[at : at + n]
        at += n
        if exact:
            res.append(part.reshape(t.shape))
        else:
            res.append(_from_digits(part, t))
    return res


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor``, as a new tensor (every dtype, bit for
    bit). Collective."""
    (out,) = _broadcast_flat([tensor], root_rank, name)
    return out.to(device=tensor.device, dtype=tensor.dtype)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None) -> torch.Tensor:
    """Overwrites ``tensor`` in place with rank ``root_rank``'s values, and returns it. Collective."""
    (out,) = _broadcast_flat([tensor], root_rank, name)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def broadcast_parameters(
    params: Union[Dict[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]], Iterable[torch.Tensor]],
    root_rank: int = 0,
    prefix: Optional[str] = None,
) -> None:
    """Overwrites every tensor in ``params`` in place with rank ``root_rank``'s
    values: ``model.state_dict()`` (parameters and buffers, taken in sorted
    key order), ``model.named_parameters()`` (in its order) or a list of
    tensors. Bit for bit, in one or two collectives (float32 tensors as
    values, the rest as bytes). Collective: every rank passes the same names
    and shapes. ``prefix`` (BytePS's argument) names the collectives; every
    rank must pass the same one."""
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = []
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor):
                items.append((str(i), p))
            else:
                k, v = p
                items.append((str(k), v))
    tensors = [v for _, v in items if isinstance(v, torch.Tensor)]
    f32 = [t for t in tensors if t.dtype == torch.float32]
    other = [t for t in tensors if t.dtype != torch.float32]
    for group, tag in ((f32, "f32"), (other, "bytes")):
        if not group:
            continue
        outs = _broadcast_flat(group, root_rank, f"{prefix or ''}broadcast_parameters/{tag}")
        with torch.no_grad():
            for t, o in zip(group, outs):
                t.copy_(o)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Rank ``root_rank``'s ``obj`` (pickled with ``torch.save``), returned on
    every rank; the other ranks' ``obj`` is ignored. Collective. Only use it
    within one job: unpickling runs code of rank 0's choosing."""
    env, _ = _require()
    payload = None
    if env.rank == root_rank:
        b = io.BytesIO()
        torch.save(obj, b)
        payload = torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)
    n = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    n = int(broadcast(n, root_rank, name=(name or "broadcast_object") + "/length").item())
    data = payload if payload is not None else torch.zeros(n, dtype=torch.uint8)
    data = broadcast(data, root_rank, name=(name or "broadcast_object") + "/data")
    if env.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None, prefix: Optional[str] = None
) -> None:
    """Gives every rank rank ``root_rank``'s optimizer state (``state_dict()``:
    momentum buffers, step counts, hyperparameters), loaded with
    ``load_state_dict`` on the other ranks. Works when the other ranks have no
    state yet (unlike Horovod's, it takes no zero-gradient step to create one).
    Collective. ``model`` (Horovod's, to find sparse parameters) is not needed
    and is ignored; ``prefix`` (BytePS's) names the collective."""
    env, _ = _require()
    sd = optimizer.state_dict() if env.rank == root_rank else None
    sd = broadcast_object(sd, root_rank, name=f"{prefix or ''}broadcast_optimizer_state")
    if env.rank != root_rank:
        optimizer.load_state_dict(sd)


def barrier() -> None:
    """Returns when every rank has called it. Collective."""
    _require()[1].run(_OP_SUM, _PATH_VALUES, 0, 0, "barrier", None, 0)


def _allgather_small(values: List[int], name: str) -> List[List[int]]:
    """Every rank's ``values`` (ints below 2**16, the same count on every rank)."""
    env, util = _require()
    k = len(values)
    data = torch.zeros(env.size * k, dtype=torch.float32)
    data[env.rank * k : (env.rank + 1) * k] = torch.tensor([float(v) for v in values])
    out = util.run(_OP_ALLGATHER, _PATH_VALUES, 0, k, name, data, env.size * k)
    return [[int(x) for x in out[r * k : (r + 1) * k].tolist()] for r in range(env.size)]


def _allgather_floats(values: List[float], name: str) -> List[List[float]]:
    """Every rank's ``values`` (the same count on every rank), as float32:
    every rank reads the same bits of each."""
    env, util = _require()
    k = len(values)
    data = torch.zeros(env.size * k, dtype=torch.float32)
    data[env.rank * k : (env.rank + 1) * k] = torch.tensor(values, dtype=torch.float32)
    out = util.run(_OP_ALLGATHER, _PATH_VALUES, 0, k, name, data, env.size * k)
    return [[float(x) for x in out[r * k : (r + 1) * k].tolist()] for r in range(env.size)]
