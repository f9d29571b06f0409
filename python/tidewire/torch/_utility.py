"""The utility session: the scratch layers that tidewire.torch's collectives run on."""

from __future__ import annotations

import collections
import os
import threading
import zlib
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch

from .. import _native
from .._config import SessionConfig
from .._native import TidewireError
from ._env import _Env, _job_id, _place


#: Float32 values per rank in the header of a utility collective.
_HDR = 8
#: The utility session's scratch layers, float32 values: a small one for small
#: collectives (one round trip), a large one for the pieces of large tensors.
_SCRATCH_SMALL = 1 << 14
_SCRATCH_LARGE = 1 << 20

_OP_SUM, _OP_BROADCAST, _OP_ALLGATHER, _OP_JOIN = 1, 2, 3, 4
_OP_NAMES = {_OP_SUM: "push_pull", _OP_BROADCAST: "broadcast", _OP_ALLGATHER: "allgather", _OP_JOIN: "join"}
_PATH_VALUES, _PATH_DIGITS = 0, 1

_T = TypeVar("_T")

#: The dtypes and reductions a collective's header can name (its root field,
#: for collectives without a root): every rank checks that every other rank
#: passed the same dtype and reduction, not only the same element count.
_TAG_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool]
_TAG_OPS = ["average", "sum", "adasum", "min", "max", "product", "gather"]


def _tag(dtype: torch.dtype, op: int) -> int:
    """The header tag of a collective over ``dtype`` with reduction ``op`` (an index of ``_TAG_OPS``)."""
    if dtype not in _TAG_DTYPES:
        raise TypeError(f"tidewire.torch's collectives do not move {dtype} tensors")
    return 1 + _TAG_DTYPES.index(dtype) * len(_TAG_OPS) + op


def _untag(tag: int) -> str:
    d, o = divmod(tag - 1, len(_TAG_OPS))
    dtype = str(_TAG_DTYPES[d]).replace("torch.", "") if 0 <= d < len(_TAG_DTYPES) else f"dtype {d}"
    op = _TAG_OPS[o] if 0 <= o < len(_TAG_OPS) else f"op {o}"
    return f"{dtype}, {op}"


class _Worker:
    """Runs the utility collectives in the order they were submitted (FIFO),
    in the threads of their callers. An async collective is queued; the queue
    runs (in the caller's thread) when a blocking collective starts, or when a
    handle is polled or synchronized. So the order in which a rank calls
    collectives is the order in which they run, and no thread of Tidewire's
    runs torch code (an async collective does not overlap the caller's
    computation in this version)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.jobs: "collections.deque[Tuple[Callable[[], Any], Future]]" = collections.deque()
        self.owner: Optional[threading.Thread] = None  # the thread running jobs now

    def here(self) -> bool:
        """Whether the caller is running a job now (a job that runs sub-collectives)."""
        return self.owner is threading.current_thread()

    def submit(self, fn: Callable[[], _T]) -> "Future[_T]":
        """Queues ``fn``; it runs before the next blocking collective, poll or synchronize."""
        fut: "Future[_T]" = Future()
        with self.cv:
            self.jobs.append((fn, fut))
        return fut

    def _claim(self) -> bool:
        """Makes this thread the one running jobs (waits for another one); False if it already is."""
        me = threading.current_thread()
        with self.cv:
            if self.owner is me:
                return False
            while self.owner is not None:
                self.cv.wait()
            self.owner = me
            return True

    def _release(self) -> None:
        with self.cv:
            self.owner = None
            self.cv.notify_all()

    def _drain(self) -> None:
        while True:
            with self.cv:
                if not self.jobs:
                    return
                fn, fut = self.jobs.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever synchronizes it
                    fut.set_exception(e)

    def run_queued(self) -> None:
        """Runs every queued job (in this thread, in order)."""
        claimed = self._claim()
        try:
            self._drain()
        finally:
            if claimed:
                self._release()

    def call(self, fn: Callable[[], _T]) -> _T:
        """Runs the queued jobs, then ``fn``, in this thread; returns ``fn``'s result."""
        claimed = self._claim()
        try:
            self._drain()
            return fn()
        finally:
            if claimed:
                self._release()


# --------------------------------------------------------------------------- utility collectives


class _Guard:
    """A native session that remembers its first failure. After one,
    :meth:`close` aborts (the peers fail at once) instead of shutting down:
    a shutdown waits for the layers in flight, which may never complete (a
    peer that skipped a collective, a timed-out pull)."""

    def __init__(self, session: _native.Session) -> None:
        self.s = session
        self.broken: Optional[str] = None

    def _call(self, f: Callable[..., Any], *args: Any) -> Any:
        try:
            return f(*args)
        except TidewireError as e:
            self.broken = self.broken or str(e)
            raise

    def push(self, layer: int) -> None:
        self._call(self.s.push, layer)

    def push_factors(self, layer: int, u: Any, v: Any) -> None:
        self._call(self.s.push_factors, layer, u, v)

    def pull(self, layer: int) -> None:
        self._call(self.s.pull, layer)

    def pull_all(self) -> None:
        self._call(self.s.pull_all)

    def close(self) -> None:
        if self.s.closed:
            return
        if self.broken is not None:
            self.s.abort()
            return
        try:
            self.s.shutdown()
        except TidewireError:
            self.s.abort()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.s, name)


def _digits16(v: int, n: int) -> List[float]:
    return [float((v >> (16 * i)) & 0xFFFF) for i in range(n)]


def _undigits16(ds: Sequence[float]) -> int:
    return sum(int(d) << (16 * i) for i, d in enumerate(ds))


class _Util:
    """The utility session: scratch layers summed across ranks (ApplyOp::Sum).

    A collective copies its data into a scratch layer's gradient, pushes,
    pulls, and copies the sum out, in pieces when large. The first piece
    carries a header row per rank (operation, root, element count, name
    hash): every rank checks every row, so a disagreement raises on every rank
    instead of hanging.
    """

    def __init__(self, env: _Env, index: int) -> None:
        self.env = env
        self.lock = threading.Lock()
        hdr = env.size * _HDR
        small = max(_SCRATCH_SMALL, hdr + 1024)
        large = max(_SCRATCH_LARGE, small)
        try:
            large = max(int(os.environ.get("TIDEWIRE_SCRATCH_FLOATS", large)), small)
        except ValueError:
            raise TidewireError("TIDEWIRE_SCRATCH_FLOATS is not a number") from None
        self.sizes = [small, large]
        self.offsets = [0, small]
        total = small + large
        self.grad = torch.zeros(total, dtype=torch.float32)
        self.res = torch.zeros(total, dtype=torch.float32)
        config = SessionConfig(
            layers=[("tidewire.scratch.small", "other", 1, small), ("tidewire.scratch.large", "other", 1, large)],
            **_place(env, index),
            master=env.master(index),
            secret=env.secret,
            job=_job_id(env, index),
            apply="sum",
            policy="ps",
            transport=env.transport,
            timeout=env.timeout,
            connect_timeout=max(env.timeout, 60.0),
        )
        self.session = _Guard(_native.Session(config, params=self.res, grads=self.grad))
        self.worker = _Worker()

    def close(self) -> None:
        """Ends the session once the collectives submitted before have run (or failed)."""

        def close_now() -> None:
            with self.lock:
                self.session.close()

        self.worker.call(close_now)

    def call(self, fn: Callable[[], _T]) -> _T:
        """Runs ``fn`` (which may run several collectives back to back) on the
        collective worker, after every collective submitted before; waits."""
        return self.worker.call(fn)

    def submit(self, fn: Callable[[], _T]) -> "Future[_T]":
        """Queues ``fn`` and returns at once; it runs, in call order, before the
        next blocking collective or when :meth:`run_queued` is called."""
        return self.worker.submit(fn)

    def run_queued(self) -> None:
        """Runs every queued collective, in order, in this thread."""
        self.worker.run_queued()

    def _layer(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        o, n = self.offsets[i], self.sizes[i]
        return self.grad[o : o + n], self.res[o : o + n]

    def _round(self, i: int) -> None:
        self.session.push(i)
        self.session.pull(i)

    def run(
        self,
        op: int,
        path: int,
        root: int,
        count: int,
        name: Optional[str],
        data: Optional[torch.Tensor],
        length: int,
    ) -> torch.Tensor:
        """One collective: ``data`` (float32, ``length`` values; None for
        zeros) summed over every rank. ``count`` is what the header compares
        (the caller's element count). Runs on the collective worker, after
        every collective submitted before."""
        if not self.worker.here():
            return self.worker.call(lambda: self.run(op, path, root, count, name, data, length))
        env = self.env
        hdr = env.size * _HDR
        code = op * 4 + path
        h = zlib.crc32(name.encode()) if name else 0
        row = [1.0, float(code), float(root)] + _digits16(count, 3) + _digits16(h, 2)
        if count >= 1 << 48:
            raise TidewireError(f"a tensor of {count} elements is too large for one collective")
        out = torch.empty(length, dtype=torch.float32)
        with self.lock:
            if self.session.closed:
                raise TidewireError("tidewire.torch was shut down")
            # The first piece: the small layer, header then data.
            g, r = self._layer(0)
            first = min(length, self.sizes[0] - hdr)
            g[:hdr].zero_()
            g[env.rank * _HDR : (env.rank + 1) * _HDR] = torch.tensor(row, dtype=torch.float32)
            if data is None:
                g[hdr : hdr + first].zero_()
            else:
                g[hdr : hdr + first].copy_(data[:first])
            self._round(0)
            self._check_header(r[:hdr].view(env.size, _HDR), row, name)
            out[:first].copy_(r[hdr : hdr + first])
            at = first
            while at < length:
                left = length - at
                i = 0 if left <= self.sizes[0] else 1
                n = min(left, self.sizes[i])
                g, r = self._layer(i)
                if data is None:
                    g[:n].zero_()
                else:
                    g[:n].copy_(data[at : at + n])
                self._round(i)
                out[at : at + n].copy_(r[:n])
                at += n
        return out

    def _check_header(self, rows: torch.Tensor, mine: List[float], name: Optional[str]) -> None:
        got = rows.tolist()
        if all(r == mine for r in got):
            return

        def describe(r: List[float]) -> str:
            if r[0] != 1.0:
                return "nothing (its header is missing)"
            op, path = divmod(int(r[1]), 4)
            what = _OP_NAMES.get(op, f"operation {op}")
            if op == _OP_BROADCAST:
                what += f" from root {int(r[2])}"
            elif int(r[2]):
                what += f" ({_untag(int(r[2]))})"
            kind = "float32 values" if path == _PATH_VALUES else "bytes as 16-bit digits"
            return f"{what} of {_undigits16(r[3:6])} elements ({kind}), name hash {_undigits16(r[6:8]):#010x}"

        lines = [f"  rank {i}: {describe(r)}" for i, r in enumerate(got)]
        raise TidewireError(
            "ranks disagree on a collective (every rank must call the same collectives with the same "
            f"sizes, in the same order); this rank called it with name {name!r}:\n" + "\n".join(lines)
        )
