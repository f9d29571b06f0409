"""DistributedOptimizer's push / pull: pushes, pulls, steps, exchanges, close and stats."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from .._native import TidewireError
from ._collectives import _broadcast_flat
from ._compression import _round_trip
from ._layers import _Layer


class _TwSync:
    """_Tw's push / pull and step methods (a mixin of :class:`_Tw`)."""

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
        if L.factors:
            if self.staged:
                self._cuda_sync()
            u, v = self._factors(L)
            if not L.checked:
                self._check_factors(L, u, v)
            self.session.push_factors(L.index, u.numpy(), v.numpy())
        else:
            sl = slice(L.offset, L.offset + L.numel)
            if self.staged:
                self._cuda_sync()
                self.g_host[sl].copy_(self.g_dev[sl])
            if self.reduce_custom and L is not self.quality:
                self._before_push(self.g_host[sl])
            self.session.push(L.index)
        L.pushed = True
        L.in_flight = True

    def _before_push(self, g: torch.Tensor) -> None:
        """Horovod's compression (round trip) and predivide factor, on the gradient about to be pushed."""
        with torch.no_grad():
            c = _round_trip(self.compression, g)
            if c is not None:
                g.copy_(c)
            if self.prescale is not None:
                g.mul_(self.prescale)

    def _landed(self, L: _Layer) -> None:
        L.in_flight = False
        sl = slice(L.offset, L.offset + L.numel)
        if self.postscale is not None and L is not self.quality:
            with torch.no_grad():
                self.r_host[sl].mul_(self.postscale)
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
            info.cleared = False

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

    def zero(self, set_to_none: bool = True) -> None:
        """Clears the gradients for the next backward. ``set_to_none`` (torch's
        default): the ``.grad`` of a layer pushed from its buffer becomes None,
        so autograd hands its first gradient over whole and the hook copies it
        into the buffer (one copy, where zeroing in place and then adding into
        the zeros reads and writes the buffer twice: 10.7 ms against 22.9 ms
        for 21 M floats on one core of the 2-core VM); a layer pushed as its
        factors, or still in flight, or ``set_to_none=False``, or with
        ``comm_every``/``comm_mode`` (an exchange pushes every layer from the
        buffer, and average mode the parameters): zeroed in place."""
        if self.accumulating:
            return  # accumulate mode: the gradients add up until the next exchange
        for L in self.layers:
            if set_to_none and not self.comm_on and not L.in_flight and not L.factors:
                for info in L.params:
                    info.param.grad = None
                    info.cleared = True
                continue
            if L.in_flight:
                L.zero_on_pull = True
            else:
                with torch.no_grad():
                    self.g_dev[L.offset : L.offset + L.numel].zero_()
            for info in L.params:
                if not self._bound(info):
                    self._bind(info)

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
            s["rates"] = dataclasses.asdict(self.rates)
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
