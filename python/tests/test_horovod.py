"""Horovod's and BytePS's names in tidewire.torch: every collective against a
single-process reference (bitwise: float32 sums in rank order, float64 and
integers reduced in their dtype in rank order), the async handles, the
DistributedOptimizer's op, predivide factor and compression, and the errors."""

from __future__ import annotations

import pytest
import torch

import tidewire
import tidewire.torch as tw
from _hvd_scenarios import hvd_batch, hvd_model, inputs
from conftest import run_ranks


def fold(xs, f):
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = f(acc, x)
    return acc


def rank_sum(xs):
    """The ranks' tensors summed in rank order, in their dtype (float16/bfloat16: in float32)."""
    if xs[0].dtype in (torch.float16, torch.bfloat16):
        return fold([x.float() for x in xs], lambda a, b: a + b).to(xs[0].dtype)
    return fold(xs, lambda a, b: a + b)


def rank_avg(xs):
    w = len(xs)
    if not xs[0].dtype.is_floating_point:
        return torch.div(rank_sum(xs), w, rounding_mode="trunc")
    wide = xs[0].dtype in (torch.float16, torch.bfloat16)
    s = fold([x.float() for x in xs], lambda a, b: a + b) if wide else rank_sum(xs)
    return (s * (torch.tensor(1.0, dtype=s.dtype) / w)).to(xs[0].dtype)


def equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def coll(tmp_path_factory):
    # Three ranks: a sum in rank order differs from its other orders; the
    # optimizer test below runs on two (the examples run on both counts).
    w = 3
    r = run_ranks(tmp_path_factory.mktemp(f"hvd{w}"), w, {"scenario": "hvd_collectives"}, timeout=120)
    print(f"\n[horovod collectives on {w} ranks: {r.seconds:.1f} s]")
    return w, r.results()


def test_reductions_match_the_rank_order_reference(coll):
    w, res = coll
    xs = [inputs(r, w) for r in range(w)]
    for k in ("f32", "f64", "f16", "bf16", "i64", "i32"):
        col = [x[k] for x in xs]
        for x in res:
            assert equal(x[f"sum_{k}"], rank_sum(col)), k
            assert equal(x[f"avg_{k}"], rank_avg(col)), k
    i64 = [x["i64"] for x in xs]
    assert rank_sum(i64)[0].item() == sum(2**40 + r for r in range(w))  # beyond float32 and float64
    f32 = [x["f32"] for x in xs]
    for x in res:
        assert equal(x["min_i32"], fold([y["i32"] for y in xs], torch.minimum))
        assert equal(x["max_f64"], fold([y["f64"] for y in xs], torch.maximum))
        assert equal(x["prod_f32"], fold([y["f32"][:2] / 1000 for y in xs], lambda a, b: a * b))
        assert equal(x["and_bool"], fold([y["bools"] for y in xs], torch.minimum))
        want = rank_sum([t * 0.5 for t in f32]) * (torch.tensor(1.0) / w) * 3.0
        assert equal(x["scaled"], want)
        assert equal(x["deprecated_average_false"], rank_sum(i64))
        assert x["inplace_ret_is_input"] and equal(x["inplace"], rank_sum([y["f64"] for y in xs]))
        assert equal(x["fp16"], rank_sum([t.half().float() for t in f32]).half().float())
        assert equal(x["grouped"][0], rank_sum(f32)) and equal(x["grouped"][1], rank_sum(i64))
        assert equal(x["push_pull"], rank_sum(i64))
        assert equal(x["autograd"], torch.full((3,), float(sum(range(1, w + 1)))))


def test_async_handles_run_in_call_order(coll):
    w, res = coll
    xs = [inputs(r, w) for r in range(w)]
    for x in res:
        assert x["async_poll_before_sync"] and x["async_inplace_is_t"]
        assert equal(x["async_inplace"], rank_avg([y["f32"] for y in xs]))
        assert equal(x["bcast_between"], torch.tensor([w - 1]))
        rows, f64, i64 = x["async_three"]
        assert equal(rows, torch.cat([y["rows"] for y in xs]))
        assert equal(f64, xs[0]["f64"]) and equal(i64, rank_sum([y["i64"] for y in xs]))
        assert "already synchronized" in x["sync_twice"]


def test_gathers_alltoall_reducescatter(coll):
    w, res = coll
    xs = [inputs(r, w) for r in range(w)]
    rows = [5 // w + (1 if r < 5 % w else 0) for r in range(w)]
    for me, x in enumerate(res):
        assert equal(x["allgather_f64"], torch.cat([y["rows"] for y in xs]))
        assert equal(x["allgather_i64"], torch.cat([y["rows_i64"] for y in xs]))
        assert equal(x["allgather_bool"], torch.cat([y["bools"] for y in xs]))
        assert equal(x["grouped_allgather"][1], torch.cat([y["bools"] for y in xs]))
        assert [o["rank"] for o in x["objects"]] == list(range(w))
        assert all(equal(o["t"], torch.ones(r + 1)) for r, o in enumerate(x["objects"]))
        got, recv = x["alltoall"]
        want = []
        for y in xs:
            s = y["a2a_splits"]
            start = sum(s[:me])
            want.append(y["a2a"][start : start + s[me]])
        assert equal(got, torch.cat(want)) and equal(recv, torch.tensor([y["a2a_splits"][me] for y in xs],
                                                                          dtype=torch.int32))
        assert equal(x["alltoall_even"], torch.cat([torch.arange(w * 2)[2 * me : 2 * me + 2] + 100 * r
                                                    for r in range(w)]))
        start = sum(rows[:me])
        full = rank_sum([y["rs"] for y in xs])
        assert equal(x["reducescatter"], full[start : start + rows[me]])
        assert equal(x["reducescatter_avg"], rank_avg([y["rs"] for y in xs])[start : start + rows[me]])


def test_topology_probes_and_join(coll):
    w, res = coll
    joins = {x["join"] for x in res}
    assert len(joins) == 1 and 0 <= joins.pop() < w
    for r, x in enumerate(res):
        # run_ranks starts every rank with local rank 0 and no local size on one host.
        assert x["topology"] == (0, w, r, w)
        assert x["probes"] == [False] * 9 and x["is_initialized"]
        assert "does not use MPI" in x["mpi_threads"]


def test_errors_are_clear_and_on_every_rank(coll):
    w, res = coll
    for r, x in enumerate(res):
        assert x["adasum"].startswith("ValueError: op=Adasum is not implemented"), x["adasum"]
        assert x["adasum_opt"].startswith("ValueError: op=Adasum"), x["adasum_opt"]
        assert "ranks disagree" in x["dtype_mismatch"] and "float64" in x["dtype_mismatch"], x["dtype_mismatch"]
        assert "ranks disagree" in x["op_mismatch"] and "float32, average" in x["op_mismatch"], x["op_mismatch"]
        assert "differ beyond the first dimension" in x["shape_mismatch"], x["shape_mismatch"]
        assert x["bad_splits"].startswith("ValueError: alltoall: splits="), x["bad_splits"]
        assert x["bad_op"].startswith("ValueError: op=17"), x["bad_op"]
        assert "ranks disagree" in x["join_vs_allreduce"] and "join" in x["join_vs_allreduce"]
        assert equal(x["after"], torch.full((2,), float(w)))


RUNS = {
    "average": {},
    "sum": {"op": "Sum"},
    "predivide": {"gradient_predivide_factor": 4.0},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16", "op": "Sum"},
}
STEPS = 4


def reference(kw, w):
    """One process: every rank's gradient on its shard, reduced as the servers
    do (float32, rank order), then torch's SGD."""
    net = hvd_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    f = kw.get("gradient_predivide_factor", 1.0)
    cast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(kw.get("compression"))
    for step in range(STEPS):
        grads = []
        for r in range(w):
            net.zero_grad()
            xb, yb = hvd_batch(step, r, w)
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            g = [p.grad.clone() for p in net.parameters()]
            if cast is not None:
                g = [t.to(cast).float() for t in g]
            if f != 1.0:
                g = [t * (1.0 / f) for t in g]
            grads.append(g)
        for i, p in enumerate(net.parameters()):
            s = rank_sum([g[i] for g in grads])
            if f != 1.0:
                s = s * (f / w)
            elif kw.get("op") != "Sum":
                s = s * (torch.tensor(1.0) / w)
            p.grad = s
        opt.step()
    return net.state_dict()


def test_distributed_optimizer_op_predivide_compression_exact(tmp_path):
    torch.set_num_threads(1)
    w = 2
    r = run_ranks(tmp_path, w, {"scenario": "hvd_train", "runs": RUNS, "steps": STEPS}, timeout=120)
    res = r.results()
    for name, kw in RUNS.items():
        want = reference(kw, w)
        for rank, x in enumerate(res):
            for k, v in want.items():
                assert equal(x[name][k], v), f"{name}: rank {rank}: {k} differs from the reference"
    assert not equal(res[0]["sum"]["0.weight"], res[0]["average"]["0.weight"])


def test_single_process_names(clean_env):
    tw.init()
    try:
        assert (tw.local_size(), tw.cross_rank(), tw.cross_size()) == (1, 0, 1)
        t = torch.tensor([2**53 + 1, -3], dtype=torch.int64)
        assert equal(tw.allreduce(t), t) and equal(tw.allreduce(t, op=tw.Adasum), t)  # Adasum of one = itself
        with pytest.raises(ValueError, match="not both"):
            tw.allreduce(t, average=True, op=tw.Sum)
        with pytest.raises(TypeError, match="sparse"):
            tw.allreduce(torch.ones(2).to_sparse())
        with pytest.raises(TypeError, match="bool tensors"):
            tw.allreduce(torch.ones(2, dtype=torch.bool), op=tw.Sum)
        with pytest.raises(ValueError, match="floating-point"):
            tw.allreduce(t, prescale_factor=2.0)
        with pytest.raises(ValueError, match="at least one dimension"):
            tw.allgather(torch.tensor(1.0))
        with pytest.raises(ValueError, match="unknown"):
            tw.poll(12345)
        with pytest.raises(TypeError, match="compress"):
            tw.allreduce(torch.ones(2), compression=object())
        with pytest.raises(ValueError, match="only supported with op=Average"):
            net = hvd_model()
            tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=tw.Sum,
                                    gradient_predivide_factor=2.0)
        assert tw.declare("x") == 0
    finally:
        tw.shutdown()


def test_compression_round_trip():
    x = torch.tensor([1 / 3, 1e-8, 65504.0, 1e5], dtype=torch.float32)
    c, ctx = tw.Compression.fp16.compress(x)
    assert c.dtype == torch.float16 and ctx == torch.float32
    back = tw.Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float32 and equal(back, x.half().float())
    c, ctx = tw.Compression.bf16.compress(x)
    assert c.dtype == torch.bfloat16 and equal(tw.Compression.bf16.decompress(c, ctx), x.bfloat16().float())
    i = torch.arange(3)
    assert equal(tw.Compression.fp16.decompress(*tw.Compression.fp16.compress(i)), i)  # integers pass
    n, ctx = tw.Compression.none.compress(x)
    assert n is x and tw.Compression.none.decompress(n, ctx) is x


def test_byteps_module_alias():
    import importlib

    bps = importlib.import_module("tidewire.torch")
    for name in ("push_pull", "push_pull_async_inplace", "declare", "broadcast_parameters", "DistributedOptimizer",
                 "Compression", "synchronize", "poll", "init", "rank", "size", "local_rank", "local_size"):
        assert callable(getattr(bps, name)) or name == "Compression", name
    assert isinstance(tidewire.TidewireError("x"), RuntimeError)


def test_tidewire_run_starts_local_ranks(clean_env, monkeypatch):
    from _hvd_scenarios import run_fn

    assert tidewire.run(run_fn, args=(10.0,), np=2, hosts="localhost:2") == [(0, 2, 10.0), (1, 2, 10.0)]
    with pytest.raises(ValueError, match="this host only"):
        tidewire.run(run_fn, np=2, hosts="otherhost:2")
    with pytest.raises(ValueError, match="does not use MPI"):
        tidewire.run(run_fn, np=2, use_mpi=True)
    with pytest.raises(ValueError, match="min_np"):
        tidewire.run(run_fn, np=2, min_np=1)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(tidewire.TidewireError, match="call the function directly"):
        tidewire.run(run_fn, np=2)
