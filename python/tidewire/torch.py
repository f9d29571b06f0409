"""Horovod-like data parallelism for PyTorch on Tidewire.

Every rank runs the same training script; Tidewire keeps the replicas in sync
through sharded parameter servers colocated with the workers (every rank is
both), layer by layer as backward produces the gradients::

    import torch
    import tidewire.torch as tw

    tw.init()                                   # reads torchrun / Slurm / MPI / TIDEWIRE_* variables
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = tw.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  model=model, batch_size=32)
    tw.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in loader:                         # each rank its own shard of the data
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()                         # layers are pushed as their gradients are ready
        opt.step()                              # averaged gradients, then the torch optimizer
    tw.shutdown()

Collectives
-----------
Building a :func:`DistributedOptimizer`, :func:`push_pull`,
:func:`broadcast_parameters`, :func:`broadcast_optimizer_state`,
:func:`broadcast_object`, :func:`barrier` and :func:`shutdown` are collective:
every rank must call them, in the same order. A mismatch that Tidewire can see
(a different tensor size or operation, a different layer table) raises
:class:`TidewireError` on every rank at once; a call that one rank never makes
fails on the others after the timeout (``TIDEWIRE_TIMEOUT``, 60 s by default).

Ports
-----
Tidewire's rendezvous listens on rank 0, on ports of its own: session *i* of
the job (0 is the utility session :func:`init` builds, then one per
:func:`DistributedOptimizer`, in creation order) uses ``port + i``, where
``port`` is the port of ``TIDEWIRE_MASTER=host:port`` when that is set, and
otherwise ``MASTER_PORT + TIDEWIRE_PORT_OFFSET`` (offset 1000 by default) on
``MASTER_ADDR``. It never binds ``MASTER_PORT`` itself: under torchrun (torch
2.x, ``TORCHELASTIC_USE_AGENT_STORE=True``) the elastic agent already listens
there, and ``torch.distributed.init_process_group`` (gloo, NCCL) uses it for its
store, so Tidewire and a gloo process group can run side by side in one process.
Every rank computes the same ports.

Environment
-----------
========================================================  ======================================
``TIDEWIRE_RANK``, ``TIDEWIRE_WORLD_SIZE``                rank and world size (win over the rest)
``TIDEWIRE_LOCAL_RANK``                                   local rank with Tidewire's variables
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``                  torchrun
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``     Slurm
``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``        Open MPI
``TIDEWIRE_MASTER``                                       ``host:port`` of rank 0's rendezvous
``MASTER_ADDR``, ``MASTER_PORT``                          otherwise: rank 0's host, and the base port
``TIDEWIRE_PORT_OFFSET``                                  offset from ``MASTER_PORT`` (default 1000)
``TIDEWIRE_SECRET``                                       the job secret, the same on every rank (required
                                                          with more than one rank)
``TIDEWIRE_JOB``                                          job id (a number, default 1)
``TIDEWIRE_TIMEOUT``                                      seconds a wait may last (default 60)
``TIDEWIRE_TRANSPORT``                                    ``auto``, ``tcp``, ``portable`` or ``rdma``
========================================================  ======================================

Without any rank variable the process is a job of one (rank 0 of 1), which
needs no secret and no address.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import secrets as _secrets
import socket
import tempfile
import threading
import warnings
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import _native
from ._native import TidewireError

__all__ = [
    "TidewireError",
    "init",
    "is_initialized",
    "shutdown",
    "rank",
    "size",
    "local_rank",
    "DistributedOptimizer",
    "push_pull",
    "broadcast",
    "broadcast_",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "barrier",
    "PORT_OFFSET",
]

#: Parameter dtypes DistributedOptimizer syncs (float32 in place, the others staged through float32).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Default offset of Tidewire's base port from ``MASTER_PORT`` (``TIDEWIRE_PORT_OFFSET``).
PORT_OFFSET = 1000
#: Float32 values per rank in the header of a utility collective.
_HDR = 8
#: The utility session's scratch layers, float32 values: a small one for small
#: collectives (one round trip), a large one for the pieces of large tensors.
_SCRATCH_SMALL = 1 << 14
_SCRATCH_LARGE = 1 << 20

_OP_SUM, _OP_BROADCAST, _OP_ALLGATHER = 1, 2, 3
_OP_NAMES = {_OP_SUM: "push_pull", _OP_BROADCAST: "broadcast", _OP_ALLGATHER: "allgather"}
_PATH_VALUES, _PATH_DIGITS = 0, 1

# A gradient view into the flat buffer (an nn.Linear bias column in the
# sufficient-factor layout) need not share its parameter's strides: correct,
# and autograd accumulates into it in place all the same.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


# --------------------------------------------------------------------------- environment


class _Env:
    """Who this process is in the job, and where rank 0 listens."""

    def __init__(
        self,
        rank: int,
        size: int,
        local_rank: int,
        source: str,
        host: str,
        base_port: int,
        secret: bytes,
        job: int,
        timeout: float,
        transport: str,
        local_size: int = 1,
        local_agg: bool = False,
        cache_staleness: int = 0,
    ) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.local_agg = local_agg
        self.cache_staleness = cache_staleness
        self.source = source
        self.host = host
        self.base_port = base_port
        self.secret = secret
        self.job = job
        self.timeout = timeout
        self.transport = transport

    def master(self, index: int) -> str:
        """The rendezvous address of session ``index``."""
        port = self.base_port + index
        if port > 65535:
            raise TidewireError(
                f"session {index} would listen on port {port} (base {self.base_port}): "
                "set TIDEWIRE_MASTER=host:port with a lower port"
            )
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{port}"


def _env_int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise TidewireError(f"{name}={value!r} is not a number") from None


def _read_env(
    secret: Union[str, bytes, None],
    master: Optional[str],
    timeout: Optional[float],
    local_aggregation: Optional[bool] = None,
) -> _Env:
    env = os.environ
    launchers = [
        ("tidewire", "TIDEWIRE_RANK", "TIDEWIRE_WORLD_SIZE", ("TIDEWIRE_LOCAL_RANK", "LOCAL_RANK")),
        ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ]
    for source, rk, wk, lks in launchers:
        if rk in env:
            rank_ = _env_int(rk, env[rk])
            if wk not in env:
                raise TidewireError(f"{rk} is set but {wk} is not: set both")
            size_ = _env_int(wk, env[wk])
            local = next((_env_int(k, env[k]) for k in lks if k in env), 0)
            break
    else:
        source, rank_, size_, local = "single process", 0, 1, 0
    if size_ < 1 or not 0 <= rank_ < size_:
        raise TidewireError(f"rank {rank_} outside a world of {size_} ({source} variables)")
    if _env_int("TIDEWIRE_SERVERS", env.get("TIDEWIRE_SERVERS", "0")) != 0:
        raise TidewireError(
            "TIDEWIRE_SERVERS is set, but tidewire.torch runs every rank as worker and server: unset it"
        )
    master = master or env.get("TIDEWIRE_MASTER")
    if master:
        host, sep, port = master.rpartition(":")
        if not sep or not host:
            raise TidewireError(f"TIDEWIRE_MASTER={master!r}: want host:port")
        base = _env_int("the port of TIDEWIRE_MASTER", port)
        host = host.strip("[]")
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        host = env["MASTER_ADDR"]
        offset = _env_int("TIDEWIRE_PORT_OFFSET", env.get("TIDEWIRE_PORT_OFFSET", str(PORT_OFFSET)))
        base = _env_int("MASTER_PORT", env["MASTER_PORT"]) + offset
    elif size_ == 1:
        host, base = "127.0.0.1", 1  # a job of one never listens
    else:
        raise TidewireError(
            "no rendezvous address: set TIDEWIRE_MASTER=host:port (rank 0's host; the same on every rank), "
            "or MASTER_ADDR and MASTER_PORT"
        )
    if not 0 < base < 65536:
        raise TidewireError(f"Tidewire's base port {base} is outside 1..65535")
    if env.get("MASTER_PORT", "").strip() == str(base) and size_ > 1:
        who = (
            "torchrun's agent listens there (TORCHELASTIC_USE_AGENT_STORE=True)"
            if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            else "torch.distributed's store uses it"
        )
        raise TidewireError(
            f"Tidewire's rendezvous would listen on MASTER_PORT={base}, but {who}: give "
            "TIDEWIRE_MASTER another port, or unset it (Tidewire then uses MASTER_PORT + TIDEWIRE_PORT_OFFSET)"
        )
    if secret is None:
        secret = env.get("TIDEWIRE_SECRET")
    if not secret:
        if size_ > 1:
            raise TidewireError(
                "TIDEWIRE_SECRET is not set: Tidewire's ranks authenticate each other with a job secret. "
                "Set TIDEWIRE_SECRET to the same string on every rank (for example "
                "`export TIDEWIRE_SECRET=$(head -c 16 /dev/urandom | xxd -p)` before torchrun), "
                "or pass init(secret=...)"
            )
        secret = _secrets.token_hex(16)
    if isinstance(secret, str):
        secret = secret.encode()
    job = _env_int("TIDEWIRE_JOB", env.get("TIDEWIRE_JOB", "1"))
    if timeout is None:
        try:
            timeout = float(env.get("TIDEWIRE_TIMEOUT", "60"))
        except ValueError:
            raise TidewireError(f"TIDEWIRE_TIMEOUT={env['TIDEWIRE_TIMEOUT']!r} is not a number") from None
    transport = env.get("TIDEWIRE_TRANSPORT", "auto").strip().lower() or "auto"
    local_size = next(
        (
            _env_int(k, env[k])
            for k in ("TIDEWIRE_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
            if k in env
        ),
        1,
    )
    if local_aggregation is None:
        local_aggregation = env.get("TIDEWIRE_LOCAL_AGGREGATION", "0").strip().lower() in ("1", "true", "yes")
    staleness = _env_int("TIDEWIRE_CACHE_STALENESS", env.get("TIDEWIRE_CACHE_STALENESS", "0"))
    if local_aggregation and local_size > 1:
        if local_size < 1 or size_ % local_size != 0 or rank_ % local_size != local:
            raise TidewireError(
                f"local aggregation needs every node's {local_size} learners (LOCAL_WORLD_SIZE) to be "
                f"consecutive ranks with LOCAL_RANK = RANK mod {local_size}, as torchrun starts them; "
                f"this process is rank {rank_} of {size_} with local rank {local}"
            )
        if staleness < 0:
            raise TidewireError(f"TIDEWIRE_CACHE_STALENESS={staleness}: want >= 0")
    else:
        local_aggregation = False
    return _Env(
        rank_, size_, local, source, host, base, secret, job, timeout, transport,
        local_size, bool(local_aggregation), staleness,
    )


def _place(env: _Env, index: int) -> Dict[str, Any]:
    """The rank, world and local group of session ``index``: with local
    aggregation a node's learners share one rank (its local rank 0 leads and
    pushes once for all of them, through shared memory)."""
    if not env.local_agg:
        return {"rank": env.rank, "world": env.size}
    n = env.local_size
    node = env.rank // n
    h = hashlib.blake2b(digest_size=8)
    for part in (env.secret, str(env.job).encode(), env.host.encode(), str(env.base_port).encode()):
        h.update(part)
        h.update(b"\0")
    nonce = int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
    d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(d, f"tidewire-{nonce:016x}-{index}-{node}")
    return {"rank": node, "world": env.size // n, "local": (n, env.local_rank, path, nonce, env.cache_staleness)}


# --------------------------------------------------------------------------- global state


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.env: Optional[_Env] = None
        self.util: Optional[_Util] = None
        self.next_index = 0
        self.optimizers: List[Any] = []
        self.atexit = False


_state = _State()


def _require() -> Tuple[_Env, "_Util"]:
    env, util = _state.env, _state.util
    if env is None or util is None:
        raise TidewireError("tidewire.torch is not initialized: call tidewire.torch.init() first")
    return env, util


def _new_index() -> int:
    with _state.lock:
        i = _state.next_index
        _state.next_index += 1
        return i


def _job_id(env: _Env, index: int) -> int:
    return (env.job << 16) | (index & 0xFFFF)


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
        if not _state.atexit:
            atexit.register(_atexit)
            _state.atexit = True


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _state.util is not None


def rank() -> int:
    """This process's rank (0 .. size()-1)."""
    return _require()[0].rank


def size() -> int:
    """The number of ranks."""
    return _require()[0].size


def local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK``, ``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``; 0 when the launcher sets none): use it to
    pick a GPU."""
    return _require()[0].local_rank


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
        self.session = _Guard(_native.Session(
            [("tidewire.scratch.small", "other", 1, small), ("tidewire.scratch.large", "other", 1, large)],
            params=self.res,
            grads=self.grad,
            **_place(env, index),
            master=env.master(index),
            secret=env.secret,
            job=_job_id(env, index),
            apply="sum",
            policy="ps",
            transport=env.transport,
            timeout=env.timeout,
            connect_timeout=max(env.timeout, 60.0),
        ))

    def close(self) -> None:
        with self.lock:
            self.session.close()

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
        (the caller's element count)."""
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
            kind = "float32 values" if path == _PATH_VALUES else "bytes as 16-bit digits"
            return f"{what} of {_undigits16(r[3:6])} elements ({kind}), name hash {_undigits16(r[6:8]):#010x}"

        lines = [f"  rank {i}: {describe(r)}" for i, r in enumerate(got)]
        raise TidewireError(
            "ranks disagree on a collective (every rank must call the same collectives with the same "
            f"sizes, in the same order); this rank called it with name {name!r}:\n" + "\n".join(lines)
        )


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


def push_pull(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None) -> torch.Tensor:
    """Sums (``average=True``: averages) ``tensor`` over every rank and returns
    the result as a new tensor of the same shape, dtype and device.

    Values travel as float32 (exact for integers up to 2**24; float64 is
    rounded); an integer average is truncated. Collective: every rank calls it
    with a tensor of the same number of elements (and the same ``name``, if
    given), in the same order; a mismatch raises :class:`TidewireError` on
    every rank.
    """
    env, util = _require()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull wants a torch.Tensor, got {type(tensor).__name__}")
    n = tensor.numel()
    out = util.run(_OP_SUM, _PATH_VALUES, 0, n, name, _flat_f32(tensor), n)
    if average:
        out.div_(env.size)
    return out.reshape(tensor.shape).to(dtype=tensor.dtype, device=tensor.device)


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
) -> None:
    """Overwrites every tensor in ``params`` in place with rank ``root_rank``'s
    values: ``model.state_dict()`` (parameters and buffers, taken in sorted
    key order), ``model.named_parameters()`` (in its order) or a list of
    tensors. Bit for bit, in one or two collectives (float32 tensors as
    values, the rest as bytes). Collective: every rank passes the same names
    and shapes."""
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
        outs = _broadcast_flat(group, root_rank, f"broadcast_parameters/{tag}")
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


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Gives every rank rank ``root_rank``'s optimizer state (``state_dict()``:
    momentum buffers, step counts, hyperparameters), loaded with
    ``load_state_dict`` on the other ranks. Works when the other ranks have no
    state yet. Collective."""
    env, _ = _require()
    sd = optimizer.state_dict() if env.rank == root_rank else None
    sd = broadcast_object(sd, root_rank, name="broadcast_optimizer_state")
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


def _probe_host(host: str) -> str:
    """The address rank 0's link probe listens on: every interface, in the
    family of ``host`` (the address the other ranks reach rank 0 at)."""
    return "::" if ":" in host else "0.0.0.0"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _allgather_floats(values: List[float], name: str) -> List[List[float]]:
    """Every rank's ``values`` (the same count on every rank), as float32:
    every rank reads the same bits of each."""
    env, util = _require()
    k = len(values)
    data = torch.zeros(env.size * k, dtype=torch.float32)
    data[env.rank * k : (env.rank + 1) * k] = torch.tensor(values, dtype=torch.float32)
    out = util.run(_OP_ALLGATHER, _PATH_VALUES, 0, k, name, data, env.size * k)
    return [[float(x) for x in out[r * k : (r + 1) * k].tolist()] for r in range(env.size)]


# --------------------------------------------------------------------------- DistributedOptimizer


class _Param:
    """One synced parameter: where it lives in the flat buffers."""

    __slots__ = ("param", "name", "layer", "gview", "rview", "count", "hook")

    def __init__(self, param: nn.Parameter, name: str, layer: "_Layer") -> None:
        self.param = param
        self.name = name
        self.layer = layer
        self.gview: torch.Tensor = torch.empty(0)
        self.rview: torch.Tensor = torch.empty(0)
        self.count = 0
        self.hook: Any = None


class _Call:
    """One forward call of an SFB layer's nn.Linear: its input rows, and the
    gradient of its output once backward has produced it."""

    __slots__ = ("x", "delta")

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.delta: Optional[torch.Tensor] = None


class _Layer:
    """One Tidewire layer: the parameters of one module."""

    def __init__(self, index: int, name: str, module: Optional[nn.Module]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params: List[_Param] = []
        self.kind = "other"
        self.m = 1
        self.n = 1
        self.sfb_layout = False  # nn.Linear as one M x (in+1) block: weight columns, then the bias
        # nn.Embedding(sparse=True): the sparse-push hint (slices go as index/value pairs when that pays).
        self.sparse = False
        self.offset = 0
        self.numel = 0
        self.scheme = "ps"
        self.ready = 0
        self.pushed = False
        self.in_flight = False
        self.zero_on_pull = False
        self.calls: List[_Call] = []
        self.checked = False


def _is_linear_sfb_candidate(module: Optional[nn.Module], params: List[Tuple[str, nn.Parameter]]) -> bool:
    if module is None or type(module) is not nn.Linear:
        return False
    want = {id(module.weight)}
    if module.bias is not None:
        want.add(id(module.bias))
    return {id(p) for _, p in params} == want and len(params) == len(want)


class _Tw:
    """The Tidewire side of a DistributedOptimizer (kept apart from the torch
    optimizer's own attributes)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]],
        backward_passes_per_step: int,
        model: Optional[nn.Module],
        apply: str,
        sfb: Union[bool, str],
        consistency: Union[str, Tuple[str, int]],
        prefetch: bool,
        batch_size: Optional[int],
        broadcast_buffers: Optional[bool],
        timeout: Optional[float],
        comm: Optional[Dict[str, Any]] = None,
        ckpt: Optional[Dict[str, Any]] = None,
    ) -> None:
        env, _ = _require()
        self.env = env
        self.opt = opt
        self.model = model
        self.closed = False
        if apply not in ("local", "server"):
            raise ValueError(f"apply={apply!r}: want 'local' (the torch optimizer steps) or 'server'")
        self.apply = apply
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: want an int >= 1")
        self.bpps = backward_passes_per_step
        explicit = sfb is True
        if sfb is True:
            sfb = "auto"
        if sfb is not False and sfb not in ("auto", "always"):
            raise ValueError(f"sfb={sfb!r}: want False, True/'auto' (HybComm) or 'always'")
        can_sfb = model is not None and batch_size is not None
        if (explicit or sfb == "always") and not can_sfb:
            raise ValueError(f"sfb={'True' if explicit else repr(sfb)} needs model= and batch_size=")
        self.sfb: Union[bool, str] = sfb if (sfb is not False and can_sfb) else False
        if env.local_agg and self.sfb:
            if explicit or sfb == "always":
                raise ValueError(
                    "sfb: with local aggregation a node's learners sum their gradients before the one push, "
                    "so every layer syncs through the PS: drop sfb="
                )
            self.sfb = False
        if consistency == "bsp":
            self.consistency: Union[str, Tuple[str, int]] = "bsp"
        elif isinstance(consistency, (tuple, list)) and len(consistency) == 2 and consistency[0] == "ssp":
            s = int(consistency[1])
            if s < 0:
                raise ValueError("SSP staleness must be >= 0")
            self.consistency = ("ssp", s)
        else:
            raise ValueError(f"consistency={consistency!r}: want 'bsp' or ('ssp', s)")
        if self.consistency != "bsp" and apply == "local":
            raise ValueError(
                "consistency=('ssp', s) needs apply='server': in 'local' mode a stale pull would hand the "
                "torch optimizer an old averaged gradient a second time"
            )
        if prefetch and model is None:
            raise ValueError("prefetch=True needs model= (its forward pre-hooks pull each layer)")
        self.prefetch = bool(prefetch)
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r}: want a positive int")
        self.batch_size = batch_size
        self.broadcast_buffers = (model is not None) if broadcast_buffers is None else bool(broadcast_buffers)
        if self.broadcast_buffers and model is None:
            raise ValueError("broadcast_buffers=True needs model=")
        self.timeout = env.timeout if timeout is None else float(timeout)
        self.grad_rebinds = 0
        self.rates: Optional[Tuple[float, float, float, float]] = None  # what HybComm decided with (sfb="auto")
        self.synced = False  # this step's layers are all pushed
        self.pending = False  # a gradient arrived since the last step
        self.skip_sync = False
        self.handles: List[Any] = []
        self.sgd: Optional[Tuple[float, float, float]] = None
        if apply == "server":
            self.sgd = self._server_sgd(opt)
        self._setup_comm(comm or {})
        self._setup_checkpoint(ckpt or {})
        self._build_layers(opt, named_parameters)
        self._build_session()
        self._install_hooks()

    # ----------------------------------------------------------------- setup

    def _setup_comm(self, c: Dict[str, Any]) -> None:
        """Communication frequency (comm_every, comm_mode, quality_guided): see DistributedOptimizer."""
        every = c.get("comm_every", 1)
        mode = c.get("comm_mode", "accumulate")
        guided = bool(c.get("quality_guided", False))
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"comm_every={every!r}: want an int >= 1")
        if mode not in ("accumulate", "average"):
            raise ValueError(f"comm_mode={mode!r}: want 'accumulate' or 'average'")
        t_max = c.get("comm_every_max", 16) if guided else every
        if not isinstance(t_max, int) or t_max < every:
            raise ValueError(f"comm_every_max={t_max!r}: want an int >= comm_every ({every})")
        period = c.get("quality_period", 4)
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"quality_period={period!r}: want an int >= 1 (exchanges per window)")
        tol = float(c.get("quality_tolerance", 0.02))
        if not (tol >= 0.0 and tol < float("inf")):
            raise ValueError(f"quality_tolerance={tol!r}: want a finite number >= 0")
        revert = c.get("quality_revert_at")
        if revert is not None and (not isinstance(revert, int) or revert < 0):
            raise ValueError(f"quality_revert_at={revert!r}: want a step number >= 0 or None")
        #: Whether the communication frequency differs from "every step, gradients".
        self.comm_on = every > 1 or guided or mode == "average"
        self.comm_mode = mode
        self.guided = guided
        self.comm = (mode, every, t_max, period, tol, revert)
        if self.comm_on:
            what = f"comm_every={every}, comm_mode={mode!r}" + (", quality_guided=True" if guided else "")
            if self.apply != "local":
                raise ValueError(f"{what} needs apply='local' (the servers average; the torch optimizer steps)")
            if self.bpps != 1:
                raise ValueError(f"{what} replaces backward_passes_per_step: leave it at 1")
            if self.consistency != "bsp":
                raise ValueError(f"{what} needs consistency='bsp'")
            if self.sfb not in (False, "auto"):
                raise ValueError(f"{what} syncs through the parameter servers: pass sfb=False")
            if self.env.local_agg:
                raise ValueError(f"{what} with local aggregation (TIDEWIRE_LOCAL_AGGREGATION) is not supported yet")
            self.sfb = False
        self.guide = _native.FreqGuide(self.comm, self.env.rank, self.env.size)
        self.accumulating = False  # accumulate mode: gradients of steps since the last exchange are held
        self.since = 0  # steps since the last exchange
        self.steps_done = 0  # step() calls (and flushes)
        self.extra_exchanges = 0
        self.quality: Optional[_Layer] = None


    def _setup_checkpoint(self, c: Dict[str, Any]) -> None:
        """checkpoint_dir, checkpoint_every, checkpoint_keep, resume: see DistributedOptimizer."""
        d = c.get("checkpoint_dir")
        every = c.get("checkpoint_every", 100)
        keep = c.get("checkpoint_keep", 2)
        resume = c.get("resume", False)
        self.ckpt_dir: Optional[str] = None if d is None else os.fspath(d)
        self.ckpt_every = every
        self.start_step = 0
        self.resumed_from: Optional[str] = None
        self.wrapper: Optional[torch.optim.Optimizer] = None
        if self.ckpt_dir is None:
            if resume is True:
                raise ValueError("resume=True resumes from checkpoint_dir: give checkpoint_dir")
            if resume not in (False, None):
                # Resume from that checkpoint, without checkpointing this run.
                self.resumed_from = os.fspath(resume)
            return
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every={every!r}: want an int >= 1")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint_keep={keep!r}: want an int >= 1")
        if self.comm_on:
            raise ValueError("checkpoint_dir with comm_every/comm_mode/quality_guided is not supported yet")
        if self.env.local_agg:
            raise ValueError("checkpoint_dir with local aggregation (TIDEWIRE_LOCAL_AGGREGATION) is not supported yet")
        self.ckpt = (self.ckpt_dir, every, keep, True)
        if resume is True:
            # A restarted job (torchrun's elastic restart runs the script again):
            # the newest complete checkpoint, if there is one.
            self.resumed_from = _native.newest_checkpoint(self.ckpt_dir)
        elif resume not in (False, None):
            self.resumed_from = os.fspath(resume)

    def _save_checkpoint(self, k: int) -> None:
        """Worker rank 0 saves the torch side of checkpoint ``k``: the model's
        state_dict (or the parameters) and the optimizer's."""
        if self.prefetch and self.apply == "server":
            self.pull_all()  # the servers' values must be in place before they are read
        named = self.model.state_dict() if self.model is not None else {
            info.name: info.param.detach() for info in self.by_param.values()
        }
        state = {
            "step": k,
            "model": {n: t.detach().cpu().clone() for n, t in named.items()},
            "optimizer": self.wrapper.state_dict() if self.wrapper is not None else self.opt.state_dict(),
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        self.session.save_framework_state(k, buf.getvalue())

    def restore(self, wrapper: torch.optim.Optimizer) -> None:
        """After the build: a resumed job takes the torch side of its checkpoint."""
        self.wrapper = wrapper
        blob = self.session.framework_state() if self.ckpt_dir is not None or self.resumed_from else None
        if blob is None:
            return
        state = torch.load(io.BytesIO(blob), weights_only=False)
        with torch.no_grad():
            if self.model is not None:
                self.model.load_state_dict(state["model"])
            else:
                for info in self.by_param.values():
                    info.param.copy_(state["model"][info.name])
        wrapper.load_state_dict(state["optimizer"])

    @staticmethod
    def _server_sgd(opt: torch.optim.Optimizer, check_type: bool = True) -> Tuple[float, float, float]:
        if check_type and type(opt) is not torch.optim.SGD:
            raise ValueError(
                f"apply='server' supports torch.optim.SGD only (got {type(opt).__name__}): "
                "use apply='local' for other optimizers"
            )
        if len(opt.param_groups) != 1:
            raise ValueError(
                f"apply='server' needs one param group (got {len(opt.param_groups)}): Tidewire's servers apply "
                "one lr, momentum and weight decay"
            )
        g = opt.param_groups[0]
        if g.get("nesterov"):
            raise ValueError("apply='server' does not do Nesterov momentum: use nesterov=False or apply='local'")
        if g.get("dampening", 0) != 0:
            raise ValueError("apply='server' needs dampening=0 (Caffe-form momentum): or use apply='local'")
        if g.get("maximize"):
            raise ValueError("apply='server' does not maximize: use apply='local'")
        return float(g["lr"]), float(g.get("momentum", 0.0)), float(g.get("weight_decay", 0.0))

    def _build_layers(
        self, opt: torch.optim.Optimizer, named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]]
    ) -> None:
        opt_params = [p for g in opt.param_groups for p in g["params"]]
        opt_ids = {id(p) for p in opt_params}
        synthetic = False
        if named_parameters is not None:
            named = list(named_parameters)
        elif self.model is not None:
            named = list(self.model.named_parameters())
        else:
            named = [(f"group{gi}.param{pi}", p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
            synthetic = True
        seen: Dict[int, str] = {}
        names: Dict[str, int] = {}
        kept: List[Tuple[str, nn.Parameter]] = []
        for item in named:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError("named_parameters: want (name, parameter) pairs, e.g. model.named_parameters()")
            nm, p = str(item[0]), item[1]
            if id(p) in seen:
                continue  # a tied parameter counts once
            if nm in names:
                raise ValueError(f"named_parameters: the name {nm!r} names two different parameters")
            seen[id(p)] = nm
            names[nm] = id(p)
            if not p.requires_grad or id(p) not in opt_ids:
                continue
            kept.append((nm, p))
        missing = [p for p in opt_params if p.requires_grad and id(p) not in seen]
        if missing:
            shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
            raise ValueError(
                f"named_parameters misses {len(missing)} parameter(s) the optimizer updates (shapes {shapes}): "
                "pass named_parameters=model.named_parameters() of the model the optimizer trains"
            )
        if not kept:
            raise ValueError("no parameter to sync: the optimizer has no parameter with requires_grad=True")
        for nm, p in kept:
            if p.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {nm!r} is {p.dtype}: tidewire.torch syncs float32, float16, bfloat16 and "
                    "float64 parameters"
                )
            if p.is_sparse:
                raise TypeError(f"parameter {nm!r} is sparse: tidewire.torch syncs dense parameters")
        dtypes = {p.dtype for _, p in kept}
        if len(dtypes) != 1:
            raise TypeError(
                f"parameters of several dtypes ({sorted(map(str, dtypes))}): one DistributedOptimizer syncs one "
                "dtype (make one optimizer per dtype, or cast the model)"
            )
        #: The parameters' dtype: float32 is registered in place; float16, bfloat16 and
        #: float64 are widened to float32 at each push and narrowed back at each pull
        #: (the wire and the servers' sums are float32; float64 keeps float32's precision).
        self.dtype = next(iter(dtypes))
        devices = {p.device for _, p in kept}
        if len(devices) != 1:
            raise ValueError(f"parameters on several devices ({sorted(map(str, devices))}): one device per process")
        self.device = next(iter(devices))
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters on {self.device}: tidewire.torch supports cpu and cuda")
        self.staged = self.device.type == "cuda" or os.environ.get("TIDEWIRE_TORCH_STAGING") == "1"
        # Group by module: the name's prefix (with synthetic names, one layer per parameter).
        groups: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
        for nm, p in kept:
            key = nm if synthetic else (nm.rsplit(".", 1)[0] if "." in nm else "")
            groups.setdefault(key, []).append((nm, p))
        # Which modules hold each parameter (for tied weights and prefetch).
        self.holders: Dict[int, List[nn.Module]] = {}
        if self.model is not None:
            for mod in self.model.modules():
                for p in mod._parameters.values():
                    if p is not None:
                        self.holders.setdefault(id(p), []).append(mod)
        self.layers: List[_Layer] = []
        self.by_param: Dict[int, _Param] = {}
        k_rows = self._k_rows()
        for key, ps in groups.items():
            module = None
            if self.model is not None and not synthetic:
                try:
                    module = self.model.get_submodule(key)
                except AttributeError:
                    module = None
            L = _Layer(len(self.layers), key or "<root>", module)
            total = sum(p.numel() for _, p in ps)
            shared = any(len(self.holders.get(id(p), [])) > 1 for _, p in ps)
            if self.sfb and not shared and _is_linear_sfb_candidate(module, ps):
                lin = module
                assert isinstance(lin, nn.Linear)
                L.kind, L.sfb_layout = "fc", True
                L.m, L.n = lin.out_features, lin.in_features + (1 if lin.bias is not None else 0)
                # The bias goes last whatever the order named_parameters gave.
                ps = sorted(ps, key=lambda kv: 0 if kv[1] is lin.weight else 1)
            elif not self.sfb and type(module) is nn.Linear and _is_linear_sfb_candidate(module, ps):
                L.kind, L.m, L.n = "fc", module.out_features, total // module.out_features
            elif isinstance(module, nn.modules.conv._ConvNd) and total % module.out_channels == 0:
                L.kind, L.m, L.n = "conv", module.out_channels, total // module.out_channels
            else:
                L.kind, L.m, L.n = "other", 1, total
            # An embedding with sparse gradients: its layer gets the sparse-push hint. Its
            # sparse .grad is added into the layer's dense view of the flat buffer.
            L.sparse = isinstance(module, nn.Embedding) and bool(module.sparse)
            assert L.m * L.n == total
            L.numel = total
            for nm, p in ps:
                info = _Param(p, nm, L)
                L.params.append(info)
                self.by_param[id(p)] = info
            self.layers.append(L)
        if self.guided:
            # The quality figures travel in one extra layer of one value per learner.
            Q = _Layer(len(self.layers), "tidewire.quality", None)
            Q.kind, Q.m, Q.n, Q.numel = "other", 1, self.env.size, self.env.size
            self.layers.append(Q)
            self.quality = Q
        off = 0
        for L in self.layers:
            L.offset = off
            off += L.numel
        self.total = off
        self.k_rows = k_rows

    def _k_rows(self) -> int:
        """K: the rows of U and V (the batch, times the backward passes per step)."""
        return (self.batch_size or 32) * self.bpps

    def _views(self, flat: torch.Tensor, L: _Layer) -> List[torch.Tensor]:
        blk = flat[L.offset : L.offset + L.numel]
        if L.sfb_layout:
            mat = blk.view(L.m, L.n)
            lin = L.module
            assert isinstance(lin, nn.Linear)
            out = [mat[:, : lin.in_features]]
            if lin.bias is not None:
                out.append(mat[:, lin.in_features])
            return out
        views, at = [], 0
        for info in L.params:
            n = info.param.numel()
            views.append(blk[at : at + n].view(info.param.shape))
            at += n
        return views

    def _table(self) -> List[Tuple[str, str, int, int]]:
        return [(L.name, L.kind + (":sparse" if L.sparse else ""), L.m, L.n) for L in self.layers]

    def _agreed_rates(self) -> Optional[Tuple[float, float, float, float]]:
        """The rates HybComm decides with (``sfb='auto'``), the same on every
        rank: each rank measures its machine (``tidewire calibrate``'s rates,
        about 0.4 s), and one rank probes the link to rank 0 (a TCP stream of
        about 0.3 s: from the first rank of the next host, or rank 1 where
        every rank shares one host); the ranks share the figures and every
        rank takes rank 0's, its CPU divided among the ranks on its host
        (``LOCAL_WORLD_SIZE``), and the probed link. Only rank 0 measures
        (the others wait), so that its figures are the machine's, not a
        share of it taken twice. Rebuilding a CUDA
        layer's gradient from its factors runs on the CPU today, so its GEMM
        is the CPU's. ``TIDEWIRE_RATES`` (JSON) overrides all of it."""
        env = self.env
        given = os.environ.get("TIDEWIRE_RATES")
        if given:
            try:
                d = json.loads(given)
                mine = [float(d[k]) for k in ("link_bytes_per_s", "msg_s", "sum_bytes_per_s", "gemm_flop_per_s")]
            except (ValueError, KeyError, TypeError) as e:
                raise TidewireError(
                    f"TIDEWIRE_RATES={given!r}: {e} (want JSON with link_bytes_per_s, msg_s, sum_bytes_per_s, "
                    "gemm_flop_per_s)"
                ) from None
            every = _allgather_floats(mine, "DistributedOptimizer/rates")
            if any(r != every[0] for r in every):
                raise TidewireError("TIDEWIRE_RATES differs between ranks: give every rank the same")
            link, msg, summ, gemm = every[0]
            return (link, msg, summ, gemm)
        # Only rank 0 measures: every rank takes its figures, and ranks that
        # measured at once on shared cores would each see a fraction of the
        # machine (4 ranks on 2 cores read half the loopback stream and half
        # the GEMM, which then counted twice with the share below). The
        # others wait in the gather, idle.
        c, loop, msg, summ, gemm = _native.calibrate(100) if env.rank == 0 else (0, 0.0, 0.0, 0.0, 0.0)
        probed = 0.0
        probe = None
        if env.size > 1:
            peer = env.local_size if env.size > env.local_size else 1
            if env.rank == 0:
                try:
                    probe = _native.LinkProbe(_probe_host(env.host))
                except (TidewireError, ValueError) as e:
                    warnings.warn(f"tidewire: no link probe ({e}); HybComm weighs the loopback rate", stacklevel=3)
            port = _allgather_small([probe.port if probe is not None else 0], "DistributedOptimizer/probe")[0][0]
            if env.rank == peer and port:
                try:
                    target = _bracketed(env.host) if ":" in env.host else socket.gethostbyname(env.host)
                    probed = _native.probe_stream(f"{target}:{port}", 300)
                except (TidewireError, ValueError, OSError) as e:
                    warnings.warn(
                        f"tidewire: the link probe to rank 0 failed ({e}); HybComm weighs the loopback rate",
                        stacklevel=3,
                    )
        every = _allgather_floats([float(c), loop, msg, summ, gemm, probed], "DistributedOptimizer/rates")
        probed = max(r[5] for r in every)
        if probe is not None and probed > 0:
            try:
                probe.join()  # done already: the prober read its count before the gather
            except TidewireError as e:
                warnings.warn(f"tidewire: the link probe's server: {e}", stacklevel=3)
        # Without a probe, rank 0's server thread gives up by itself within 30 s.
        cores0, loop0, msg0, summ0, gemm0, _ = every[0]
        share = min(1.0, cores0 / max(1, env.local_size))
        link = loop0 * share
        if probed > 0:
            link = min(link, probed)
        return (link, msg0 / share, summ0 * share, gemm0 * share)

    def _build_session(self) -> None:
        env = self.env
        index = _new_index()
        policy = "ps" if not self.sfb else ("sfb" if self.sfb == "always" else "hybrid")
        if env.local_agg:
            policy = "ps"  # a node's learners sum gradients: no factors (see __init__)
        apply_op: Union[str, Tuple[str, float, float, float]] = "mean"
        if self.sgd is not None:
            apply_op = ("sgd",) + self.sgd  # type: ignore[assignment]
        desc = repr(
            (index, self._table(), [L.sfb_layout for L in self.layers], self.apply, apply_op, policy,
             self.k_rows, self.consistency, self.bpps, self.comm)
        )
        digest = zlib.crc32(desc.encode())
        mine = [index & 0xFFFF, len(self.layers) & 0xFFFF, digest & 0xFFFF, digest >> 16]
        every = _allgather_small(mine, "DistributedOptimizer/table")
        differ = [r for r, v in enumerate(every) if v != every[0]]
        if differ:
            raise TidewireError(
                f"ranks {differ} would build a different DistributedOptimizer than rank 0 (layer table, apply, sfb, "
                f"batch_size, consistency or backward_passes_per_step differ, or the ranks built optimizers in a "
                f"different order). This rank (rank {env.rank}) has {len(self.layers)} layers: "
                + ", ".join(f"{n} {k} {m}x{nn_}" for n, k, m, nn_ in self._table()[:8])
                + (" ..." if len(self.layers) > 8 else "")
            )
        rates = self._agreed_rates() if policy == "hybrid" else None
        self.rates = rates
        pin = self.device.type == "cuda"
        self.g_host = torch.zeros(self.total, dtype=self.dtype, pin_memory=pin)
        self.r_host = torch.zeros(self.total, dtype=self.dtype, pin_memory=pin)
        if self.staged:
            self.g_dev = torch.zeros(self.total, dtype=self.dtype, device=self.device)
            self.r_dev = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        else:
            self.g_dev, self.r_dev = self.g_host, self.r_host
        # Both modes start from the parameters' values: the session broadcasts rank 0's.
        for L in self.layers:
            for info, v in zip(L.params, self._views(self.r_host, L)):
                v.copy_(info.param.detach())
        self.index = index
        self.session = _Guard(_native.Session(
            self._table(),
            params=self.r_host,
            grads=self.g_host,
            **_place(env, index),
            master=env.master(index),
            secret=env.secret,
            job=_job_id(env, index),
            batch=self.k_rows,
            apply=apply_op,
            consistency=self.consistency,
            policy=policy,
            transport=env.transport,
            timeout=self.timeout,
            connect_timeout=max(self.timeout, 60.0),
            comm=self.comm if self.comm_on else None,
            checkpoint=self.ckpt if self.ckpt_dir is not None else None,
            resume=self.resumed_from,
            rates=rates,
        ))
        self.start_step = self.session.start_iteration
        if self.staged:
            self.r_dev.copy_(self.r_host)
        for L in self.layers:
            L.scheme = self.session.scheme(L.index)
            gv, rv = self._views(self.g_dev, L), self._views(self.r_dev, L)
            for info, g, r in zip(L.params, gv, rv):
                info.gview, info.rview = g, r
                p = info.param
                with torch.no_grad():
                    if p.grad is not None:
                        g.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                    if self.apply == "server":
                        p.data = r  # the parameter lives in the registered buffer
                    else:
                        p.copy_(r)  # rank 0's initial values
                p.grad = g

    def _install_hooks(self) -> None:
        for info in self.by_param.values():
            info.hook = info.param.register_post_accumulate_grad_hook(self._make_grad_hook(info))
            self.handles.append(info.hook)
        for L in self.layers:
            if L.scheme == "sfb":
                assert isinstance(L.module, nn.Linear)
                self.handles.append(L.module.register_forward_hook(self._make_capture(L)))
        if self.prefetch and self.apply == "server" and self.model is not None:
            owners: Dict[int, Tuple[nn.Module, List[_Layer]]] = {}
            for info in self.by_param.values():
                for mod in self.holders.get(id(info.param), []):
                    entry = owners.setdefault(id(mod), (mod, []))
                    if info.layer not in entry[1]:
                        entry[1].append(info.layer)
            for mod, layers in owners.values():
                self.handles.append(mod.register_forward_pre_hook(self._make_prefetch(mod, layers)))

    # ----------------------------------------------------------------- hooks

    def _make_grad_hook(self, info: _Param) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p is info.param:  # not a deep copy that took the hook along
                self._on_grad(info)

        return hook

    def _make_capture(self, L: _Layer) -> Callable[..., None]:
        lin = L.module
        assert isinstance(lin, nn.Linear)

        def capture(mod: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            if mod is not lin or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if not args or not isinstance(args[0], torch.Tensor):
                return
            call = _Call(args[0].detach().reshape(-1, lin.in_features))
            L.calls.append(call)

            def grab(g: torch.Tensor) -> None:
                d = g.detach().reshape(-1, lin.out_features)
                call.delta = d if call.delta is None else call.delta + d

            output.register_hook(grab)

        return capture

    def _make_prefetch(self, module: nn.Module, layers: List[_Layer]) -> Callable[..., None]:
        def pre(mod: nn.Module, _args: Any) -> None:
            if mod is not module:
                return
            for L in layers:
                if L.in_flight:
                    self._pull(L)

        return pre

    def _bound(self, info: _Param) -> bool:
        g = info.param.grad
        return (
            g is not None
            and not g.is_sparse  # a sparse .grad (nn.Embedding(sparse=True)) is never the view
            and g.data_ptr() == info.gview.data_ptr()
            and g.stride() == info.gview.stride()
        )

    def _rebind(self, info: _Param) -> None:
        """Puts ``p.grad`` back on its view of the flat gradient buffer (after
        user code replaced it, e.g. ``model.zero_grad(set_to_none=True)``)."""
        g = info.param.grad
        with torch.no_grad():
            if g is None:
                info.gview.zero_()
            else:
                # A sparse gradient (nn.Embedding(sparse=True) whose .grad was set to
                # None) is densified here; later ones add into the dense view in place.
                info.gview.copy_(g.to_dense() if g.is_sparse else g)
        info.param.grad = info.gview
        self.grad_rebinds += 1

    def _on_grad(self, info: _Param) -> None:
        L = info.layer
        self.pending = True
        info.count += 1
        if info.count > self.bpps:
            raise TidewireError(
                f"the gradient of {info.name} accumulated {info.count} times before step(), but "
                f"backward_passes_per_step={self.bpps}: call step() after every {self.bpps} backward pass(es)"
            )
        if L.in_flight:
            raise TidewireError(
                f"the gradient of {info.name} accumulated while its layer {L.name} was being synced: a "
                "parameter was used outside the modules whose forward pulls it (prefetch=True), or step() "
                "was skipped"
            )
        if not self._bound(info):
            self._rebind(info)
        if info.count == self.bpps:
            L.ready += 1
            if L.ready == len(L.params) and not L.pushed and self._pushes_now():
                self._push(L)

    def _pushes_now(self) -> bool:
        """Whether backward pushes layers as it goes: not between exchanges, and
        never in average mode (the parameters go out after the local step)."""
        return not self.comm_on or (self.comm_mode == "accumulate" and self.guide.due())

    # ----------------------------------------------------------------- push / pull

    def _cuda_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _factors(self, L: _Layer) -> Tuple[torch.Tensor, torch.Tensor]:
        lin = L.module
        assert isinstance(lin, nn.Linear)
        calls = [c for c in L.calls if c.delta is not None]
        L.calls = []
        k = self.session.batch
        u = torch.zeros(k, L.m, dtype=torch.float32)
        v = torch.zeros(k, L.n, dtype=torch.float32)
        rows = sum(c.x.shape[0] for c in calls)
        if rows > k:
            raise TidewireError(
                f"layer {L.name} (nn.Linear, synced by sufficient factors) saw {rows} input rows this step, "
                f"more than K={k} (batch_size={self.batch_size} x backward_passes_per_step={self.bpps}): pass "
                "batch_size= the largest per-rank batch times the rows per sample, or sfb=False"
            )
        at = 0
        for c in calls:
            n = c.x.shape[0]
            assert c.delta is not None
            u[at : at + n] = c.delta.to(device="cpu", dtype=torch.float32)
            v[at : at + n, : lin.in_features] = c.x.to(device="cpu", dtype=torch.float32)
            if lin.bias is not None:
                v[at : at + n, lin.in_features] = 1.0
            at += n
        return u, v

    def _check_factors(self, L: _Layer, u: torch.Tensor, v: torch.Tensor) -> None:
        """Once per layer: the factors must give autograd's own gradient (they
        would not if the weight were used outside the module's forward)."""
        L.checked = True
        dense = self.g_dev[L.offset : L.offset + L.numel].view(L.m, L.n).detach().to("cpu")
        recon = u.t() @ v
        scale = float(dense.abs().max()) if dense.numel() else 0.0
        if not torch.allclose(recon, dense, rtol=1e-3, atol=1e-5 * max(scale, 1e-12)):
            err = float((recon - dense).abs().max())
            raise TidewireError(
                f"layer {L.name}: the sufficient factors captured from nn.Linear's forward do not give the "
                f"gradient autograd accumulated (max difference {err:.3g} of {scale:.3g}); its weight is "
                "probably used outside the module's forward, or the gradient was not zeroed before the "
                "first step. Pass sfb=False"
            )

    def _push(self, L: _Layer) -> None:
        if L.scheme == "sfb":
            if self.staged:
                self._cuda_sync()
            u, v = self._factors(L)
            if not L.checked:
                self._check_factors(L, u, v)
            self.session.push_factors(L.index, u.numpy(), v.numpy())
        else:
            if self.staged:
                self._cuda_sync()
                sl = slice(L.offset, L.offset + L.numel)
                self.g_host[sl].copy_(self.g_dev[sl])
            self.session.push(L.index)
        L.pushed = True
        L.in_flight = True

    def _landed(self, L: _Layer) -> None:
        L.in_flight = False
        sl = slice(L.offset, L.offset + L.numel)
        if self.staged:
            self.r_dev[sl].copy_(self.r_host[sl])
        if L.zero_on_pull:
            L.zero_on_pull = False
            with torch.no_grad():
                self.g_dev[sl].zero_()

    def _pull(self, L: _Layer) -> None:
        self.session.pull(L.index)
        self._landed(L)

    def push_remaining(self) -> None:
        """Pushes every layer not pushed this step (parameters without a
        gradient this step push zeros, or what their ``.grad`` holds)."""
        for L in self.layers:
            if L.pushed:
                continue
            if L.in_flight:  # pushed last step, never pulled (prefetch without a forward)
                self._pull(L)
            for info in L.params:
                if not self._bound(info):
                    self._rebind(info)
            self._push(L)

    def pull_all(self) -> None:
        self.session.pull_all()
        for L in self.layers:
            if L.in_flight:
                self._landed(L)

    def use_results(self, on: bool) -> None:
        """Local mode: point each ``p.grad`` at the averaged gradient (on) or
        back at the flat gradient buffer (off)."""
        for info in self.by_param.values():
            info.param.grad = info.rview if on else info.gview

    def end_step(self, exchanged: bool = True) -> None:
        for info in self.by_param.values():
            info.count = 0
        for L in self.layers:
            L.ready = 0
            L.pushed = False
            L.calls = []
        self.synced = False
        self.pending = False
        self.steps_done += 1
        k = self.start_step + self.steps_done
        if self.ckpt_dir is not None and k % self.ckpt_every == 0 and self.env.rank == 0:
            self._save_checkpoint(k)
        if exchanged and self.broadcast_buffers and self.model is not None:
            bufs = [b for _, b in sorted(self.model.named_buffers(), key=lambda kv: kv[0]) if b is not None]
            if bufs:
                outs = _broadcast_flat(bufs, 0, "DistributedOptimizer/buffers")
                with torch.no_grad():
                    for b, o in zip(bufs, outs):
                        b.copy_(o)

    def zero(self) -> None:
        if self.accumulating:
            return  # accumulate mode: the gradients add up until the next exchange
        for L in self.layers:
            if L.in_flight:
                L.zero_on_pull = True
            else:
                with torch.no_grad():
                    self.g_dev[L.offset : L.offset + L.numel].zero_()
            for info in L.params:
                if not self._bound(info):
                    info.param.grad = info.gview
                    self.grad_rebinds += 1

    def report_quality(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item()
        self.guide.report(float(value))

    def _exchange(self, average: bool) -> Dict[str, Any]:
        """Pushes every layer (and the quality figures), waits, and feeds the controller.
        ``average``: the layers carry the parameters, and come back averaged."""
        Q = self.quality
        if Q is not None:
            fig = self.guide.figure()
            if fig is None:
                raise TidewireError(
                    "quality_guided=True: no quality figure since the last exchange: call "
                    "opt.report_quality(loss) every step, before step()"
                )
            with torch.no_grad():
                q = self.g_dev[Q.offset : Q.offset + Q.numel]
                q.zero_()
                q[self.env.rank] = fig
        if average:
            with torch.no_grad():
                for info in self.by_param.values():
                    info.gview.copy_(info.param.detach())
        self.push_remaining()
        self.synced = True
        self.pull_all()
        if average:
            with torch.no_grad():
                for info in self.by_param.values():
                    info.param.copy_(info.rview)
                self.g_dev.zero_()
        synced = None
        if Q is not None:
            synced = self.r_dev[Q.offset : Q.offset + Q.numel].to("cpu", torch.float32).tolist()
        return self.guide.exchanged(synced)

    def comm_step(self, opt_step: Callable[[], Any]) -> None:
        """One step under comm_every/comm_mode/quality_guided (apply='local')."""
        due = self.guide.due()
        self.since = 0 if due else self.since + 1
        if self.comm_mode == "accumulate":
            if due:
                self._exchange(average=False)
                self.use_results(True)
                try:
                    opt_step()
                finally:
                    self.use_results(False)
                self.accumulating = False
            else:
                self.guide.local_step()
                self.accumulating = True
        else:
            opt_step()  # a local step on this learner's own gradients
            if due:
                self._exchange(average=True)
            else:
                self.guide.local_step()
        self.end_step(exchanged=due)

    def flush(self, opt_step: Callable[[], Any]) -> bool:
        """Exchanges what the steps since the last exchange left (outside the
        schedule): average mode averages the models, accumulate mode syncs and
        applies the accumulated gradients. Returns whether it exchanged."""
        if not self.comm_on:
            return False
        if self.since == 0:
            return False
        self.extra_exchanges += 1
        average = self.comm_mode == "average"
        Q = self.quality
        if Q is not None:
            with torch.no_grad():
                self.g_dev[Q.offset : Q.offset + Q.numel].zero_()
        if average:
            with torch.no_grad():
                for info in self.by_param.values():
                    info.gview.copy_(info.param.detach())
        self.push_remaining()
        self.synced = True
        self.pull_all()
        with torch.no_grad():
            if average:
                for info in self.by_param.values():
                    info.param.copy_(info.rview)
                self.g_dev.zero_()
            else:
                self.use_results(True)
                try:
                    opt_step()
                finally:
                    self.use_results(False)
                self.accumulating = False
        self.since = 0
        self.end_step(exchanged=True)
        return True

    def check_server_hparams(self, opt: torch.optim.Optimizer) -> None:
        assert self.sgd is not None
        now = self._server_sgd(opt, check_type=False)
        if now != self.sgd:
            raise TidewireError(
                f"apply='server': (lr, momentum, weight_decay) changed from {self.sgd} to {now} after the "
                "DistributedOptimizer was built; Tidewire's servers apply fixed values. Use apply='local' "
                "for a learning-rate schedule"
            )

    def synchronize_all(self, force: bool) -> None:
        """Pushes what is left of this step (``force``: even when no gradient
        arrived since the last step) and pulls every layer."""
        if not self.synced and (force or self.pending):
            self.push_remaining()
            self.synced = True
        self.pull_all()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.handles:
            h.remove()
        self.handles = []
        try:
            if self.session.broken is None:
                self.pull_all()
        finally:
            self.session.close()

    def stats(self) -> Dict[str, Any]:
        s: Dict[str, Any] = dict(self.session.stats())
        s["grad_rebinds"] = self.grad_rebinds
        s["transport"] = self.session.transport[0]
        s["schemes"] = {L.name: L.scheme for L in self.layers}
        if self.rates is not None:
            s["rates"] = dict(zip(("link_bytes_per_s", "msg_s", "sum_bytes_per_s", "gemm_flop_per_s"), self.rates))
        g = self.guide
        s["comm_every"] = g.t
        if self.comm_on:
            s["steps"] = g.steps
            s["exchanges"] = g.exchanges + self.extra_exchanges
        else:  # every step exchanges
            s["steps"] = s["exchanges"] = self.steps_done
        if self.guided:
            s["freq_history"] = g.history()
            s["freq_memory"] = {t: {"quality": q, "rejected": r, "windows": w} for t, q, r, w in g.memory()}
        return s


class _DistributedOptimizer(torch.optim.Optimizer):
    """What :func:`DistributedOptimizer` returns: an instance of a subclass
    of the wrapped optimizer's class with this mixed in (``step``,
    ``zero_grad``, ``synchronize``, ``skip_synchronize``, ``tidewire_stats``,
    ``close``); see there."""

    _tw: _Tw

    @property
    def start_step(self) -> int:
        """Steps done before this optimizer: 0, or the resumed checkpoint's
        step (``resume=``). Train from here."""
        return self._tw.start_step

    @property
    def resumed_from(self) -> Optional[str]:
        """The checkpoint this optimizer resumed from, or None."""
        return self._tw.resumed_from

    def checkpoint_stats(self) -> Optional[Dict[str, Any]]:
        """What this rank's checkpoints cost so far (``written``, ``copy_s``,
        ``write_s``, ``bytes``), or None without ``checkpoint_dir``."""
        return self._tw.session.checkpoint_stats()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One training step: pushes the layers not pushed yet, waits for the
        servers, and then ``apply='local'``: runs the wrapped optimizer on the
        averaged gradients; ``apply='server'``: nothing more, the parameters
        are the servers' updated ones (with ``prefetch=True`` this does not
        wait: each module's forward pulls its layer). A ``closure`` is called
        once, before the sync. Then rank 0's module buffers are broadcast
        (``broadcast_buffers``)."""
        tw = self._tw
        if tw.closed:
            raise TidewireError("this DistributedOptimizer was shut down")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if tw.comm_on:
            if tw.skip_sync:
                raise TidewireError("skip_synchronize() does not combine with comm_every/comm_mode/quality_guided")
            tw.comm_step(lambda: super(_DistributedOptimizer, self).step())
            return loss
        if tw.apply == "local":
            if tw.skip_sync:
                if not tw.synced:
                    raise TidewireError("skip_synchronize(): call synchronize() before step()")
            else:
                tw.synchronize_all(force=True)
            tw.use_results(True)
            try:
                super().step()
            finally:
                tw.use_results(False)
        else:
            tw.check_server_hparams(self)
            if tw.skip_sync and not tw.synced:
                raise TidewireError("skip_synchronize(): call synchronize() before step()")
            if not tw.synced:
                tw.push_remaining()
                tw.synced = True
            if not tw.prefetch:
                tw.pull_all()
        tw.end_step()
        return loss

    def report_quality(self, value: Any) -> None:
        """Reports this step's quality figure (a loss: lower is better; a
        float or a tensor, whose mean is taken) for ``quality_guided=True``.
        Call it every step before :meth:`step`; the figures of the steps since
        the last exchange are averaged and travel with the next exchange."""
        self._tw.report_quality(value)

    def flush(self) -> bool:
        """With ``comm_every``/``comm_mode``: exchanges what the steps since the
        last exchange left, outside the schedule (``'average'``: the models are
        averaged; ``'accumulate'``: the accumulated gradients are synced and the
        optimizer steps). Collective: call it on every rank, at the end of
        training (before evaluating or saving), so that every replica is the
        same. Returns whether it exchanged (False when the last step did)."""
        return self._tw.flush(lambda: super(_DistributedOptimizer, self).step())

    def synchronize(self) -> None:
        """Pushes what is left of this step and waits for every layer, so that
        user code may look at the result before :meth:`step` (then call
        ``step()`` inside :meth:`skip_synchronize`). In ``apply='local'``
        mode each ``p.grad`` then holds the averaged gradient until ``step()``
        (clip it here, like with Horovod); in ``'server'`` mode the parameters
        are the updated ones. With no backward since the last ``step()`` it
        only waits for the layers in flight (``prefetch``): call it before
        reading or saving the parameters."""
        tw = self._tw
        tw.synchronize_all(force=False)
        if tw.apply == "local" and tw.synced:
            tw.use_results(True)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not sync again (after an explicit
        :meth:`synchronize`)."""
        self._tw.skip_sync = True
        try:
            yield
        finally:
            self._tw.skip_sync = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes every synced gradient in place. ``set_to_none`` is ignored:
        the gradients are views into Tidewire's registered buffer and stay
        there (a layer still in flight is zeroed when it lands)."""
        self._tw.zero()
        # Parameters this optimizer updates but Tidewire does not sync (frozen ones).
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in self._tw.by_param and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Not supported after wrapping (the layer table is fixed): add groups first."""
        if getattr(self, "_tw", None) is not None:
            raise TidewireError("add_param_group after DistributedOptimizer: add every group before wrapping")
        super().add_param_group(param_group)

    def tidewire_stats(self) -> Dict[str, Any]:
        """The session's counters, plus ``grad_rebinds`` (gradients user code
        had replaced and that were copied back into the registered buffer),
        the transport, each layer's scheme, and with ``sfb='auto'`` the
        ``rates`` HybComm decided them with."""
        return self._tw.stats()

    def close(self) -> None:
        """Pulls every layer and ends this optimizer's session. Collective."""
        self._tw.close()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]] = None,
    backward_passes_per_step: int = 1,
    model: Optional[nn.Module] = None,
    apply: str = "local",
    sfb: Union[bool, str] = "auto",
    consistency: Union[str, Tuple[str, int]] = "bsp",
    prefetch: bool = False,
    batch_size: Optional[int] = None,
    *,
    broadcast_buffers: Optional[bool] = None,
    timeout: Optional[float] = None,
    comm_every: int = 1,
    comm_mode: str = "accumulate",
    quality_guided: bool = False,
    comm_every_max: int = 16,
    quality_period: int = 4,
    quality_tolerance: float = 0.02,
    quality_revert_at: Optional[int] = None,
    checkpoint_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
    checkpoint_every: int = 100,
    checkpoint_keep: int = 2,
    resume: Union[bool, str, "os.PathLike[str]"] = False,
) -> _DistributedOptimizer:
    """Wraps a torch optimizer so that every rank trains on the average of
    every rank's gradients. Collective (it builds a Tidewire session; every
    rank wraps the same model the same way, in the same order).

    The result is an instance of a subclass of ``optimizer``'s class sharing
    its ``param_groups`` and ``state``: ``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict`` and LR schedulers work as before.

    How it syncs
        The parameters of each module (named parameters grouped by their
        prefix: ``features.0.weight`` and ``features.0.bias`` are one layer)
        are one Tidewire layer. Each parameter's ``.grad`` is a view into one
        flat float32 gradient buffer that Tidewire registered in place, so
        backward accumulates straight into what is sent (zero copy). When the
        last parameter of a layer has accumulated (on the
        ``backward_passes_per_step``-th backward), a post-accumulate-grad hook
        pushes the layer at once (wait-free backprop); :meth:`step` pushes the
        layers no hook pushed (unused parameters push zeros), then waits.
        Every rank starts from rank 0's parameter values (the session's build
        broadcasts them). Tied parameters count once; parameters with
        ``requires_grad=False`` are not synced.

    ``apply='local'`` (default)
        The servers average the gradients (``ApplyOp::Mean``) into a second
        flat buffer; ``step()`` points each ``p.grad`` there, runs the wrapped
        optimizer (any torch optimizer), and points it back.
    ``apply='server'``
        ``torch.optim.SGD`` with one param group only (no Nesterov,
        dampening 0): the servers apply SGD and each parameter's ``.data`` is a
        view into the buffer they write, so after ``step()`` the parameters
        are already updated. Tidewire's Caffe-form momentum
        (``v = m v + lr (g + wd w); w -= v``) equals torch's
        (``b = m b + g + wd w; w -= lr b``) for a constant lr; lr, momentum and
        weight decay are read once (changing them later raises). The torch
        optimizer's state stays empty (the momentum lives on the servers).
    ``sfb``
        Sufficient-factor broadcast for ``nn.Linear`` layers (Poseidon).
        ``'auto'``/``True`` (default): HybComm chooses per layer by its cost
        model, when ``model`` and ``batch_size`` are given (otherwise every
        layer goes through the PS); ``'always'``: every eligible linear layer;
        ``False``: parameter server only. A forward hook keeps the layer's
        input x (K×in) and a hook on its output takes δ (K×out); U = δ and
        V = [x, 1] (with a bias; the weight and bias are then views into one
        out×(in+1) block), zero-padded to K = ``batch_size`` ×
        ``backward_passes_per_step`` rows (``batch_size``: this rank's rows
        per backward pass, the most any step sees; more raise). K is also the
        cost model's batch. Eligible: exactly ``nn.Linear``
        whose weight is not shared. The first step checks Uᵀ V against
        autograd's gradient.
    ``consistency``
        ``'bsp'`` (default) or ``('ssp', s)`` (``apply='server'`` only).
    ``prefetch``
        P3 overlap (``apply='server'``, needs ``model``): ``step()`` does not
        wait, and a forward pre-hook on each module pulls its layers just
        before its forward, so the next forward starts as soon as its first
        layer is back. In ``'local'`` mode it has no effect: the torch
        optimizer needs every averaged gradient before it steps.
    ``broadcast_buffers``
        Default: True when ``model`` is given. After each step rank 0's module
        buffers (BatchNorm running statistics, counters) are copied to every
        rank, like DDP's ``broadcast_buffers``.
    ``timeout``
        Seconds a wait may last (default ``TIDEWIRE_TIMEOUT`` or 60).
    ``comm_every``, ``comm_mode``
        Communication frequency (Nexus): :meth:`step` is called every batch
        and exchanges with the servers every ``comm_every`` (T) steps
        (``apply='local'``, ``consistency='bsp'``, parameter servers only:
        ``sfb`` becomes False). ``'accumulate'`` (default): ``zero_grad`` does
        not clear the gradients between exchanges, so autograd **sums** them
        over the T batches; the T-th step pushes the sum (wait-free, as
        backward produces it), the servers average it over the ranks and the
        wrapped optimizer steps once; the steps between change nothing (like
        Horovod's ``backward_passes_per_step``, with one ``step()`` per batch;
        divide the loss or the lr by T for a mean). ``'average'``: every step
        runs the wrapped optimizer on this rank's own gradients (local SGD,
        momentum and optimizer state stay local), and every T-th step pushes
        the parameters, which come back averaged over the ranks (Nexus's BSP
        model averaging; the lr keeps its per-batch meaning). At the end of
        training call :meth:`flush` on every rank, so the replicas are equal.
        ``tidewire_stats()`` counts ``steps`` and ``exchanges``.
    ``quality_guided``, ``comm_every_max``, ``quality_period``, ``quality_tolerance``, ``quality_revert_at``
        Nexus's quality-guided adjustment of T: call
        :meth:`report_quality` with the loss every step. Every
        ``quality_period`` exchanges the leader proposes a larger T (twice the
        current one, up to ``comm_every_max``; a T rejected before is never
        proposed again); if any rank's mean loss over the next
        ``quality_period`` exchanges is worse than over the previous window by
        more than ``quality_tolerance`` (relative), that rank rejects and every
        rank falls back. From step ``quality_revert_at`` on, T is
        ``comm_every`` again for good. The figures travel with every exchange
        (one extra layer of one float per rank), and each rank runs the same
        controller (``tidewire._native.FreqGuide``, the engine's
        ``freq::FreqController``) on the same figures, so all ranks switch at
        the same step: the leader's proposal and the verdicts are replicated,
        not sent. ``tidewire_stats()`` adds ``freq_history`` (each decision
        and its step) and ``freq_memory`` (the quality of every T tried). All
        these settings are agreed at the build (a rank that differs fails).

    ``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_keep``, ``resume``
        Checkpoints every ``checkpoint_every`` steps (``tidewire::checkpoint``):
        the servers' state (their momentum, ``apply='server'``) and worker 0's
        parameters as safetensors in ``checkpoint_dir/step-NNNNNNNN/``, and
        beside them rank 0's torch side (``torch.save`` of the model's
        ``state_dict``, or the parameters, and the optimizer's), written
        atomically off the training path. ``resume=True`` starts from the
        newest complete checkpoint in ``checkpoint_dir`` when there is one (so
        a script run again by torchrun's elastic restart goes on where it
        stopped); a path resumes from that checkpoint. Then the parameters,
        module buffers and optimizer state are the checkpoint's, and
        ``opt.start_step`` is the number of steps already done: train from
        there. Every rank passes the same; ``checkpoint_dir`` must be one
        directory all ranks see. A fresh job refuses a directory that holds
        checkpoints. Not with ``comm_every``/``quality_guided`` or local
        aggregation (yet).

    Do not modify ``.grad`` between backward and ``step()`` (the layers may
    be in flight): call :meth:`synchronize` first, then ``step()`` within
    :meth:`skip_synchronize`. ``zero_grad`` zeroes in place (grads are never
    None); if user code replaces ``p.grad`` anyway, the hook copies it back
    into the buffer (counted as ``grad_rebinds`` in ``tidewire_stats()``).
    CUDA parameters are staged through pinned host buffers (the current
    stream is synchronized before each push).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__doc__": _DistributedOptimizer.__doc__})
    obj = cls.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    tw = _Tw(
        optimizer,
        named_parameters,
        backward_passes_per_step,
        model,
        apply,
        sfb,
        consistency,
        prefetch,
        batch_size,
        broadcast_buffers,
        timeout,
        dict(
            comm_every=comm_every,
            comm_mode=comm_mode,
            quality_guided=quality_guided,
            comm_every_max=comm_every_max,
            quality_period=quality_period,
            quality_tolerance=quality_tolerance,
            quality_revert_at=quality_revert_at,
        ),
        dict(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            resume=resume,
        ),
    )
    obj._tw = tw
    tw.restore(obj)
    with _state.lock:
        _state.optimizers.append(obj)
    return obj
