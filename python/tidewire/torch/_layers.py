"""DistributedOptimizer's layer table: the synced parameters, grouped by module."""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

import torch
from torch import nn


#: Parameter dtypes DistributedOptimizer syncs (float32 in place, the others staged through float32).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# A gradient view into the flat buffer (an nn.Linear bias column in the
# sufficient-factor layout) need not share its parameter's strides: correct,
# and autograd accumulates into it in place all the same.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


# --------------------------------------------------------------------------- DistributedOptimizer


class _Param:
    """One synced parameter: where it lives in the flat buffers."""

    __slots__ = ("param", "name", "layer", "gview", "rview", "count", "hook", "cleared")

    def __init__(self, param: nn.Parameter, name: str, layer: "_Layer") -> None:
        self.param = param
        self.name = name
        self.layer = layer
        self.gview: torch.Tensor = torch.empty(0)
        self.rview: torch.Tensor = torch.empty(0)
        self.count = 0
        self.hook: Any = None
        #: ``zero_grad`` set ``.grad`` to None: backward's first gradient is copied into ``gview``.
        self.cleared = False


class _Call:
    """One forward call of an SFB layer's nn.Linear: its input rows, and the
    gradient of its output once backward has produced it."""

    __slots__ = ("x", "delta")

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.delta: Optional[torch.Tensor] = None


class _Layer:
    """One Tidewire layer: the parameters of one module."""

    def __init__(self, index: int, name: str, module: Optional[nn.Module]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params: List[_Param] = []
        self.kind = "other"
        self.m = 1
        self.n = 1
        self.sfb_layout = False  # nn.Linear as one M x (in+1) block: weight columns, then the bias
        # nn.Embedding(sparse=True): the sparse-push hint (slices go as index/value pairs when that pays).
        self.sparse = False
        self.offset = 0
        self.numel = 0
        self.scheme = "ps"
        #: Pushed as its sufficient factors (SFB, or any FC layer under sfb='adaptive').
        self.factors = False
        self.ready = 0
        self.pushed = False
        self.in_flight = False
        self.zero_on_pull = False
        self.calls: List[_Call] = []
        self.checked = False


def _is_linear_sfb_candidate(module: Optional[nn.Module], params: List[Tuple[str, nn.Parameter]]) -> bool:
    if module is None or type(module) is not nn.Linear:
        return False
    want = {id(module.weight)}
    if module.bias is not None:
        want.add(id(module.bias))
    return {id(p) for _, p in params} == want and len(params) == len(want)
