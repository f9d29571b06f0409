"""Ranks' side of test_horovod.py: Horovod's and BytePS's names on real
processes. `inputs(r, w)` is each rank's data; the test rebuilds every rank's
to compute the single-process reference."""

from __future__ import annotations

import time

import torch

import tidewire
import tidewire.torch as tw


def inputs(r: int, w: int) -> dict:
    g = torch.Generator().manual_seed(100 + r)
    return {
        "f32": torch.randn(7, 3, generator=g) * 1000,
        "f64": torch.randn(5, generator=g, dtype=torch.float64) / 3,
        "f16": torch.randn(6, generator=g).half(),
        "bf16": torch.randn(6, generator=g).bfloat16(),
        "i64": torch.tensor([2**40 + r, -(2**40 + 1) * (r + 1), 2**62 // 4 + r], dtype=torch.int64),
        "i32": torch.randint(-1000, 1000, (9,), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8),
        "rows": torch.arange((r + 1) * 3, dtype=torch.float64).reshape(r + 1, 3) + 10 * r,
        "rows_i64": torch.full((r + 2, 2), 2**50 + r, dtype=torch.int64),
        "bools": torch.tensor([r % 2 == 0, True, r == w - 1]),
        "a2a": torch.arange(sum(q + r + 1 for q in range(w)) * 2, dtype=torch.int64).reshape(-1, 2) + 1000 * r,
        "a2a_splits": [q + r + 1 for q in range(w)],
        "rs": torch.randn(5, 2, generator=g),
    }


def hvd_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def hvd_batch(step: int, r: int, w: int):
    """Rank r's shard (4 rows) of step ``step``'s batch."""
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _err(f) -> str:
    try:
        f()
        return ""
    except (tidewire.TidewireError, ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"


def collectives(cfg) -> dict:
    tw.init()
    r, w = tw.rank(), tw.size()
    x = inputs(r, w)
    res: dict = {"topology": (tw.local_rank(), tw.local_size(), tw.cross_rank(), tw.cross_size()),
                 "probes": [f() for f in (tw.mpi_built, tw.gloo_built, tw.nccl_built, tw.ddl_built, tw.ccl_built,
                                          tw.cuda_built, tw.rocm_built, tw.mpi_enabled, tw.gloo_enabled)],
                 "is_initialized": tw.is_initialized()}
    for k in ("f32", "f64", "f16", "bf16", "i64", "i32"):
        res[f"sum_{k}"] = tw.allreduce(x[k], op=tw.Sum, name=f"sum_{k}")
        res[f"avg_{k}"] = tw.allreduce(x[k], name=f"avg_{k}")
    res["min_i32"] = tw.allreduce(x["i32"], op=tw.Min)
    res["max_f64"] = tw.allreduce(x["f64"], op=tw.Max)
    res["prod_f32"] = tw.allreduce(x["f32"][:2] / 1000, op=tw.Product)
    res["and_bool"] = tw.allreduce(x["bools"], op=tw.Min)
    res["scaled"] = tw.allreduce(x["f32"], op=tw.Average, prescale_factor=0.5, postscale_factor=3.0)
    res["deprecated_average_false"] = tw.allreduce(x["i64"], average=False)
    inplace = x["f64"].clone()
    res["inplace_ret_is_input"] = tw.allreduce_(inplace, op=tw.Sum) is inplace
    res["inplace"] = inplace
    res["fp16"] = tw.allreduce(x["f32"], op=tw.Sum, compression=tw.Compression.fp16)
    res["grouped"] = tw.grouped_allreduce([x["f32"], x["i64"]], op=tw.Sum)
    res["push_pull"] = tw.push_pull(x["i64"], average=False, name="pp")
    t = x["f32"].clone()
    tw.declare("pp_async")
    h = tw.push_pull_async_inplace(t, average=True, name="pp_async")
    # A blocking collective after an async one: both in call order on every rank.
    res["bcast_between"] = tw.broadcast(torch.tensor([r], dtype=torch.int64), root_rank=w - 1)
    res["async_poll_before_sync"] = isinstance(tw.poll(h), bool)
    res["async_inplace_is_t"] = tw.synchronize(h) is t
    res["async_inplace"] = t
    h1 = tw.allreduce_async(x["i64"], op=tw.Sum)
    h2 = tw.broadcast_async(x["f64"], root_rank=0)
    h3 = tw.allgather_async(x["rows"])
    res["async_three"] = [tw.synchronize(h3), tw.synchronize(h2), tw.synchronize(h1)]
    res["sync_twice"] = _err(lambda: tw.synchronize(h1))
    res["allgather_f64"] = tw.allgather(x["rows"])
    res["allgather_i64"] = tw.allgather(x["rows_i64"])
    res["allgather_bool"] = tw.allgather(x["bools"])
    res["grouped_allgather"] = tw.grouped_allgather([x["rows"], x["bools"]])
    res["objects"] = tw.allgather_object({"rank": r, "t": torch.ones(r + 1)})
    res["alltoall"] = tw.alltoall(x["a2a"], splits=x["a2a_splits"])
    res["alltoall_even"] = tw.alltoall(torch.arange(w * 2) + 100 * r)
    res["reducescatter"] = tw.reducescatter(x["rs"], op=tw.Sum)
    res["reducescatter_avg"] = tw.reducescatter(x["rs"])
    xg = x["f32"][0].clone().requires_grad_(True)
    y = tw.allreduce(xg, op=tw.Sum)
    (y * (r + 1)).sum().backward()
    res["autograd"] = xg.grad
    res["join"] = tw.join()
    # Errors: raised on every rank, no hang.
    res["adasum"] = _err(lambda: tw.allreduce(x["f32"], op=tw.Adasum))
    res["adasum_opt"] = _err(lambda: tw.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1),
                                                             op=tw.Adasum))
    res["dtype_mismatch"] = _err(lambda: tw.allreduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)))
    res["op_mismatch"] = _err(lambda: tw.allreduce(torch.ones(4), op=tw.Sum if r == 0 else tw.Average))
    res["shape_mismatch"] = _err(lambda: tw.allgather(torch.ones(2, 2 + (r == 1))))
    res["bad_splits"] = _err(lambda: tw.alltoall(torch.ones(3), splits=[1] * (w + 1)))
    res["bad_op"] = _err(lambda: tw.allreduce(torch.ones(2), op=17))
    res["mpi_threads"] = _err(tw.mpi_threads_supported)
    res["join_vs_allreduce"] = _err(lambda: tw.join() if r == 0 else tw.allreduce(torch.ones(1)))
    res["after"] = tw.allreduce(torch.ones(2), op=tw.Sum)
    tw.shutdown()
    return res


def train(cfg) -> dict:
    """A tiny model under DistributedOptimizer with Horovod's op, factor and
    compression; each rank its shard of each step's batch."""
    tw.init()
    r, w = tw.rank(), tw.size()
    out = {}
    for name, kw in cfg["runs"].items():
        net = hvd_model()
        kw = dict(kw)
        if "compression" in kw:
            kw["compression"] = getattr(tw.Compression, kw["compression"])
        if "op" in kw:
            kw["op"] = getattr(tw, kw["op"])
        opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(), **kw)
        tw.broadcast_parameters(net.state_dict(), root_rank=0)
        for step in range(cfg["steps"]):
            xb, yb = hvd_batch(step, r, w)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        opt.synchronize()
        out[name] = {k: v.detach().clone() for k, v in net.state_dict().items()}
        opt.close()
    t0 = time.time()
    tw.shutdown()
    out["shutdown_s"] = time.time() - t0
    return out


def adasum_inputs(r: int) -> dict:
    """Rank r's tensors for the Adasum scenario (the test rebuilds them for its reference)."""
    g = torch.Generator().manual_seed(500 + r)
    return {
        "f32": torch.randn(5, 7, generator=g) * (r + 1),
        "f64": torch.randn(23, generator=g, dtype=torch.float64) * 10.0 ** (r - 1),
        "f16": (torch.randn(19, generator=g) * 3).half(),
        # rank 0's zero tensor: a squared norm below 2**-511 keeps its coefficient at 1
        "zero_or_not": torch.zeros(4) if r == 0 else torch.randn(4, generator=g),
        "mixed": torch.randn(6, generator=g, dtype=torch.float64),
    }


ADASUM_RUNS = {
    "sgd": {"opt": "sgd"},
    "adam": {"opt": "adam"},
    "passes2": {"opt": "sgd", "backward_passes_per_step": 2},
    "fp16": {"opt": "sgd", "compression": "fp16"},
}


def adasum_opt(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def adasum(cfg) -> dict:
    """allreduce(op=Adasum) in every form, DistributedOptimizer(op=Adasum)
    training, and the refusals; on 2 or 4 ranks."""
    tw.init()
    r, w = tw.rank(), tw.size()
    x = adasum_inputs(r)
    A = tw.Adasum
    res: dict = {}
    for k in ("f32", "f64", "f16", "zero_or_not"):
        res[k] = tw.allreduce(x[k], op=A, name=f"adasum_{k}")
    t = x["f64"].clone()
    res["inplace_is_t"] = tw.allreduce_(t, op=A) is t
    res["inplace"] = t
    t = x["f32"].clone()
    h = tw.allreduce_async_(t, op=A)
    h2 = tw.allreduce_async(x["f16"], op=A)
    res["async"] = [tw.synchronize(h), tw.synchronize(h2)]
    res["grouped"] = tw.grouped_allreduce([x["f32"], x["mixed"]], op=A)
    res["scaled"] = tw.allreduce(x["f32"], op=A, prescale_factor=0.3, postscale_factor=1.7)
    res["scaled16"] = tw.allreduce(x["f16"], op=A, prescale_factor=0.3, postscale_factor=1.7)
    res["fp16_compression"] = tw.allreduce(x["f32"], op=A, compression=tw.Compression.fp16)
    res["bf16"] = _err(lambda: tw.allreduce(x["f32"].bfloat16(), op=A))
    res["int"] = _err(lambda: tw.allreduce(torch.ones(3, dtype=torch.int64), op=A))
    res["reducescatter"] = _err(lambda: tw.reducescatter(x["f32"], op=A))

    for name, kw in cfg["runs"].items():
        kw = dict(kw)
        net = hvd_model()
        opt = adasum_opt(kw.pop("opt"), net.parameters())
        if "compression" in kw:
            kw["compression"] = getattr(tw.Compression, kw["compression"])
        passes = kw.get("backward_passes_per_step", 1)
        opt = tw.DistributedOptimizer(opt, named_parameters=net.named_parameters(), op=A, **kw)
        for step in range(cfg["steps"]):
            opt.zero_grad()
            for micro in range(passes):
                xb, yb = hvd_batch(10 * step + micro, r, w)
                torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        res[f"train_{name}"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
        res[f"stats_{name}"] = opt.tidewire_stats()
        opt.close()

    def build(**kw):
        return tw.DistributedOptimizer(torch.optim.SGD(hvd_model().parameters(), lr=0.1), op=A, **kw)

    res["refuse_server"] = _err(lambda: build(apply="server"))
    res["refuse_sfb"] = _err(lambda: build(sfb="always"))
    res["refuse_prefetch"] = _err(lambda: build(prefetch=True))
    res["refuse_comm_every"] = _err(lambda: build(comm_every=2))
    res["refuse_predivide"] = _err(lambda: build(gradient_predivide_factor=2.0))
    res["refuse_bf16"] = _err(lambda: build(compression=tw.Compression.bf16))
    net = hvd_model()
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=A)
    xb, yb = hvd_batch(0, r, w)
    res["skip_sync"] = _err(lambda: opt.skip_synchronize().__enter__())
    torch.nn.functional.cross_entropy(net(xb), yb).backward()
    res["zero_grad_before_step"] = _err(opt.zero_grad)
    res["too_many_passes"] = _err(lambda: torch.nn.functional.cross_entropy(net(xb), yb).backward())
    opt.close()
    res["after"] = tw.allreduce(torch.ones(2), op=tw.Sum)
    tw.shutdown()
    return res


SCENARIOS = {"hvd_collectives": collectives, "hvd_train": train, "hvd_adasum": adasum}


def run_fn(x: float):
    """What test_horovod's tidewire.run test runs on each rank."""
    tw.init()
    s = tw.allreduce(torch.tensor([float(tw.rank())]), op=tw.Sum).item()
    out = (tw.rank(), tw.size(), s * x)
    tw.shutdown()
    return out
