"""DistributedOptimizer(op=Adasum) with more than one rank: Horovod's
``_DistributedAdasumOptimizer``. The gradients are not reduced: each rank runs
the wrapped optimizer on its own gradients, and the change of each parameter
(its delta) is Adasum-reduced over the ranks (``_reduce._adasum_now``) and
added to the parameter's value before the step. No Tidewire session (no
servers, no registered gradient buffers): the deltas go through the utility
session's gather, like ``allreduce(op=Adasum)``."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .._native import TidewireError
from ._compression import _check_compression
from ._optimizer import _DistributedOptimizer
from ._reduce import ReduceOp, _adasum_now, _check_adasum
from ._runtime import _require


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """What :func:`DistributedOptimizer` returns with ``op=Adasum`` and more
    than one rank (Horovod's ``_DistributedAdasumOptimizer``): ``step()`` runs
    the wrapped optimizer on each parameter, with this rank's gradient, from
    the parameter's value ``start``, takes ``delta = new - start``, reduces the
    deltas with Adasum over the ranks (each parameter its own tensor) and sets
    each parameter to ``start + adasum(delta)``. ``synchronize()`` does
    nothing (the deltas are reduced in ``step()``) and ``skip_synchronize()``
    raises, as in Horovod."""

    _ada: "_AdasumState"

    @property
    def start_step(self) -> int:
        """0: this optimizer does not resume checkpoints."""
        return 0

    @property
    def resumed_from(self) -> Optional[str]:
        """None: this optimizer does not resume checkpoints."""
        return None

    def checkpoint_stats(self) -> Optional[Dict[str, Any]]:
        """None: this optimizer does not write checkpoints."""
        return None

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Horovod's delta step (see the class). Collective: every rank calls
        it, the same number of times."""
        st = self._ada
        if st.closed:
            raise TidewireError("this DistributedOptimizer was shut down")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        starts: List[torch.Tensor] = []
        sent: List[Tuple[torch.Tensor, Any]] = []
        groups = self.param_groups
        for _, p in st.params:
            start = p.detach().clone()
            # Horovod steps the wrapped optimizer on this parameter alone.
            stashed = [g["params"] for g in groups]
            try:
                for g in groups:
                    g["params"] = [p] if any(p is v for v in g["params"]) else []
                super(_DistributedOptimizer, self).step()
            finally:
                for g, ps in zip(groups, stashed):
                    g["params"] = ps
            with torch.no_grad():
                delta = p.detach() - start
            starts.append(start)
            sent.append(st.compression.compress(delta))
        outs = st.reduce([c for c, _ in sent])
        with torch.no_grad():
            for (_, p), start, (c, ctx), out in zip(st.params, starts, sent, outs):
                delta = st.compression.decompress(out.reshape(c.shape).to(device=c.device), ctx)
                start.add_(delta)
                p.copy_(start)
        for k in st.counts:
            st.counts[k] = 0
        st.steps += 1
        if st.model is not None:
            bufs = [b for b in st.model.buffers()]
            if bufs:
                from ._collectives import broadcast_parameters

                broadcast_parameters(bufs, 0, prefix="adasum/buffers/")
        return loss

    def synchronize(self) -> None:
        """Nothing, as in Horovod's Adasum optimizer: the deltas are reduced in :meth:`step`."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Raises, as in Horovod: with Adasum the gradients are never reduced, so there is nothing to skip."""
        raise TidewireError("skip_synchronize() is not supported with op=Adasum (as in Horovod): step() reduces "
                            "the parameters' deltas, not the gradients, so there is no synchronize() to skip")
        yield  # pragma: no cover

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; raises between a backward and
        its ``step()``, as Horovod does."""
        if any(self._ada.counts.values()):
            raise TidewireError("optimizer.zero_grad() was called after loss.backward() but before "
                                "optimizer.step() (op=Adasum, as in Horovod): call step() first")
        super(_DistributedOptimizer, self).zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: changes ``backward_passes_per_step``."""
        self._ada.bpps = _check_bpps(passes)

    def report_quality(self, value: Any) -> None:
        raise TidewireError("report_quality: op=Adasum does not take quality_guided")

    def flush(self) -> bool:
        """False: with op=Adasum every step() exchanges."""
        return False

    def tidewire_stats(self) -> Dict[str, Any]:
        """``op``, ``steps`` and ``bytes_gathered`` (what this rank received
        over all steps: every rank's deltas, P times the bytes of a sum)."""
        st = self._ada
        return {"op": "adasum", "steps": st.steps, "bytes_gathered": st.bytes_gathered}

    def close(self) -> None:
        """Removes this optimizer's hooks (no session to end)."""
        st = self._ada
        if not st.closed:
            for h in st.hooks:
                h.remove()
            st.closed = True


def _check_bpps(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"backward_passes_per_step={n!r}: want an int >= 1")
    return n


class _AdasumState:
    def __init__(self, params: List[Tuple[str, nn.Parameter]], compression: Any, bpps: int,
                 model: Optional[nn.Module]) -> None:
        self.params = params
        self.compression = compression
        self.bpps = bpps
        self.model = model
        self.counts: Dict[int, int] = {id(p): 0 for _, p in params}
        self.hooks: List[Any] = []
        self.steps = 0
        self.bytes_gathered = 0
        self.closed = False

    def on_grad(self, name: str, p: nn.Parameter) -> None:
        n = self.counts[id(p)] + 1
        self.counts[id(p)] = n
        if n > self.bpps:
            raise TidewireError(
                f"the gradient of {name} accumulated {n} times before step(), but backward_passes_per_step="
                f"{self.bpps}: call step() after every {self.bpps} backward pass(es)"
            )

    def reduce(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Adasum of each tensor over the ranks: one gather per dtype, in order of first appearance."""
        env, util = _require()
        flats = [t.detach().to("cpu").reshape(-1) for t in tensors]
        out: List[Optional[torch.Tensor]] = [None] * len(flats)
        dtypes: List[torch.dtype] = []
        for f in flats:
            if f.dtype not in dtypes:
                dtypes.append(f.dtype)
        for dt in dtypes:
            idx = [i for i, f in enumerate(flats) if f.dtype == dt]
            part = [flats[i] for i in idx]
            def job(part: List[torch.Tensor] = part, dt: torch.dtype = dt) -> List[torch.Tensor]:
                return _adasum_now(part, 1.0, 1.0, f"adasum_optimizer/{dt}")

            res = util.call(job)
            self.bytes_gathered += env.size * sum(f.numel() * f.element_size() for f in part)
            for i, r in zip(idx, res):
                out[i] = r
        return [o for o in out if o is not None]


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"DistributedOptimizer(op=Adasum) does not take {what}: with Adasum (Horovod's delta optimizer) each rank "
        "runs the wrapped optimizer on its own gradients and the parameters' deltas are combined pairwise by "
        "every rank after the step"
    )


def _adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]],
    compression: Any,
    backward_passes_per_step: int,
    gradient_predivide_factor: float,
    model: Optional[nn.Module],
    tidewire: Dict[str, Any],
) -> _DistributedAdasumOptimizer:
    """Checks everything before any collective (so every rank raises the same), then builds the optimizer."""
    env, _ = _require()
    _check_adasum(ReduceOp.ADASUM, env.size, torch.float32, "DistributedOptimizer")
    bpps = _check_bpps(backward_passes_per_step)
    if float(gradient_predivide_factor) != 1.0:
        raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
    t = tidewire
    if t["apply"] != "local":
        raise _refuse(f"apply={t['apply']!r} (the servers would apply SGD to summed gradients; Adasum needs the "
                      "deltas of the wrapped optimizer's step, taken on each rank)")
    if t["sfb"] not in ("auto", False):
        raise _refuse(f"sfb={t['sfb']!r} (sufficient factors carry gradients; Adasum reduces parameter deltas)")
    if t["consistency"] != "bsp":
        raise _refuse(f"consistency={t['consistency']!r} (the parameter servers' bounded staleness)")
    if t["prefetch"]:
        raise _refuse("prefetch=True (there are no server pulls to overlap)")
    if t["comm_every"] != 1 or t["comm_mode"] != "accumulate" or t["quality_guided"]:
        raise _refuse("comm_every/comm_mode/quality_guided (every step exchanges its deltas)")
    if t["checkpoint_dir"] is not None or t["resume"] is not False:
        raise _refuse("checkpoint_dir/resume (Tidewire's checkpoints save the parameter servers' state)")
    if t["timeout"] is not None:
        raise _refuse("timeout= (the deltas go through the job's collectives, whose timeout is TIDEWIRE_TIMEOUT)")
    broadcast_buffers = t["broadcast_buffers"]
    if broadcast_buffers and model is None:
        raise ValueError("broadcast_buffers=True needs model=")
    keep_model = model if (model is not None and broadcast_buffers is not False) else None
    compression = _check_compression(compression)

    # Horovod's checks of named_parameters.
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) for x in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")
        names = [k for k, _ in named]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: " + ", ".join(dups))
        by_id = {id(v): k for k, v in named}
        unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in by_id]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named")
    else:
        by_id = {}
    params: List[Tuple[str, nn.Parameter]] = []
    seen = set()
    for gi, g in enumerate(optimizer.param_groups):
        for i, p in enumerate(g["params"]):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((by_id.get(id(p), f"allreduce.noname.{gi}.{i}"), p))
    for name, p in params:
        c, _ = compression.compress(torch.zeros(1, dtype=p.dtype))
        _check_adasum(ReduceOp.ADASUM, env.size, c.dtype, f"DistributedOptimizer: parameter {name} ({p.dtype})")

    base = type(optimizer)
    cls: Any = type(base.__name__, (_DistributedAdasumOptimizer, base), {"__doc__": _DistributedAdasumOptimizer.__doc__})
    obj: _DistributedAdasumOptimizer = cls.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    st = _AdasumState(params, compression, bpps, keep_model)
    obj._ada = st
    # Every rank starts from rank 0's parameters (as Tidewire's other optimizers do).
    from ._collectives import broadcast_parameters

    broadcast_parameters([p for _, p in params], 0, prefix="adasum/parameters/")
    for name, p in params:
        # Horovod's: every gradient starts as zeros (a parameter no backward reaches still steps).
        p.grad = torch.zeros_like(p)
        st.hooks.append(p.register_post_accumulate_grad_hook(lambda q, name=name: st.on_grad(name, q)))
    return obj
