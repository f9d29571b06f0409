"""The configuration of a :class:`tidewire.Session`: :class:`SessionConfig`,
and the records some of its fields take (:class:`LocalAggregation`,
:class:`CommConfig`, :class:`Checkpointing`, :class:`Rates`).

They are frozen dataclasses: every field, its type, its default and its meaning
are here, and nowhere else. The extension module reads them by attribute when
a session is built and checks every field there, once; a field it refuses is
named in the error (``SessionConfig.rank: ...``, ``policy='x': want ...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

#: A layer of the table: ``(name, kind, m, n)``, m×n values; kind ``'fc'``,
#: ``'conv'`` or ``'other'``, with ``':sparse'`` after it for the sparse-push
#: hint (``'other:sparse'``: an ``nn.Embedding(sparse=True)``).
Layer = Tuple[str, str, int, int]
#: ``'mean'``, ``'sum'`` or ``('sgd', lr, momentum, weight_decay)`` (Caffe-form momentum).
Apply = Union[str, Tuple[str, float, float, float]]
#: ``'bsp'`` or ``('ssp', staleness)``.
Consistency = Union[str, Tuple[str, int]]


@dataclass(frozen=True)
class LocalAggregation:
    """This session is one of a node's ``learners`` local learners (Nexus's
    local aggregation): learner 0 is the node's rank (the session's ``rank``
    and ``world`` count nodes) and sums the other learners' gradients into its
    own before each push; a learner ``index >= 1`` joins no rendezvous, hands
    its gradients to learner 0 through shared memory at ``path`` and pulls the
    parameters from the node's cache. Every layer syncs through the PS
    (``policy='ps'``)."""

    #: Local learners on the node (at least 1).
    learners: int
    #: This learner, ``0 <= index < learners``.
    index: int
    #: The shared-memory file of the node's group (the same on its learners).
    path: str
    #: A number the node's learners agree on, checked when they attach.
    nonce: int
    #: Parameter versions the node's cache may lag behind the servers.
    staleness: int


@dataclass(frozen=True)
class CommConfig:
    """How often learners exchange (the engine's ``freq::CommConfig``): every
    ``t_initial`` steps (T), adjusted by quality up to ``t_max`` when ``t_max >
    t_initial``. Every rank must pass the same one."""

    #: What learners do between exchanges: ``'accumulate'`` (sum their
    #: gradients) or ``'average'`` (step locally; the servers average the models).
    mode: str
    #: The original T (steps per exchange), ``1 <= t_initial <= t_max``.
    t_initial: int
    #: The largest T the controller proposes; ``t_max == t_initial`` fixes T.
    t_max: int
    #: Exchanges per measurement window (baseline or trial), at least 1.
    period: int
    #: How much worse (relative) a learner's mean figure may get before it
    #: rejects a proposal; finite and >= 0.
    tolerance: float
    #: The step from which T is the original one again, for good (None: never).
    revert_at_step: Optional[int]


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of the servers' state and worker 0's parameters
    (safetensors, in ``dir/step-NNNNNNNN/``)."""

    #: The directory of the ``step-*`` directories.
    dir: str
    #: Every this many iterations (at least 1).
    every: int
    #: Complete checkpoints kept (at least 1).
    keep: int
    #: Whether a checkpoint also needs the learner's framework state
    #: (:meth:`Session.save_framework_state`) to be complete.
    framework_state: bool


@dataclass(frozen=True)
class Rates:
    """This rank's rates (:func:`tidewire._native.calibrate`, ``tidewire
    calibrate``): with ``policy='hybrid'`` each FC layer's PS or SFB is then
    chosen in seconds, not bytes. Every rank must reach the same schemes (pass
    the same rates)."""

    #: Bytes per second one node's link carries each way.
    link_bytes_per_s: float
    #: Seconds spent per message sent or received.
    msg_s: float
    #: Bytes of input per second folded into an accumulator.
    sum_bytes_per_s: float
    #: FLOP/s of the GEMM that rebuilds a gradient from its factors.
    gemm_flop_per_s: float
    #: Ranks sharing this rank's host (its cores, memory and loopback), the
    #: rates above being each one's share; 1: a host of its own. HybComm then
    #: weighs the host's whole work, not only its busiest rank's.
    host_ranks: int = 1
    #: Whether the link is the host's loopback (its bytes are the shared
    #: cores' work) rather than a network link of each rank's own.
    link_on_host: bool = False
    #: Whether a PS layer's dense gradient is built from its factors on the
    #: worker (a GEMM the PS pays and SFB does not): true wherever FC layers on
    #: the PS are handed in as factors (``sfb='adaptive'``, ``tidewire train``);
    #: False where the framework's backward hands in the gradient it computed.
    ps_builds_grad: bool = False


@dataclass(frozen=True)
class SessionConfig:
    """What a :class:`tidewire.Session` is: its layer table, its place in the
    job, and how it syncs. ``Session(config, params=, grads=)`` builds one over
    the caller's memory; the defaults are those of a colocated job (every rank a
    worker and a server shard) that averages gradients in lock step (BSP).
    """

    #: The layer table, in the order the layers lie in ``params`` and ``grads``.
    layers: List[Layer]
    #: This rank, ``0 <= rank < world``.
    rank: int
    #: The number of ranks.
    world: int
    #: ``host:port`` of rank 0's rendezvous.
    master: str
    #: The job secret (str or bytes, not empty), the same on every rank.
    secret: Union[str, bytes] = field(repr=False)
    #: The last ``servers`` ranks are servers only (0: every rank is both).
    servers: int = 0
    #: The job id (every rank the same).
    job: int = 1
    #: The batch size K: rows of the sufficient factors U and V.
    batch: int = 32
    #: What servers do with the gradients: ``'mean'``, ``'sum'`` or ``('sgd', lr, momentum, weight_decay)``.
    apply: Apply = "mean"
    #: ``'bsp'`` or ``('ssp', staleness)``.
    consistency: Consistency = "bsp"
    #: How FC layers sync: ``'hybrid'`` (HybComm: PS or SFB, by cost), ``'ps'`` or ``'sfb'``.
    policy: str = "hybrid"
    #: ``'auto'``, ``'tcp'``, ``'portable'`` or ``'rdma'``.
    transport: str = "auto"
    #: Seconds a wait may last before it fails, and a peer may stay silent.
    timeout: float = 60.0
    #: Seconds the rendezvous and connections may take.
    connect_timeout: float = 60.0
    #: KV chunk size in bytes, the unit a server applies and broadcasts (None: 2 MiB).
    chunk_bytes: Optional[int] = None
    #: Scheduling slice size in parameters (None: 50,000).
    slice_params: Optional[int] = None
    #: The IP address this rank listens on (None: the one that reaches ``master``).
    listen_ip: Optional[str] = None
    #: Local aggregation: this session is one of a node's learners (None: it is not).
    local: Optional[LocalAggregation] = None
    #: The communication frequency (None: every step, gradients).
    comm: Optional[CommConfig] = None
    #: Checkpoints (None: none).
    checkpoint: Optional[Checkpointing] = None
    #: A checkpoint to start from: a step directory, or a checkpoint directory
    #: (its newest complete one).
    resume: Optional[str] = None
    #: When servers apply a round: ``'all'`` (BSP), ``'quorum:K'``, ``'async'``
    #: or ``'timeout:MS'`` (the others need ``'bsp'`` and ``policy='ps'``).
    trigger: str = "all"
    #: This rank's rates, for ``policy='hybrid'`` (None: HybComm weighs bytes).
    rates: Optional[Rates] = None
    #: Decide the dense FC layers' schemes again every this many iterations,
    #: in the run (0: never): worker 0 measures the start-up choice against
    #: an alternative and keeps the faster. Such layers must be pushed by
    #: their factors (SGD's momentum moves with a layer that switches).
    #: Needs BSP and no checkpoints.
    adapt_every: int = 0


_RECORDS = {"local": LocalAggregation, "comm": CommConfig, "checkpoint": Checkpointing, "rates": Rates}


def _from_keywords(layers: List[Layer], **settings: Any) -> SessionConfig:
    """The SessionConfig of the keyword form of earlier versions,
    ``Session(layers, params=, grads=, rank=, world=, ...)``, whose records
    (``local``, ``comm``, ``checkpoint``, ``rates``) were plain tuples in their
    fields' order. ``Session`` calls it when given keywords besides
    ``params`` and ``grads``."""
    for name, record in _RECORDS.items():
        value = settings.get(name)
        if value is not None and not isinstance(value, record):
            settings[name] = record(*value)
    return SessionConfig(layers, **settings)
