"""Horovod's ``SyncBatchNorm``: batch normalization whose batch statistics
span every rank, built on Tidewire's own collectives (an allgather of each
rank's count, mean and sum of squared deviations in the forward pass, an
allreduce of the two gradient sums in the backward pass)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ._runtime import _state


def _dims(x: torch.Tensor) -> List[int]:
    """Every dimension but the channels (1)."""
    return [0] + list(range(2, x.dim()))


def _shape(x: torch.Tensor) -> List[int]:
    """Broadcasts a per-channel vector over ``x``."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _global_stats(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The mean and biased variance of every rank's batch, per channel (float64),
    and the number of values per channel over every rank. Every rank's count,
    mean and sum of squared deviations are gathered (bit for bit) and combined
    in rank order, so every rank computes the same bits."""
    from ._horovod import allgather

    c = x.shape[1]
    n_local = x.numel() // c if c else 0
    xd = x.detach().to(torch.float64)
    if n_local:
        mean = xd.mean(_dims(x))
        m2 = ((xd - mean.view(_shape(x))) ** 2).sum(_dims(x))
    else:
        mean = m2 = torch.zeros(c, dtype=torch.float64)
    row = torch.cat([torch.tensor([float(n_local)], dtype=torch.float64), mean.cpu(), m2.cpu()]).unsqueeze(0)
    rows = allgather(row, name="sync_batch_norm.stats")
    counts, means, m2s = rows[:, 0], rows[:, 1 : 1 + c], rows[:, 1 + c :]
    n = int(counts.sum().item())
    if n == 0:
        raise ValueError("SyncBatchNorm: every rank's batch is empty")
    g_mean = (counts.unsqueeze(1) * means).sum(0) / n
    g_m2 = (m2s + counts.unsqueeze(1) * (means - g_mean) ** 2).sum(0)
    return g_mean.to(x.device), (g_m2 / n).to(x.device), n


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float, factor: float,
    ) -> torch.Tensor:
        x = x.contiguous()
        mean, var, n = _global_stats(x)
        if n < 2:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, got {n}")
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1.0 - factor).add_((mean * factor).to(running_mean.dtype))
            if running_var is not None:
                running_var.mul_(1.0 - factor).add_((var * (factor * n / (n - 1))).to(running_var.dtype))
        invstd = torch.rsqrt(var + eps)
        y = (x.to(torch.float64) - mean.view(_shape(x))) * invstd.view(_shape(x))
        if weight is not None:
            y = y * weight.to(torch.float64).view(_shape(x))
        if bias is not None:
            y = y + bias.to(torch.float64).view(_shape(x))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n = n
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:  # type: ignore[override]
        from ._horovod import Sum, allreduce

        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dyd = dy.contiguous().to(torch.float64)
        xmu = x.to(torch.float64) - mean.view(_shape(x))
        sum_dy = dyd.sum(_dims(x))
        sum_dy_xmu = (dyd * xmu).sum(_dims(x))
        # This rank's share of the parameters' gradients: the optimizer sums them over the ranks.
        grad_w = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and need_w else None
        grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype) if need_b else None
        grad_x = None
        if need_x:
            c = x.shape[1]
            both = allreduce(torch.cat([sum_dy, sum_dy_xmu]).cpu(), op=Sum, name="sync_batch_norm.grads")
            mean_dy = (both[:c] / ctx.n).to(x.device).view(_shape(x))
            mean_dy_xmu = (both[c:] / ctx.n).to(x.device).view(_shape(x))
            scale = invstd.view(_shape(x))
            if weight is not None:
                scale = scale * weight.to(torch.float64).view(_shape(x))
            grad_x = ((dyd - mean_dy - xmu * invstd.view(_shape(x)) ** 2 * mean_dy_xmu) * scale).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over every rank's batch (Horovod's
    ``hvd.SyncBatchNorm``): a drop-in for ``torch.nn.BatchNorm1d/2d/3d``
    (input ``(N, C, ...)``, at least 2-D; the same arguments). In training
    mode (and whenever ``track_running_stats=False``) the mean and variance
    are those of the ranks' batches together, and the backward pass gives each
    rank the gradient of that normalization; the running statistics are
    updated from them (the same values on every rank). In evaluation mode it
    uses the running statistics, as ``BatchNorm`` does, without communicating.

    Each forward pass in training mode is collective (an allgather), and so
    is each backward pass (an allreduce): every rank runs the same layers in
    the same order. The ranks' batch sizes may differ. Statistics are
    combined in float64 in rank order, so every rank gets the same bits. The
    weight's and bias's gradients are this rank's part, for the
    ``DistributedOptimizer`` to average like any other gradient (as in
    Horovod). With one rank (or before :func:`init`) it is ``BatchNorm``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        # Batch statistics: the running ones are updated in training mode only.
        rm = self.running_mean if self.training else None
        rv = self.running_var if self.training else None
        env = _state.env
        if env is None or env.size == 1:
            return F.batch_norm(input, rm, rv, self.weight, self.bias, True, factor, self.eps)
        out: torch.Tensor = _SyncBatchNormFn.apply(input, self.weight, self.bias, rm, rv, self.eps, factor)
        return out
