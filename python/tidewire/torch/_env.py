"""Who this process is in the job: the launcher's environment (rank, world and local
size, the rendezvous address, the secret), each session's placement, and host helpers.

The job secret comes from ``init(secret=...)``, else ``TIDEWIRE_SECRET``, else
torch's store: under torchrun its agent's store (``MASTER_ADDR:MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``), else the store of an initialized default
process group. There rank 0 puts a fresh random secret under a key of the run and
restart attempt, and the other ranks read it. Anyone who can reach that store can
read the secret: it is as private as torch.distributed's own rendezvous."""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import tempfile
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple, Union

from .._config import LocalAggregation
from .._native import TidewireError


#: Default offset of Tidewire's base port from ``MASTER_PORT`` (``TIDEWIRE_PORT_OFFSET``).
PORT_OFFSET = 1000


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
        local_size_given: bool = False,
        secret_source: str = "",
    ) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        #: Whether the launcher gave the local size (else 1 stands in for it).
        self.local_size_given = local_size_given
        self.local_agg = local_agg
        self.cache_staleness = cache_staleness
        self.source = source
        self.host = host
        self.base_port = base_port
        self.secret = secret
        #: Where the secret came from: ``init(secret=...)``, ``TIDEWIRE_SECRET``, a
        #: torch store (``torchrun's store at host:port``, ``the default process
        #: group's store``) or ``generated`` (a job of one).
        self.secret_source = secret_source
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
    if timeout is None:
        try:
            timeout = float(env.get("TIDEWIRE_TIMEOUT", "60"))
        except ValueError:
            raise TidewireError(f"TIDEWIRE_TIMEOUT={env['TIDEWIRE_TIMEOUT']!r} is not a number") from None
    job = _env_int("TIDEWIRE_JOB", env.get("TIDEWIRE_JOB", "1"))
    transport = env.get("TIDEWIRE_TRANSPORT", "auto").strip().lower() or "auto"
    size_keys = ("TIDEWIRE_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
    local_size = next((_env_int(k, env[k]) for k in size_keys if k in env), 1)
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
    # Last: under torchrun, the other ranks wait here for rank 0's secret.
    secret, secret_source = _job_secret(secret, size_, timeout)
    return _Env(
        rank_, size_, local, source, host, base, secret, job, timeout, transport,
        local_size, bool(local_aggregation), staleness, any(k in env for k in size_keys), secret_source,
    )


# --------------------------------------------------------------------------- job secret


#: Where rank 0 puts the job secret in torch's store; the run and the restart
#: attempt follow, so that a job torchrun restarts gets a fresh secret.
SECRET_KEY = "tidewire/job-secret"


def _job_secret(secret: Union[str, bytes, None], size: int, timeout: float) -> Tuple[bytes, str]:
    """The job secret and where it came from: ``secret`` (``init(secret=...)``), else
    ``TIDEWIRE_SECRET``, else torch's store (see the module docs), else a fresh one
    for a job of one. A job of several with none of them is an error."""
    source = "init(secret=...)"
    if secret is None:
        secret, source = os.environ.get("TIDEWIRE_SECRET"), "TIDEWIRE_SECRET"
    if not secret and size > 1:
        shared = _store_secret(timeout)
        if shared is None:
            raise TidewireError(
                "TIDEWIRE_SECRET is not set: Tidewire's ranks authenticate each other with a job secret. "
                "Set TIDEWIRE_SECRET to the same string on every rank (for example "
                "`export TIDEWIRE_SECRET=$(head -c 16 /dev/urandom | xxd -p)` before the launcher), "
                "or pass init(secret=...); under torchrun, or after torch.distributed.init_process_group, "
                "rank 0 shares one through torch's store instead"
            )
        return shared
    if not secret:
        return _secrets.token_hex(16).encode(), "generated"
    return (secret.encode() if isinstance(secret, str) else bytes(secret)), source


def _store_secret(timeout: float) -> Optional[Tuple[bytes, str]]:
    """The job secret shared through torch's store: torchrun's agent store
    (every worker is a client of it, ``init_process_group`` or not), else the
    store of the initialized default process group; None where neither exists.
    The store's rank 0 puts a fresh one (``secrets``, 32 bytes) unless one is
    there already (a second ``init`` in the same attempt reuses it); the others
    wait for it, ``timeout`` seconds at most."""
    env = os.environ
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    run = env.get("TORCHELASTIC_RUN_ID", "none")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"{SECRET_KEY}/{run}/attempt-{attempt}"
    wait = timedelta(seconds=timeout)
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and addr and port and "RANK" in env:
        where = f"torchrun's store at {_bracketed(addr)}:{port}"
        first = _env_int("RANK", env["RANK"]) == 0
        try:
            store = dist.TCPStore(addr, _env_int("MASTER_PORT", port), is_master=False, timeout=wait,
                                  wait_for_workers=False)
        except (RuntimeError, ValueError) as e:
            raise TidewireError(
                f"cannot reach {where} to share Tidewire's job secret: {_first_line(e)} "
                "(set TIDEWIRE_SECRET to the same string on every rank to do without it)"
            ) from None
    elif dist.is_initialized() and hasattr(dist.distributed_c10d, "_get_default_store"):
        where = "the default process group's store"
        first = dist.get_rank() == 0
        store = dist.distributed_c10d._get_default_store()
    else:
        return None
    try:
        if first:
            value = store.compare_set(key, "", _secrets.token_hex(32).encode())
        else:
            store.wait([key], wait)
            value = store.get(key)
    except RuntimeError as e:  # torch.distributed.DistError and its timeouts
        if first:
            raise TidewireError(f"cannot put Tidewire's job secret in {where}: {_first_line(e)}") from None
        raise TidewireError(
            f"rank 0 did not share Tidewire's job secret through {where} within {timeout:g} s "
            f"(key {key!r}; {_first_line(e)}): is rank 0 running tidewire.torch.init() in the same "
            "torchrun attempt? Set TIDEWIRE_SECRET to the same string on every rank to do without it"
        ) from None
    if len(value) < 16:
        raise TidewireError(f"the job secret in {where} (key {key!r}) is {len(value)} bytes: want 16 or more")
    return bytes(value), where


def _first_line(e: BaseException) -> str:
    """An exception's message without the C++ backtrace torch appends."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
    local = LocalAggregation(n, env.local_rank, path, nonce, env.cache_staleness)
    return {"rank": node, "world": env.size // n, "local": local}


def _job_id(env: _Env, index: int) -> int:
    return (env.job << 16) | (index & 0xFFFF)


def _probe_host(host: str) -> str:
    """The address rank 0's link probe listens on: every interface, in the
    family of ``host`` (the address the other ranks reach rank 0 at)."""
    return "::" if ":" in host else "0.0.0.0"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
