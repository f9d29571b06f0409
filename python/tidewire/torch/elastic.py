"""Horovod's elastic API (``hvd.elastic``) on Tidewire: :func:`run`,
:class:`State`, :class:`ObjectState` and :class:`TorchState`.

A script wraps its training loop in ``@hvd.elastic.run`` and keeps what must
survive a failure in a state object; ``state.commit()`` marks a point the job
can go back to::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

What happens when a rank dies
-----------------------------
Tidewire's world is fixed for the life of its processes (no host discovery,
no in-place resizing), so a failure is handled by restarting the processes:

* Under ``torchrun --max-restarts N`` (N >= 1), torchrun's agent sees the
  rank exit, stops every other worker of the group and starts them all again
  (the same number of ranks, ``TORCHELASTIC_RESTART_COUNT`` one higher). Each
  commit is also written, atomically, to a directory that outlives the
  processes (``TIDEWIRE_ELASTIC_DIR``, else ``<temp dir>/tidewire-elastic-
  <TORCHELASTIC_RUN_ID>``) by every rank with local rank 0. In the restarted
  script :func:`run` finds the newest commit the ranks have (they agree on it:
  every rank reports its newest, the newest of all wins, and the lowest rank
  that holds it broadcasts it), restores the state to it (model, optimizer,
  every attribute), calls the reset callbacks, broadcasts rank 0's state as
  Horovod does, and calls the function again: training goes on from the last
  commit. What the ranks did after it is done again.
* Without torchrun's restarts (``--max-restarts 0``, another launcher, or
  the last attempt), the surviving ranks' next collective fails with
  :class:`~tidewire.TidewireError` (at once where the connection breaks,
  after ``TIDEWIRE_TIMEOUT`` at most), and the error surfaces from the
  wrapped function: Tidewire does not retry in the same processes, because
  the dead rank cannot come back into them.

``check_host_updates()`` has nothing to watch (torchrun does not tell the
workers about hosts; a change of hosts restarts them): it returns at once,
without communicating.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from ._collectives import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._runtime import _require, rank

__all__ = ["State", "ObjectState", "TorchState", "run", "commit_dir"]

F = TypeVar("F", bound=Callable[..., Any])

#: Commits kept on disk per :func:`run` call (the newest ones).
COMMITS_KEPT = 2

_COMMIT = re.compile(r"^commit-(\d{8})\.pt$")


# --------------------------------------------------------------------------- where commits live


def commit_dir() -> Optional[str]:
    """The directory commits survive a restart in, or None when they stay in
    memory only: ``TIDEWIRE_ELASTIC_DIR`` when set (``none`` turns the disk
    copies off), else ``<temp dir>/tidewire-elastic-<TORCHELASTIC_RUN_ID>``
    under torchrun; None when not under torchrun (no restart would read them)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    given = env.get("TIDEWIRE_ELASTIC_DIR", "").strip()
    if given.lower() == "none":
        return None
    if given:
        return given
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", env["TORCHELASTIC_RUN_ID"])
    return os.path.join(tempfile.gettempdir(), f"tidewire-elastic-{run_id}")


def _restarts_left() -> bool:
    """Whether torchrun would restart this attempt (``TORCHELASTIC_RESTART_COUNT``
    below ``TORCHELASTIC_MAX_RESTARTS``): only then is a commit worth writing."""
    env = os.environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def _restarted() -> bool:
    """Whether torchrun started this process again after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _writes() -> bool:
    """Whether this rank writes the commits (one rank per host: local rank 0)."""
    env, _ = _require()
    return env.local_rank == 0


def _commits(d: str) -> List[int]:
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_COMMIT.match, names) if m)


def _commit_path(d: str, n: int) -> str:
    return os.path.join(d, f"commit-{n:08d}.pt")


def _write_commit(d: str, n: int, snapshot: Dict[str, Any]) -> None:
    """Writes commit ``n`` atomically (a temporary file, fsync, rename), then
    removes all but the newest :data:`COMMITS_KEPT`."""
    os.makedirs(d, exist_ok=True)
    final = _commit_path(d, n)
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in _commits(d)[:-COMMITS_KEPT]:
        try:
            os.remove(_commit_path(d, old))
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- states


class State:
    """What :func:`run` keeps across a failure (Horovod's
    ``horovod.common.elastic.State``). Subclasses implement :meth:`save`,
    :meth:`restore` and :meth:`sync`; :class:`ObjectState` and
    :class:`TorchState` do. Only those two are written to disk (a plain
    ``State`` subclass keeps its commits in memory, which a restarted process
    does not have).

    ``bcast_object`` (broadcast an object from rank 0) and ``get_rank`` are
    Horovod's arguments; they default to Tidewire's."""

    def __init__(
        self, bcast_object: Optional[Callable[[Any], Any]] = None, get_rank: Optional[Callable[[], int]] = None
    ) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or rank
        self._reset_callbacks: List[Callable[[], Any]] = []
        #: Commits made (and restored): the number of the next one's file.
        self._tw_commits = 0
        #: Where this state's commits are written (set by :func:`run`), or None.
        self._tw_dir: Optional[str] = None

    def register_reset_callbacks(self, callbacks: List[Callable[[], Any]]) -> None:
        """Adds functions that :func:`run` calls after a reset: on Tidewire, in
        a process torchrun restarted after a failure, once the state is back
        at the last commit and before it is synced and the function runs
        (for example to rescale the learning rate by ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """:meth:`reset`, then the reset callbacks in the order they were registered."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state (:meth:`save`) as the point a failure goes back to,
        writes it to the commit directory (see the module docs) and calls
        :meth:`check_host_updates`. Call it at the same points on every rank.
        It copies the model and optimizer state (and, under torchrun with
        restarts left, writes them), so commit every few batches rather than
        every one where that cost matters."""
        self.save()
        self._tw_commits += 1
        if self._tw_dir is not None and _writes():
            snap = self._tw_snapshot()
            if snap is not None:
                _write_commit(self._tw_dir, self._tw_commits, snap)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when its driver has
        added or removed hosts. Under torchrun there is no host discovery to
        watch (a change of membership restarts every worker instead), so this
        returns at once, without communicating."""
        return None

    def save(self) -> None:
        """Saves the state in memory (the point :meth:`restore` goes back to)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Goes back to the last saved state, dropping what changed since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Gives every rank rank 0's state. Collective."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called on a reset, before the callbacks and the sync."""

    # Disk copies: what a commit writes and a restarted process loads.

    def _tw_snapshot(self) -> Optional[Dict[str, Any]]:
        return None

    def _tw_load(self, snapshot: Dict[str, Any]) -> None:
        raise NotImplementedError()


class ObjectState(State):
    """Plain Python objects as state (Horovod's ``ObjectState``): each keyword
    argument becomes an attribute; :meth:`save` records the attributes'
    values, :meth:`restore` sets them back, :meth:`sync` broadcasts rank 0's.
    The values must be picklable (``torch.save``) to survive a restart."""

    def __init__(
        self,
        bcast_object: Optional[Callable[[Any], Any]] = None,
        get_rank: Optional[Callable[[], int]] = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v)

    def _tw_snapshot(self) -> Optional[Dict[str, Any]]:
        return {"objects": self._saved_state}

    def _tw_load(self, snapshot: Dict[str, Any]) -> None:
        self._saved_state = dict(snapshot["objects"])
        self.restore()


# --------------------------------------------------------------------------- torch state


class _Handler:
    """Keeps one model or optimizer's committed state_dict."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Dict[str, Any] = {}
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def _handler(value: Any) -> Optional[_Handler]:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        tw = getattr(value, "_tw", None)
        if tw is not None and getattr(tw, "apply", "local") == "server":
            raise ValueError(
                "TorchState: a DistributedOptimizer with apply='server' keeps the parameters on Tidewire's "
                "servers, which a restored state_dict would not reach: use apply='local' (Horovod's way)"
            )
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """A PyTorch training's state (Horovod's ``TorchState``): ``model`` and
    ``optimizer`` (and any other ``torch.nn.Module`` or ``torch.optim.Optimizer``
    passed by keyword) are kept as their ``state_dict()`` (deep copies at
    each commit, loaded back by :meth:`restore`, broadcast from rank 0 by
    :meth:`sync`); every other keyword (``epoch=0``, ``batch=0``, lists...) is an
    attribute as in :class:`ObjectState`. Assigning a new model or optimizer
    to the attribute saves it at once, as Horovod does."""

    _handlers: Dict[str, _Handler]

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        rest: Dict[str, Any] = {}
        for k, v in kwargs.items():
            h = _handler(v)
            if h is None:
                rest[k] = v
            else:
                handlers[k] = h
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **rest)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def _tw_snapshot(self) -> Optional[Dict[str, Any]]:
        snap = super()._tw_snapshot() or {}
        snap["handlers"] = {k: h.saved for k, h in self._handlers.items()}
        return snap

    def _tw_load(self, snapshot: Dict[str, Any]) -> None:
        saved = snapshot.get("handlers", {})
        if set(saved) != set(self._handlers):
            raise ValueError(
                f"the committed state has models/optimizers {sorted(saved)}, this TorchState "
                f"{sorted(self._handlers)}: the script must build the same state after a restart"
            )
        for k, h in self._handlers.items():
            h.saved = saved[k]
        super()._tw_load(snapshot)


# --------------------------------------------------------------------------- run


#: :func:`run` calls so far in this process: each keeps its commits apart.
_calls = 0


def _agree_on_commit(state: State, d: str) -> Tuple[int, Optional[int]]:
    """The newest commit any rank holds (-1: none) and the lowest rank holding
    it. Collective: every rank reports its newest."""
    from ._horovod import allgather_object

    mine = (_commits(d) or [-1])[-1] if _writes() else -1
    every = allgather_object(mine, name="elastic/newest_commit")
    newest = max(every)
    return newest, (every.index(newest) if newest >= 0 else None)


def _resume(state: State, d: str) -> Optional[int]:
    """In a restarted process: loads the newest commit the ranks agree on into
    ``state`` (the lowest rank holding it broadcasts it) and returns its number."""
    newest, holder = _agree_on_commit(state, d)
    if holder is None:
        return None
    env, _ = _require()
    snap = torch.load(_commit_path(d, newest), weights_only=False) if env.rank == holder else None
    snap = broadcast_object(snap, root_rank=holder, name="elastic/commit")
    state._tw_load(snap)
    state._tw_commits = newest
    return newest


def run(func: F) -> F:
    """Wraps ``func(state, *args, **kwargs)`` for elastic training (Horovod's
    ``hvd.elastic.run``). The wrapper syncs ``state`` from rank 0 and calls
    ``func``. In a process that torchrun restarted after a failure it first
    restores ``state`` to the newest commit (see the module docs), then calls
    the reset callbacks, then syncs. Errors from ``func`` (a
    :class:`~tidewire.TidewireError` when a peer died) propagate: the restart
    is torchrun's. ``init()`` must have run. Do not call collectives while
    building ``state`` in a way that depends on the rank (as in Horovod)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        global _calls
        _require()
        _calls += 1
        d = commit_dir()
        if d is not None:
            d = os.path.join(d, f"run-{_calls}")
        state._tw_dir = d if _restarts_left() else None
        if _restarted():
            restored = _resume(state, d) if d is not None else None
            if rank() == 0:
                where = f"commit {restored} in {d}" if restored is not None else "the start (no commit was made)"
                print(f"tidewire.torch.elastic: restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}: "
                      f"resuming from {where}", file=sys.stderr, flush=True)
            state.on_reset()
        elif d is not None and _writes():
            shutil.rmtree(d, ignore_errors=True)  # an earlier run's commits under the same run id
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
