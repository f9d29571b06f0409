"""Tidewire for Python.

Tidewire is a communication engine for distributed deep-learning training
(parameter servers with zero-copy one-sided writes, Poseidon's wait-free
backprop and hybrid PS / sufficient-factor broadcast, P3's priority slicing).
This package exposes:

- :class:`tidewire.Session` (from the extension module ``tidewire._native``):
  push/pull by layer index over caller-owned flat float32 memory, built as
  ``Session(config, params=, grads=)`` from a :class:`tidewire.SessionConfig`
  (with its records :class:`LocalAggregation`, :class:`CommConfig`,
  :class:`Checkpointing` and :class:`Rates`);
- :mod:`tidewire.torch`: a Horovod-like ``DistributedOptimizer`` for PyTorch,
  with ``init()``, ``rank()``, ``size()``, ``broadcast_parameters`` and
  ``push_pull`` (import it explicitly: ``import tidewire.torch as tw``);
- :func:`tidewire.run`: Horovod's ``horovod.run`` on one host (a function run
  on ``np`` local processes, each a rank of one job);
- :class:`tidewire.TidewireError`, the exception every Tidewire failure raises
  (a subclass of ``RuntimeError``; the message is the Rust error's).
"""

from ._config import Checkpointing, CommConfig, LocalAggregation, Rates, SessionConfig
from ._native import Session, TidewireError, __version__
from ._run import run

__all__ = [
    "Checkpointing",
    "CommConfig",
    "LocalAggregation",
    "Rates",
    "Session",
    "SessionConfig",
    "TidewireError",
    "__version__",
    "run",
]
