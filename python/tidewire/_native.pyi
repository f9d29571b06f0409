"""Type stubs for the extension module tidewire._native (Rust, pyo3)."""

from typing import Any, Dict, List, Optional, Tuple, overload

from ._config import CommConfig, Layer, SessionConfig

__version__: str

class TidewireError(RuntimeError):
    """An error from Tidewire (engine, transport, rendezvous, or a misuse of a
    session); the message is the Rust error's."""

_Factor = Any  # bytes, bytearray, a float32 NumPy array, or a float32 torch.Tensor

class FreqGuide:
    """One learner's communication frequency (Rust ``tidewire::freq::Guide``
    over the engine's ``freq::FreqController``), with servers that average."""

    def __init__(self, comm: CommConfig, learner: int, learners: int) -> None: ...
    def report(self, quality: float) -> None:
        """Reports a quality figure (a loss) for the step now running."""
    def due(self) -> bool:
        """Whether the step now running ends with an exchange."""
    def local_step(self) -> None:
        """Ends a step without an exchange (raises when it was due)."""
    def figure(self) -> Optional[float]:
        """The mean of the reports since the last exchange."""
    @property
    def adjusts(self) -> bool: ...
    @property
    def t(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def exchanges(self) -> int: ...
    def exchanged(self, synced: Optional[List[float]]) -> Dict[str, Any]:
        """Ends a step with an exchange: the quality layer's synced row (the
        servers' mean of every learner's one-hot figure), or None for a fixed T."""
    def history(self) -> List[Dict[str, Any]]: ...
    def memory(self) -> List[Tuple[int, float, bool, int]]: ...

class Session:
    """One rank's session over caller-owned memory.

    ``params`` and ``grads`` are flat float32 host tensors (CPU, contiguous) or
    NumPy arrays holding every layer back to back, in table order; they are
    registered in place (zero-copy) and kept alive by the session. Between
    ``push(l)`` and the matching ``pull(l)`` the layer belongs to the engine:
    do not read or write its part of either buffer. Waiting calls release the
    GIL. Every failure raises :class:`TidewireError`.
    """

    @overload
    def __init__(self, config: SessionConfig, *, params: Any, grads: Any) -> None:
        """Rendezvous, connect, register the memory and broadcast worker rank
        0's initial ``params`` to every rank (blocks, GIL released).

        ``config`` is everything else the session is (its layer table, its
        place in the job, how it syncs): see :class:`tidewire.SessionConfig`,
        whose fields are checked here; a field refused is named in the error.
        """
    @overload
    def __init__(self, layers: List[Layer], *, params: Any, grads: Any, **settings: Any) -> None:
        """The keyword form of earlier versions: ``Session(layers, params=p,
        grads=g, rank=r, ...)`` is ``Session(SessionConfig(layers, rank=r,
        ...), params=p, grads=g)``, where ``local``, ``comm``, ``checkpoint``
        and ``rates`` may also be plain tuples in their records' field order."""
    def push(self, layer: int) -> None:
        """Hand layer ``layer``'s gradient in from ``grads`` (returns at once)."""
    def push_factors(self, layer: int, u: _Factor, v: _Factor) -> None:
        """Hand an FC layer in by its sufficient factors U (K×M), V (K×N) (copied)."""
    def pull(self, layer: int) -> None:
        """Block until ``layer``'s result is in ``params`` (GIL released)."""
    def pull_all(self) -> None:
        """Pull every pushed layer (GIL released)."""
    def poll(self, layer: int) -> bool:
        """Whether ``layer`` is synced, without blocking."""
    def in_flight(self, layer: int) -> bool:
        """Whether ``layer`` is pushed and not pulled yet."""
    def scheme(self, layer: int) -> str:
        """``'ps'`` or ``'sfb'``: how the layer syncs (HybComm's fixed choice)."""
    def stats(self) -> Dict[str, int]:
        """The session's counters."""
    @property
    def start_iteration(self) -> int:
        """Iterations done before this session (the resumed checkpoint's; 0 when fresh)."""
    def framework_state(self) -> Optional[bytes]:
        """The framework state saved with the resumed checkpoint, or None."""
    def save_framework_state(self, iteration: int, state: bytes) -> None:
        """Save the learner's state with checkpoint ``iteration`` (returns at once)."""
    def checkpoint_stats(self) -> Optional[Dict[str, Any]]:
        """``written``, ``copy_s``, ``write_s``, ``bytes``; None without checkpoints."""
    def shutdown(self) -> None:
        """End the session (collective: every rank calls it; GIL released)."""
    def abort(self) -> None:
        """End the session at once without the goodbye (after an error): the
        peers fail with "aborted" instead of waiting for this rank."""
    @property
    def closed(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def role(self) -> str:
        """'both' (worker and server shard), 'worker', or 'server' (serves only,
        from shutdown(); push and pull raise)."""
    @property
    def world(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def layer_names(self) -> List[str]: ...
    @property
    def layer_sizes(self) -> List[int]: ...
    @property
    def transport(self) -> Tuple[str, str]: ...
    @property
    def memory(self) -> Tuple[Any, Any]: ...
    def __len__(self) -> int: ...

def newest_checkpoint(dir: str) -> Optional[str]:
    """The newest complete checkpoint (step directory) under ``dir``, or None."""

def calibrate(ms: int = 100) -> Tuple[int, float, float, float, float, float]:
    """This machine's rates, one thread each, measured for about ``ms``
    milliseconds apiece: ``(cores, link_bytes_per_s, msg_s, sum_bytes_per_s,
    gemm_flop_per_s, mem_bytes_per_s)``, the last the sum on every core at
    once (the host's memory, which its ranks share); what ``policy='hybrid'`` weighs in seconds when
    given ``SessionConfig(rates=Rates(link_bytes_per_s, msg_s,
    sum_bytes_per_s, gemm_flop_per_s))`` (see ``tidewire calibrate``)."""

class LinkProbe:
    """Serves one :func:`probe_stream` on ``host`` (an IP address; ``"0.0.0.0"``
    for every interface) at a port the system chooses."""

    def __init__(self, host: str) -> None: ...
    @property
    def port(self) -> int: ...
    def join(self) -> None:
        """Waits for the probe to end (30 s at most)."""

def probe_stream(addr: str, ms: int = 300) -> float:
    """Bytes per second of one TCP stream to a :class:`LinkProbe` at ``addr``
    (``host:port``), written for about ``ms`` milliseconds."""
