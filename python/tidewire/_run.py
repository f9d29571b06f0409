"""``tidewire.run``: Horovod's ``horovod.run`` for one host (a function run on
``np`` local processes, each a rank of one Tidewire job)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import socket
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._native import TidewireError

_LAUNCHED = ("TIDEWIRE_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
_LOCAL = ("localhost", "127.0.0.1", "::1", socket.gethostname())


def _child(rank: int, env: Dict[str, str], func: Callable[..., Any], args: Sequence[Any],
           kwargs: Dict[str, Any], out: Any) -> None:
    os.environ.update(env)
    try:
        result = func(*args, **kwargs)
        out.put((rank, True, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _slots(hosts: Optional[str], np: int) -> None:
    """Checks that ``hosts`` names this host only, with room for ``np`` slots."""
    if hosts is None:
        return
    total = 0
    for h in hosts.split(","):
        name, _, n = h.strip().rpartition(":")
        if not name:
            name, n = n, "1"
        if name not in _LOCAL:
            raise ValueError(f"hosts={hosts!r}: tidewire.run starts processes on this host only (got {name!r}); "
                             "use torchrun, Slurm or mpirun for several hosts")
        total += int(n)
    if total < np:
        raise ValueError(f"hosts={hosts!r} has {total} slots for np={np}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    np: int = 1,
    hosts: Optional[str] = None,
    use_gloo: Optional[bool] = None,
    use_mpi: Optional[bool] = None,
    start_timeout: Optional[float] = None,
    verbose: Optional[int] = None,
    **unsupported: Any,
) -> List[Any]:
    """Horovod's ``horovod.run`` on this host: runs ``func(*args, **kwargs)``
    in ``np`` new local processes (multiprocessing's *spawn*: ``func`` and its
    arguments are pickled), each a rank of one Tidewire job (its
    ``TIDEWIRE_RANK``, ``TIDEWIRE_WORLD_SIZE``, ``TIDEWIRE_LOCAL_RANK``,
    ``TIDEWIRE_MASTER`` on 127.0.0.1 and a fresh ``TIDEWIRE_SECRET`` are set
    before ``func`` runs, so ``tidewire.torch.init()`` inside it joins the
    job), and returns their return values in rank order. A rank that raises
    makes ``run`` raise :class:`TidewireError` with its traceback, after the
    other ranks end.

    ``hosts`` may only name this host (``"localhost:4"``). ``use_mpi=True``
    and ``use_gloo=True`` raise ValueError (Tidewire uses neither), and so do
    Horovod's other arguments (elastic ``min_np``/``max_np``, ``hostfile``,
    ssh settings, ...) when given. Under a launcher (torchrun, Slurm, mpirun,
    ``tidewire train``) the process is already a rank, and ``run`` raises
    :class:`TidewireError`: call ``func`` directly there. ``start_timeout``:
    seconds each rank's result may take (default: no limit); ``verbose`` is
    accepted and unused."""
    given = {k: v for k, v in unsupported.items() if v is not None}
    if given:
        raise ValueError(f"tidewire.run does not support {sorted(given)} (local processes only, no elastic mode)")
    if use_mpi:
        raise ValueError("use_mpi=True: Tidewire does not use MPI")
    if use_gloo:
        raise ValueError("use_gloo=True: Tidewire does not use Gloo (its own engine runs the collectives)")
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"np={np!r}: want an int >= 1")
    launched = [k for k in _LAUNCHED if k in os.environ]
    if launched:
        raise TidewireError(
            f"tidewire.run starts its own {np} processes, but this process is already a rank of a launched job "
            f"({launched[0]} is set, e.g. by torchrun): call the function directly instead"
        )
    _slots(hosts, np)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, secret = _free_port(), secrets.token_hex(16)
    procs = []
    for r in range(np):
        env = {"TIDEWIRE_RANK": str(r), "TIDEWIRE_WORLD_SIZE": str(np), "TIDEWIRE_LOCAL_RANK": str(r),
               "TIDEWIRE_LOCAL_SIZE": str(np), "TIDEWIRE_MASTER": f"127.0.0.1:{port}", "TIDEWIRE_SECRET": secret}
        p = ctx.Process(target=_child, args=(r, env, func, tuple(args), dict(kwargs or {}), out), daemon=False)
        p.start()
        procs.append(p)
    return _collect(procs, out, np, start_timeout)


def _collect(procs: List[Any], out: Any, np: int, timeout: Optional[float]) -> List[Any]:
    results: Dict[int, Tuple[bool, Any]] = {}
    try:
        while len(results) < np:
            try:
                r, ok, value = out.get(timeout=timeout if timeout is not None else 1.0)
            except queue.Empty:
                if timeout is not None:
                    raise TidewireError(f"tidewire.run: no result from {np - len(results)} rank(s) in {timeout} s")
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise TidewireError(f"tidewire.run: rank {dead[0]} died (exit code {procs[dead[0]].exitcode})")
                continue
            results[r] = (ok, value)
    finally:
        for p in procs:
            p.join(5.0 if len(results) == np else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    failed = sorted(r for r, (ok, _) in results.items() if not ok)
    if failed:
        raise TidewireError(f"tidewire.run: rank {failed[0]} failed: {results[failed[0]][1]}")
    return [results[r][1] for r in range(np)]
