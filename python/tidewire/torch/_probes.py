"""Horovod's questions about the job (local_size, cross_rank, cross_size) and
about the library (mpi_built and the other ``*_built``/``*_enabled`` probes)."""

from __future__ import annotations

import socket
import zlib
from typing import List, Optional

from ._runtime import _require, _state


class _Topology:
    """Where every rank runs, gathered once by :func:`init` (one small collective)."""

    def __init__(self, rank: int, local_ranks: List[int], hosts: List[int], launcher_local_size: Optional[int]) -> None:
        me = local_ranks[rank]
        #: Ranks on this host: the launcher's count (LOCAL_WORLD_SIZE, ...) when it gives one.
        self.local_size = launcher_local_size or sum(1 for h in hosts if h == hosts[rank])
        peers = [r for r, lr in enumerate(local_ranks) if lr == me]
        #: Horovod's cross communicator: the ranks with this rank's local rank, in rank order.
        self.cross_size = len(peers)
        self.cross_rank = peers.index(rank)


def _gather_topology() -> _Topology:
    """Called by :func:`init` on every rank: every rank's local rank and host."""
    from ._collectives import _allgather_small

    env, _ = _require()
    h = zlib.crc32(socket.gethostname().encode())
    rows = _allgather_small([env.local_rank & 0xFFFF, h & 0xFFFF, h >> 16], "init/topology")
    hosts = [r[1] | (r[2] << 16) for r in rows]
    launcher = env.local_size if env.local_size_given else None
    return _Topology(env.rank, [r[0] for r in rows], hosts, launcher)


def _topology() -> _Topology:
    if _state.env is None and _state.suspended is not None:
        left: _Topology = _state.suspended.topology  # BytePS's suspend(): the job it left
        return left
    _require()
    topo = _state.topology
    assert topo is not None, "init() gathers the topology"
    return topo


def local_size() -> int:
    """The number of ranks on this host: the launcher's (``LOCAL_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_SIZE``, ``SLURM_NTASKS_PER_NODE``,
    ``TIDEWIRE_LOCAL_SIZE``), else the ranks whose host name is this one's."""
    return _topology().local_size


def cross_rank() -> int:
    """Horovod's cross rank: this rank's index among the ranks with its local
    rank (the node's index when every node runs the same number of ranks)."""
    return _topology().cross_rank


def cross_size() -> int:
    """Horovod's cross size: how many ranks have this rank's local rank (the
    number of nodes when every node runs the same number of ranks)."""
    return _topology().cross_size


def mpi_built() -> bool:
    """False: Tidewire does not use MPI (it runs under torchrun, Slurm or
    ``mpirun`` by their environment variables only)."""
    return False


def mpi_enabled() -> bool:
    """False: Tidewire does not use MPI."""
    return False


def mpi_threads_supported() -> bool:
    """Raises ValueError, as Horovod does when MPI is not enabled: Tidewire does not use MPI."""
    raise ValueError("Tidewire does not use MPI: mpi_threads_supported() has no answer (mpi_enabled() is False)")


def gloo_built() -> bool:
    """False: Tidewire's collectives run on its own engine, not Gloo (a gloo
    process group can run beside it in the same process)."""
    return False


def gloo_enabled() -> bool:
    """False: Tidewire does not use Gloo."""
    return False


def nccl_built() -> bool:
    """False: Tidewire does not use NCCL."""
    return False


def ddl_built() -> bool:
    """False: Tidewire does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: Tidewire does not use oneCCL."""
    return False


def cuda_built() -> bool:
    """False: Tidewire's native module moves host memory only. CUDA tensors
    work all the same: they are staged through (pinned) host buffers."""
    return False


def rocm_built() -> bool:
    """False: Tidewire's native module has no ROCm code."""
    return False
