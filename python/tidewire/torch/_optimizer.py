"""DistributedOptimizer: the wrapper around a torch optimizer."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from .._native import TidewireError
from ._compression import Compression
from ._horovod import Average
from ._runtime import _state
from ._tw import _Tw


def _check_groups(num_groups: Any, groups: Any) -> None:
    """Horovod's checks of its fusion-group arguments (the groups do not change any value)."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r}: want an int >= 0")
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for g in groups:
            for p in g:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor")
                if id(p) in seen:
                    raise ValueError("a parameter can only appear once in groups")
                seen.add(id(p))
    elif not isinstance(groups, int) or groups <= 0:
        raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor")


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
        """Clears every synced gradient. ``set_to_none=True`` (default, as
        torch): each ``.grad`` becomes None, and backward's first gradient is
        copied into Tidewire's registered buffer, where ``.grad`` is a view
        again once backward has reached it (cheaper than zeroing the buffer and
        adding into it). ``False``: zeroed in place. Always zeroed in place: a
        layer pushed as its sufficient factors, every layer with
        ``comm_every``/``comm_mode``, and a layer still in flight (when it
        lands; with ``prefetch=True`` that is every layer). The values are the
        same bits either way, except that a -0.0 in autograd's first gradient
        now stays -0.0 (zeroing and adding gave +0.0)."""
        self._tw.zero(set_to_none)
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
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
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

    Horovod's and BytePS's arguments (in Horovod's positional order)
        ``compression``: :class:`Compression` ``.none`` (default), ``.fp16``,
        ``.bf16`` or a class with ``compress``/``decompress``: each gradient
        is replaced by ``decompress(compress(grad))`` just before its push
        (``fp16``: rounded to float16), and the servers sum the rounded values
        in float32; the wire still carries float32 in this version.
        ``op``: :data:`Average` (default: the servers' mean, sum times 1/size
        in float32), :data:`Sum` (the servers' sum, no division) or
        :data:`Adasum` (below). ``gradient_predivide_factor`` f (Average only): each
        gradient is multiplied by 1/f before the push and the servers' sum by
        f/size after the pull, as Horovod does. ``backward_passes_per_step``:
        see below. ``num_groups``/``groups`` (Horovod's fusion groups) change
        how Horovod batches its allreduces, never the values; Tidewire always
        groups by module (below), so they are checked and otherwise unused.
        ``sparse_as_dense``: Tidewire always syncs sparse gradients densely
        (added into the layer's dense buffer), and the wrapped optimizer gets
        the dense averaged gradient whichever value is passed (Horovod hands a
        sparse one back with ``sparse_as_dense=True``). Non-default ``op``,
        factor or compression turn ``sfb`` off (they act on the gradient), and
        do not combine with ``apply='server'`` (except compression) nor with
        ``comm_every``/``comm_mode``/``quality_guided``. Horovod's
        ``process_set`` is not supported.

    How it syncs
        The parameters of each module (named parameters grouped by their
        prefix: ``features.0.weight`` and ``features.0.bias`` are one layer)
        are one Tidewire layer. Each parameter's ``.grad`` is a view into one
        flat float32 gradient buffer that Tidewire registered in place, so
        what is sent is never copied again: after ``zero_grad()`` backward's
        first gradient is copied into it once, and later passes
        (``backward_passes_per_step``) accumulate into it. When the
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
        ``False``: parameter server only; ``'adaptive'``: HybComm's choice,
        then decided again in the run every ``TIDEWIRE_ADAPT_EVERY`` steps
        (default 10): rank 0 measures the start-up choice against an
        alternative and keeps the faster, and every eligible linear layer is
        then pushed by its factors (the servers form the gradient where it
        goes by the PS); BSP, and with ``apply='server'`` no momentum. A forward hook keeps the layer's
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

    ``op=Adasum`` (more than one rank, a power of two)
        Horovod's Adasum optimizer (``_DistributedAdasumOptimizer``): the
        gradients are not reduced and no Tidewire session is built. ``step()``
        runs the wrapped optimizer on each parameter alone with this rank's
        gradient, from its value ``start``, and sets the parameter to
        ``start + adasum(new - start)``: the deltas are reduced with
        ``allreduce(op=Adasum)``'s exact arithmetic, each parameter its own
        tensor (``compression`` compresses the delta: ``Compression.fp16``
        reduces float16 deltas; bf16 is refused, as Horovod's Adasum has no
        bfloat16). ``backward_passes_per_step`` n: ``step()`` after n backward
        passes steps once on the accumulated gradient (more passes raise);
        ``zero_grad()`` between a backward and its ``step()`` raises,
        ``synchronize()`` does nothing and ``skip_synchronize()`` raises, as in
        Horovod. Every gradient starts as zeros, and rank 0's parameters are
        broadcast at the build. Refused (ValueError, naming why):
        ``apply='server'``, ``sfb`` True/'always'/'adaptive', SSP,
        ``prefetch``, ``comm_every``/``comm_mode``/``quality_guided``,
        checkpoints, ``timeout``, ``gradient_predivide_factor``. A world size
        that is not a power of two raises NotImplementedError (as Horovod).
        With one rank Adasum is the identity and the ordinary optimizer is
        built (as Horovod does).

    Do not modify ``.grad`` between backward and ``step()`` (the layers may
    be in flight): call :meth:`synchronize` first, then ``step()`` within
    :meth:`skip_synchronize`. ``zero_grad()`` sets ``.grad`` to None
    where it can (see there; ``set_to_none=False``: zeroes in place), and
    backward's first gradient is copied into the buffer, so code that adds
    into ``p.grad`` between ``zero_grad()`` and backward must check for None,
    as with plain torch; if user code replaces ``p.grad`` anyway, the hook
    copies it back into the buffer too (counted as ``grad_rebinds`` in
    ``tidewire_stats()``).
    CUDA parameters are staged through pinned host buffers (the current
    stream is synchronized before each push).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer")
    _check_groups(num_groups, groups)
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense={sparse_as_dense!r}: want a bool")
    from ._reduce import ReduceOp, _resolve_op
    from ._runtime import _require

    if _resolve_op(op, None) == ReduceOp.ADASUM and _require()[0].size > 1:
        from ._adasum import _adasum_optimizer

        return _adasum_optimizer(
            optimizer, named_parameters, compression, backward_passes_per_step, gradient_predivide_factor, model,
            dict(apply=apply, sfb=sfb, consistency=consistency, prefetch=prefetch, comm_every=comm_every,
                 comm_mode=comm_mode, quality_guided=quality_guided, checkpoint_dir=checkpoint_dir, resume=resume,
                 timeout=timeout, broadcast_buffers=broadcast_buffers),
        )
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
        dict(op=op, gradient_predivide_factor=gradient_predivide_factor, compression=compression),
    )
    obj._tw = tw
    tw.restore(obj)
    with _state.lock:
        _state.optimizers.append(obj)
    return obj
