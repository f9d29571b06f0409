"""BytePS's ``suspend`` and ``resume``: end every session of the job cleanly,
and start them again with the same world (in-place resizing is not there)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._native import TidewireError
from ._env import _Env
from ._runtime import _require, _state, init, shutdown


class _Suspended:
    """What :func:`suspend` ended (kept in ``_state.suspended``): the job's env
    and topology, which the rank and size queries answer from meanwhile, and
    the optimizers to rebuild."""

    def __init__(self, env: _Env, topology: Any, optimizers: List[Any]) -> None:
        self.env = env
        self.topology = topology
        self.optimizers = optimizers
        self.size = env.size
        self.rank = env.rank
        self.local_size: int = topology.local_size


def suspend() -> None:
    """BytePS's ``suspend``: stops communicating. Every DistributedOptimizer
    pulls its layers (so the parameters are final) and ends its session, and
    the utility session ends, as in :func:`shutdown`; :func:`resume` starts
    them again. Collective: every rank calls it. While suspended,
    :func:`rank`, :func:`size`, :func:`local_rank`, :func:`local_size` (as in
    BytePS) answer for the job that was, and collectives raise
    :class:`TidewireError` (not initialized)."""
    env, _ = _require()
    with _state.lock:
        opts = [o for o in _state.optimizers if not o._tw.closed]
        held = _Suspended(env, _state.topology, opts)
    shutdown()
    _state.suspended = held


def _reason(s: _Suspended, num_workers: Any, num_servers: Any, global_rank: Any) -> Optional[str]:
    """Why this rank cannot resume as asked, or None."""
    nodes = s.size // s.local_size if s.local_size and s.size % s.local_size == 0 else None
    if not isinstance(num_workers, int) or num_workers not in (s.size, nodes):
        return (
            f"num_workers={num_workers!r}, but the job has {s.size} workers"
            + (f" ({nodes} host{'s' if nodes != 1 else ''} of {s.local_size})"
               if nodes is not None and nodes != s.size else "")
            + ": Tidewire resumes with the same workers; changing their number in place is not supported "
            "yet (restart the job with the new number, e.g. with torchrun)"
        )
    if not isinstance(num_servers, int) or num_servers < 0:
        return f"num_servers={num_servers!r}: want an int >= 0"
    if global_rank is not None and global_rank != s.rank:
        return (
            f"global_rank={global_rank!r} on rank {s.rank}: Tidewire keeps each process's rank (the launcher's) "
            "across suspend and resume; renumbering ranks is not supported"
        )
    return None


def resume(num_workers: int, num_servers: int, global_rank: Optional[int] = None, context: Any = None) -> None:
    """BytePS's ``resume``: after :func:`suspend`, joins the job again and
    rebuilds every DistributedOptimizer that was suspended (in their creation
    order; each keeps its parameters, optimizer state and layer table, and
    its session starts from rank 0's current parameters), so training goes on.

    The world is the one :func:`suspend` left: ``num_workers`` must be the
    number of workers (``size()``), or the number of hosts when each runs
    ``local_size()`` of them (BytePS's ``DMLC_NUM_WORKER`` counts machines).
    ``num_servers`` is accepted and changes nothing: every Tidewire rank
    holds one shard of the servers, so their number is the workers'.
    ``global_rank`` must be None or this process's rank; ``context`` is
    accepted and unused (BytePS does not use it either). Collective: the
    ranks first join again, then compare their arguments; when any rank's
    cannot be honoured, every rank raises the same :class:`TidewireError`
    (naming the rank and why) and the job stays suspended."""
    s = _state.suspended
    if s is None:
        raise TidewireError("resume() without suspend(): the job is not suspended")
    for o in s.optimizers:
        why = o._tw.reopen_refusal()
        if why is not None:
            raise TidewireError(f"resume(): cannot rebuild a suspended DistributedOptimizer: {why}")
    init()
    from ._horovod import allgather_object

    reasons = allgather_object(_reason(s, num_workers, num_servers, global_rank), name="resume")
    by_reason: Dict[str, List[int]] = {}
    for r, why in enumerate(reasons):
        if why is not None:
            by_reason.setdefault(why, []).append(r)
    refused = [f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {why}" for why, rs in by_reason.items()]
    if refused:
        shutdown()
        _state.suspended = s
        raise TidewireError("resume() refused; the job stays suspended. " + "; ".join(refused))
    env, _ = _require()
    for o in s.optimizers:
        o._tw.reopen(env)
        with _state.lock:
            _state.optimizers.append(o)
