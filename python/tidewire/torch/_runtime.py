"""The process's global state: :func:`init`, :func:`shutdown`, :func:`rank` and the rest."""

from __future__ import annotations

import atexit
import threading
import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

from .._native import TidewireError
from ._env import _Env, _read_env
from ._utility import _Util


# --------------------------------------------------------------------------- global state


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.env: Optional[_Env] = None
        self.util: Optional[_Util] = None
        self.next_index = 0
        self.optimizers: List[Any] = []
        self.atexit = False
        #: Every rank's local rank and host (``_probes._Topology``), gathered by init().
        self.topology: Any = None
        #: While BytePS's suspend() holds the job (``_suspend._Suspended``): the env
        #: and topology it had, which rank(), size() and the other queries still
        #: answer from, and the optimizers resume() rebuilds.
        self.suspended: Any = None


_state = _State()


def _require() -> Tuple[_Env, "_Util"]:
    env, util = _state.env, _state.util
    if env is None or util is None:
        raise TidewireError("tidewire.torch is not initialized: call tidewire.torch.init() first")
    return env, util


def _identity() -> _Env:
    """Who this process is: the job's env, or while suspended the one it had."""
    env = _state.env
    if env is None and _state.suspended is not None:
        return _state.suspended.env
    return env if env is not None else _require()[0]


def _new_index() -> int:
    with _state.lock:
        i = _state.next_index
        _state.next_index += 1
        return i


def init(
    *,
    secret: Union[str, bytes, None] = None,
    master: Optional[str] = None,
    timeout: Optional[float] = None,
    local_aggregation: Optional[bool] = None,
) -> None:
    """Joins the job: reads the launcher's environment (see the module docs)
    and builds the utility session that :func:`push_pull` and the broadcasts
    use. Collective. Calling it again while initialized does nothing.

    ``secret`` overrides ``TIDEWIRE_SECRET``, ``master`` (``host:port``)
    ``TIDEWIRE_MASTER``, ``timeout`` (seconds) ``TIDEWIRE_TIMEOUT``.

    ``local_aggregation=True`` (or ``TIDEWIRE_LOCAL_AGGREGATION=1``) is
    Nexus's local aggregation: the ``LOCAL_WORLD_SIZE`` processes of a node
    (one per GPU, as torchrun starts them) hand their gradients to local rank
    0 through shared memory, which sums them and pushes once for the node, and
    they read the parameters back from a cache there
    (``TIDEWIRE_CACHE_STALENESS=S`` lets them take a version up to S old
    instead of waiting). The node's NIC carries one copy instead of
    ``LOCAL_WORLD_SIZE``; the results equal a job without it. Every layer
    syncs through the PS (no ``sfb=``). :func:`rank`, :func:`size` and
    :func:`local_rank` keep counting processes.
    """
    with _state.lock:
        if _state.util is not None:
            return
        env = _read_env(secret, master, timeout, local_aggregation)
        util = _Util(env, _new_index())
        _state.env, _state.util = env, util
        _state.suspended = None
        from ._probes import _gather_topology

        try:
            _state.topology = _gather_topology()
        except BaseException:
            _state.env = _state.util = None
            util.close()
            raise
        if not _state.atexit:
            atexit.register(_atexit)
            _state.atexit = True


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _state.util is not None


def rank() -> int:
    """This process's rank (0 .. size()-1). Answers while suspended (BytePS's suspend)."""
    return _identity().rank


def size() -> int:
    """The number of ranks. Answers while suspended."""
    return _identity().size


def local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK``, ``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``; 0 when the launcher sets none): use it to
    pick a GPU. Answers while suspended."""
    return _identity().local_rank


def shutdown() -> None:
    """Ends every Tidewire session of this process: each DistributedOptimizer
    (its layers are pulled first, so the parameters are final) and the utility
    session. Collective: every rank must call it (it also runs at exit). The
    sessions end concurrently, so ranks need not agree on an order."""
    with _state.lock:
        opts = [o for o in _state.optimizers if not o._tw.closed]
        util = _state.util
        _state.optimizers = []
        _state.util = None
        _state.env = None
        _state.topology = None
        _state.suspended = None
    errors: List[BaseException] = []

    def run(f: Callable[[], None]) -> None:
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    jobs: List[Callable[[], None]] = [o._tw.close for o in opts]
    if util is not None:
        jobs.append(util.close)
    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _atexit() -> None:
    if _state.util is None and not _state.optimizers:
        return
    # At exit, do not hold the process forever for a peer that is gone: end
    # the sessions in the background and give them the timeout to finish.
    env = _state.env
    t = threading.Thread(target=lambda: _quiet(shutdown), daemon=True)
    t.start()
    t.join((env.timeout if env else 60.0) + 5.0)


def _quiet(f: Callable[[], None]) -> None:
    try:
        f()
    except Exception as e:  # noqa: BLE001 - exit path
        warnings.warn(f"tidewire.torch: shutdown at exit failed: {e}", RuntimeWarning, stacklevel=1)
