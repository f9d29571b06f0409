"""Models, data and the training loop shared by the test workers and the
single-process references (imported by both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, CLASSES = 12, 4


def data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, y


class MLP(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, hidden)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(hidden, 16)
        self.fc3 = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.act(self.fc1(x)))))


class Unused(MLP):
    """A module that is never called in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(7, 5)


class Frozen(MLP):
    def __init__(self) -> None:
        super().__init__()
        for p in self.fc1.parameters():
            p.requires_grad_(False)


class Tied(nn.Module):
    """One Parameter in two modules, used twice in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, 16)
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(self.b(torch.relu(self.a(h)))))


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 24)
        self.bn = nn.BatchNorm1d(24)
        self.fc2 = nn.Linear(24, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Wide(nn.Module):
    """Wide FC layers, where sufficient factors (K x (M+N)) beat the PS (M x N)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 96)
        self.fc2 = nn.Linear(96, 96)
        self.fc3 = nn.Linear(96, CLASSES, bias=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Emb(nn.Module):
    """An embedding of tokens drawn from the inputs, then FC layers."""

    sparse = False

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 8, sparse=self.sparse)
        self.fc1 = nn.Linear(8 + D_IN, 16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x):
        idx = (x[:, :3] * 1000).abs().long() % 500
        h = torch.cat([self.emb(idx).sum(1), x], dim=1)
        return self.fc2(torch.relu(self.fc1(h)))


class SparseEmb(Emb):
    """`Emb` with `nn.Embedding(sparse=True)`: sparse gradients."""

    sparse = True


MODELS = {"mlp": MLP, "unused": Unused, "frozen": Frozen, "tied": Tied, "bn": BN, "wide": Wide, "emb": Emb,
          "emb_sparse": SparseEmb}


def model(name: str, seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def optimizer(name: str, params, lr: float = 0.05):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr / 10)
    raise ValueError(name)


def train(net: nn.Module, opt, steps: int, batch: int, rank: int = 0, world: int = 1, passes: int = 1,
          zero=None, seed: int = 0, first: int = 0):
    """Each step takes the next global batch; this rank trains on its shard of
    it (in ``passes`` backward passes), steps ``first`` to ``steps``. Returns the losses."""
    x, y = data(seed=seed)
    per = batch // world
    losses = []
    for s in range(first, steps):
        lo = (s * batch) % (x.shape[0] - batch + 1)
        xb, yb = x[lo : lo + batch], y[lo : lo + batch]
        xs, ys = xb[rank * per : (rank + 1) * per], yb[rank * per : (rank + 1) * per]
        (zero or opt.zero_grad)()
        sub = per // passes
        total = 0.0
        dtype = next(net.parameters()).dtype
        for k in range(passes):
            out = net(xs[k * sub : (k + 1) * sub].to(dtype))
            loss = F.cross_entropy(out, ys[k * sub : (k + 1) * sub]) / passes
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses
