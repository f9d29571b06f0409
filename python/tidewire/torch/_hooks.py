"""DistributedOptimizer's hooks: gradient accumulation, SFB input capture, prefetch."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
from torch import nn

from .._native import TidewireError
from ._layers import _Call, _Layer, _Param


class _TwHooks:
    """_Tw's hooks (a mixin of :class:`_Tw`)."""

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
        """Puts ``p.grad`` back on its view of the flat gradient buffer: after
        ``zero_grad()`` set it to None, or after user code replaced it (e.g.
        ``model.zero_grad(set_to_none=True)``: counted in ``grad_rebinds``)."""
        g = info.param.grad
        with torch.no_grad():
            if g is None:
                info.gview.zero_()
            else:
                # A sparse gradient (nn.Embedding(sparse=True) whose .grad was set to
                # None) is densified here; later ones add into the dense view in place.
                info.gview.copy_(g.to_dense() if g.is_sparse else g)
        self._bind(info)

    def _bind(self, info: _Param) -> None:
        """``p.grad`` back on its view; counted in ``grad_rebinds`` unless
        ``zero_grad`` had set it to None."""
        info.param.grad = info.gview
        if not info.cleared:
            self.grad_rebinds += 1
        info.cleared = False

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
