"""Ranks' side of test_elastic.py (hvd.elastic under torchrun with a rank
killed), test_suspend.py (BytePS's suspend/resume) and test_sync_batch_norm.py."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

import tidewire
import tidewire.torch as tw
from _hvd_scenarios import hvd_batch, hvd_model


def _err(f) -> str:
    try:
        f()
        return ""
    except (tidewire.TidewireError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- elastic


def elastic_train(cfg) -> dict:
    """A TorchState (model, SGD with momentum, batch, history) trained
    ``cfg["steps"]`` steps under @elastic.run, committing every
    ``commit_every``. In the first attempt rank ``kill_rank`` SIGKILLs itself
    once ``kill_after`` steps are done (after the commit before it, before the
    next), first writing what it had to OUT/attempt0-rank{r}.pt. Without
    torchrun (``cfg["catch"]``) the survivors return the error instead."""
    out = sys.argv[1]
    tw.init()
    r, w = tw.rank(), tw.size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    net = hvd_model()
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=net.named_parameters())
    state = tw.elastic.TorchState(net, opt, batch=0, history=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(("first", state.batch)),
                                    lambda: resets.append(("second", state.batch))])
    starts = []

    @tw.elastic.run
    def train(state):
        starts.append(state.batch)
        for step in range(state.batch, cfg["steps"]):
            xb, yb = hvd_batch(step, r, w)
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
            state.history.append(step)
            state.batch = step + 1
            if state.batch % cfg["commit_every"] == 0:
                state.commit()
            if attempt == 0 and r == cfg["kill_rank"] and state.batch == cfg["kill_after"]:
                torch.save({"batch": state.batch, "history": list(state.history),
                            "params": {k: v.clone() for k, v in net.state_dict().items()}},
                           os.path.join(out, f"attempt0-rank{r}.pt"))
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    error = None
    try:
        train(state)
    except tidewire.TidewireError as e:
        if not cfg.get("catch"):
            raise
        error = str(e)
    res = {"attempt": attempt, "starts": starts, "resets": resets, "history": list(state.history),
           "batch": state.batch, "error": error,
           "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
           "momentum": [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()
                        if "momentum_buffer" in opt.state[p]]}
    if error is None:
        tw.shutdown()
    else:
        os._exit(_save_and_exit(out, r, res))
    return res


def _save_and_exit(out: str, r: int, res: dict) -> int:
    """A rank whose peer died: saves its result and leaves without shutdown
    (which would wait for the dead peer)."""
    torch.save(res, os.path.join(out, f"rank{r}.pt"))
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------- suspend / resume


def _step(net, opt, step, r, w):
    xb, yb = hvd_batch(step, r, w)
    opt.zero_grad()
    F.cross_entropy(net(xb), yb).backward()
    opt.step()


def suspend_resume(cfg) -> dict:
    """Two steps, suspend, the refused resumes, resume, a step, suspend and
    resume again (num_workers counting hosts), a step: the same
    DistributedOptimizer throughout (BytePS's elastic example's calls)."""
    tw.init()
    r, w = tw.rank(), tw.size()
    net = hvd_model()
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    tw.broadcast_parameters(net.state_dict(), root_rank=0)
    res: dict = {"not_suspended": _err(lambda: tw.resume(w, 1))}
    for step in range(2):
        _step(net, opt, step, r, w)
    tw.suspend()
    res["while_suspended"] = _err(lambda: tw.allreduce(torch.ones(1)))
    res["is_initialized_while_suspended"] = tw.is_initialized()
    res["who_while_suspended"] = (tw.rank(), tw.size(), tw.local_rank(), tw.local_size())
    res["more_workers"] = _err(lambda: tw.resume(w + 1, 1))
    res["who_after_refusal"] = (tw.rank(), tw.size())
    res["other_rank"] = _err(lambda: tw.resume(w, 1, 0))  # every rank asks to be rank 0
    res["bad_servers"] = _err(lambda: tw.resume(w, -1))
    res["still_suspended"] = _err(lambda: tw.allreduce(torch.ones(1)))
    tw.resume(w, 1, global_rank=r, context=None)
    res["size_after"] = tw.size()
    res["rank_after"] = tw.rank()
    _step(net, opt, 2, r, w)
    # Again, counting workers as BytePS's DMLC_NUM_WORKER does: hosts (one here, of w ranks).
    tw.suspend()
    tw.resume(1, 1)
    _step(net, opt, 3, r, w)
    opt.synchronize()
    res["params"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    res["sum_after"] = tw.allreduce(torch.tensor([float(r + 1)]), op=tw.Sum)
    tw.shutdown()
    return res


# --------------------------------------------------------------------------- SyncBatchNorm


def bn_rows(w: int):
    """Rows of each rank's batch: they differ (3, 5, 4, ...)."""
    return [3 + (2 * r) % 5 for r in range(w)]


def bn_data(w: int, shape, seed: int = 0):
    """The global batch (each rank's rows shifted by its rank, so a rank's
    own statistics differ from the global ones), and the loss weights."""
    g = torch.Generator().manual_seed(seed)
    rows = bn_rows(w)
    xs = [torch.randn(n, *shape, generator=g) * (1 + r) + 3 * r for r, n in enumerate(rows)]
    gs = [torch.randn(n, *shape, generator=g) for n in rows]
    return xs, gs


def bn_module(cls, c: int, **kw):
    m = cls(c, **kw)
    g = torch.Generator().manual_seed(5)
    if m.affine:
        with torch.no_grad():
            m.weight.copy_(torch.rand(c, generator=g) + 0.5)
            m.bias.copy_(torch.randn(c, generator=g))
    return m


def bn_case(m, xs, gs, r, steps: int = 2) -> dict:
    """``steps`` training forwards and backwards (loss sum(y * g)), then an
    evaluation forward; what each gave."""
    res: dict = {"y": [], "dx": [], "dw": [], "db": []}
    for s in range(steps):
        x = (xs[r] * (1 + s)).clone().requires_grad_(True)
        if m.affine:
            m.weight.grad = m.bias.grad = None
        y = m(x)
        (y * gs[r]).sum().backward()
        res["y"].append(y.detach().clone())
        res["dx"].append(x.grad.clone())
        if m.affine:
            res["dw"].append(m.weight.grad.clone())
            res["db"].append(m.bias.grad.clone())
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        v = getattr(m, k)
        res[k] = None if v is None else v.clone()
    m.eval()
    with torch.no_grad():
        res["eval"] = m(xs[r]).clone()
    m.train()
    return res


BN_CASES = {
    "2d": (dict(), (4, 3, 3)),
    "1d_no_momentum": (dict(momentum=None), (6,)),
    "3d_no_affine": (dict(affine=False), (2, 2, 2, 2)),
    "no_running_stats": (dict(track_running_stats=False), (4, 5)),
}


def sync_bn(cfg) -> dict:
    tw.init()
    r, w = tw.rank(), tw.size()
    res = {}
    for name, (kw, shape) in BN_CASES.items():
        xs, gs = bn_data(w, shape)
        res[name] = bn_case(bn_module(tw.SyncBatchNorm, shape[0], **kw), xs, gs, r)
    res["one_d_input"] = _err(lambda: tw.SyncBatchNorm(3)(torch.ones(3)))
    tw.shutdown()
    return res


SCENARIOS = {"elastic_train": elastic_train, "suspend_resume": suspend_resume, "sync_bn": sync_bn}
