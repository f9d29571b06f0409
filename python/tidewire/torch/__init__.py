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
``TIDEWIRE_SECRET``                                       the job secret, the same on every rank: under
                                                          torchrun optional (see Job secret), elsewhere
                                                          required with more than one rank
``TIDEWIRE_JOB``                                          job id (a number, default 1)
``TIDEWIRE_TIMEOUT``                                      seconds a wait may last (default 60)
``TIDEWIRE_TRANSPORT``                                    ``auto``, ``tcp``, ``portable`` or ``rdma``
``TORCHELASTIC_USE_AGENT_STORE``                          torchrun's: its agent's store serves at
                                                          ``MASTER_ADDR:MASTER_PORT`` (the secret)
``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``   torchrun's: the run and restart attempt
                                                          (the key of the shared secret)
========================================================  ======================================

Without any rank variable the process is a job of one (rank 0 of 1), which
needs no secret and no address.

Job secret
----------
Tidewire's ranks authenticate each other (rendezvous and every connection)
with a job secret: ``init(secret=...)``, else ``TIDEWIRE_SECRET``. Under
torchrun neither is needed: rank 0 makes a fresh one (32 random bytes from
:mod:`secrets`) and puts it in torchrun's store (the elastic agent's TCPStore
at ``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``) under
``tidewire/job-secret/<TORCHELASTIC_RUN_ID>/attempt-<TORCHELASTIC_RESTART_COUNT>``,
and the other ranks read it there (waiting ``TIDEWIRE_TIMEOUT`` at most for
rank 0), so a job that torchrun restarts gets a new one. Not under torchrun
but after ``torch.distributed.init_process_group``, the default process
group's store serves the same way. Where neither exists, a job of several
ranks without a secret is an error.

The store is torch's, and it has no authentication: anyone who can reach
``MASTER_ADDR:MASTER_PORT`` can read the secret, just as they can join or
disturb torch.distributed's own rendezvous there. A secret shared this way
keeps out what cannot reach that port (other jobs, other hosts behind the
cluster's firewall), no more; where the store's port is reachable by people
you do not trust, set ``TIDEWIRE_SECRET`` yourself (it wins when set).

A rank with another secret is refused by rank 0; it fails at once with
``rank 0 refused this rank``, and rank 0, when its rendezvous then times out,
names the joiners it refused (address, the rank each claimed, why).
"""

from __future__ import annotations

# The implementation lives in the submodules below; this module re-exports every name
# the single-file tidewire/torch.py defined (the private ones too: tests use some).
from ._env import (  # noqa: F401
    PORT_OFFSET,
    _Env,
    _env_int,
    _read_env,
    _place,
    _job_id,
    _probe_host,
    _bracketed,
)
from ._utility import (  # noqa: F401
    _HDR,
    _SCRATCH_SMALL,
    _SCRATCH_LARGE,
    _OP_SUM,
    _OP_BROADCAST,
    _OP_ALLGATHER,
    _OP_NAMES,
    _PATH_VALUES,
    _PATH_DIGITS,
    _Guard,
    _digits16,
    _undigits16,
    _Util,
)
from ._runtime import (  # noqa: F401
    _State,
    _state,
    _require,
    _new_index,
    init,
    is_initialized,
    rank,
    size,
    local_rank,
    shutdown,
    _atexit,
    _quiet,
)
from ._collectives import (  # noqa: F401
    _flat_f32,
    _to_digits,
    _from_digits,
    _broadcast_flat,
    broadcast,
    broadcast_,
    broadcast_parameters,
    broadcast_object,
    broadcast_optimizer_state,
    barrier,
    _allgather_small,
    _allgather_floats,
)
from ._layers import (  # noqa: F401
    _DTYPES,
    _Param,
    _Call,
    _Layer,
    _is_linear_sfb_candidate,
)
from ._checkpoint import (  # noqa: F401
    _TwCheckpoint,
)
from ._hooks import (  # noqa: F401
    _TwHooks,
)
from ._sync import (  # noqa: F401
    _TwSync,
)
from ._tw import (  # noqa: F401
    _Tw,
)
from ._optimizer import (  # noqa: F401
    _DistributedOptimizer,
    DistributedOptimizer,
)
from ._compression import (  # noqa: F401
    Compression,
    Compressor,
    NoneCompressor,
    FP16Compressor,
    BF16Compressor,
)
from ._reduce import ReduceOp  # noqa: F401
from ._horovod import (  # noqa: F401
    Average,
    Sum,
    Adasum,
    Min,
    Max,
    Product,
    poll,
    synchronize,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    allgather,
    allgather_async,
    grouped_allgather,
    grouped_allgather_async,
    allgather_object,
    broadcast_async,
    broadcast_async_,
    alltoall,
    alltoall_async,
    reducescatter,
    reducescatter_async,
    join,
    push_pull,
    push_pull_async,
    push_pull_inplace,
    push_pull_async_inplace,
    declare,
)
from ._probes import (  # noqa: F401
    local_size,
    cross_rank,
    cross_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    gloo_built,
    gloo_enabled,
    nccl_built,
    ddl_built,
    ccl_built,
    cuda_built,
    rocm_built,
)
from ._sync_batch_norm import SyncBatchNorm  # noqa: F401
from ._suspend import suspend, resume  # noqa: F401
from . import elastic  # noqa: F401
from .. import _native  # noqa: F401
from .._native import TidewireError  # noqa: F401

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
    # Horovod's and BytePS's names (see "Coming from Horovod / BytePS" in the docs)
    "local_size",
    "cross_rank",
    "cross_size",
    "Compression",
    "Compressor",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "poll",
    "synchronize",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "allgather_object",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "join",
    "push_pull_async",
    "push_pull_inplace",
    "push_pull_async_inplace",
    "declare",
    "suspend",
    "resume",
    "SyncBatchNorm",
    "elastic",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
]
