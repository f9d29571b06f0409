"""Horovod's and BytePS's names in tidewire.torch: every collective against a
single-process reference (bitwise: float32 sums in rank order, float64 and
integers reduced in their dtype in rank order), the async handles, the
DistributedOptimizer's op, predivide factor and compression, and the errors."""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch

import tidewire
import tidewire.torch as tw
from _hvd_scenarios import ADASUM_RUNS, adasum_inputs, adasum_opt, hvd_batch, hvd_model, inputs
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
        # Three ranks: Adasum is refused as Horovod refuses it (not a power of two).
        assert x["adasum"].startswith("NotImplementedError: allreduce_async: op=Adasum with 3 ranks"), x["adasum"]
        assert x["adasum_opt"].startswith("NotImplementedError: DistributedOptimizer: op=Adasum with 3"), x["adasum_opt"]
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


# --------------------------------------------------------------------------- Adasum
#
# An independent single-process reference of Horovod's Adasum
# (horovod/common/ops/adasum/adasum.h), in Python floats (IEEE doubles) with
# explicit roundings: no torch arithmetic. Every comparison is bitwise: the
# order of every sum is fixed (dot products and norms: a float64 loop over the
# elements; the tree: rank order).


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _f16(x):
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _rn32(q):
    """The Fraction q rounded to the nearest float32, ties to even."""
    c = _f32(float(q))
    b = struct.unpack("<i", struct.pack("<f", c))[0]
    cands = [c, 2.0**-149, -(2.0**-149), 0.0]
    for d in (-1, 1):
        cands.append(struct.unpack("<f", struct.pack("<i", b + d))[0])
    cands = [v for v in cands if v == v and abs(v) != float("inf")]
    return min(cands, key=lambda v: (abs(Fraction(v) - q), struct.unpack("<i", struct.pack("<f", v))[0] & 1))


def ref_pair(a, b, dtype):
    dot = an = bn = 0.0
    for x, y in zip(a, b):
        dot += x * y
        an += x * x
        bn += y * y
    ca = 1.0 - dot / an * 0.5 if an >= 2.0**-511 else 1.0
    cb = 1.0 - dot / bn * 0.5 if bn >= 2.0**-511 else 1.0
    if dtype == torch.float16:
        ca32, cb32 = _f32(ca), _f32(cb)
        return [_f16(_rn32(Fraction(cb32) * Fraction(y) + Fraction(_f32(ca32 * x)))) for x, y in zip(a, b)]
    rnd = _f32 if dtype == torch.float32 else float
    return [rnd(ca * x + cb * y) for x, y in zip(a, b)]


def ref_tree(rows, dtype):
    """Horovod's tree as a recursion: the first half of the ranks against the second."""
    if len(rows) == 1:
        return rows[0]
    h = len(rows) // 2
    return ref_pair(ref_tree(rows[:h], dtype), ref_tree(rows[h:], dtype), dtype)


def ref_scale(v, f, dtype):
    if f == 1.0:
        return v
    if dtype == torch.float64:
        return [f * x for x in v]
    r = [_f32(_f32(f) * x) for x in v]
    return [_f16(x) for x in r] if dtype == torch.float16 else r


def ref_adasum(ts, pre=1.0, post=1.0):
    dt = ts[0].dtype
    rows = [ref_scale([float(x) for x in t.reshape(-1).tolist()], pre, dt) for t in ts]
    return torch.tensor(ref_scale(ref_tree(rows, dt), post, dt), dtype=dt).reshape(ts[0].shape)


def adasum_train_reference(kw, w, steps):
    """Every rank's model and optimizer in one process: each steps on its own
    gradients, the parameters' deltas are combined by ref_tree, every model
    gets start + combined."""
    kw = dict(kw)
    nets = [hvd_model() for _ in range(w)]
    opts = [adasum_opt(kw["opt"], n.parameters()) for n in nets]
    passes = kw.get("backward_passes_per_step", 1)
    fp16 = kw.get("compression") == "fp16"
    for step in range(steps):
        deltas, starts = [], None
        for r in range(w):
            opts[r].zero_grad()
            for micro in range(passes):
                xb, yb = hvd_batch(10 * step + micro, r, w)
                torch.nn.functional.cross_entropy(nets[r](xb), yb).backward()
            before = [p.detach().clone() for p in nets[r].parameters()]
            opts[r].step()
            deltas.append([p.detach() - s for p, s in zip(nets[r].parameters(), before)])
            starts = before
        for i, start in enumerate(starts):
            rows = [d[i].half() if fp16 else d[i] for d in deltas]
            comb = ref_adasum(rows).float()
            for n in nets:
                with torch.no_grad():
                    list(n.parameters())[i].copy_(start + comb)
    return nets[0].state_dict()


ADASUM_STEPS = 3


@pytest.fixture(scope="module", params=[2, 4])
def ada(request, tmp_path_factory):
    w = request.param
    r = run_ranks(tmp_path_factory.mktemp(f"adasum{w}"), w,
                  {"scenario": "hvd_adasum", "runs": ADASUM_RUNS, "steps": ADASUM_STEPS}, timeout=180)
    print(f"\n[adasum on {w} ranks: {r.seconds:.1f} s]")
    return w, r.results()


def test_adasum_allreduce_matches_horovods_algorithm_bitwise(ada):
    w, res = ada
    xs = [adasum_inputs(r) for r in range(w)]
    col = {k: [x[k] for x in xs] for k in xs[0]}
    for rank, x in enumerate(res):
        for k in ("f32", "f64", "f16", "zero_or_not"):
            assert equal(x[k], ref_adasum(col[k])), (rank, k)
        assert x["inplace_is_t"] and equal(x["inplace"], ref_adasum(col["f64"]))
        assert equal(x["async"][0], ref_adasum(col["f32"])) and equal(x["async"][1], ref_adasum(col["f16"]))
        assert equal(x["grouped"][0], ref_adasum(col["f32"])) and equal(x["grouped"][1], ref_adasum(col["mixed"]))
        assert equal(x["scaled"], ref_adasum(col["f32"], 0.3, 1.7))
        assert equal(x["scaled16"], ref_adasum(col["f16"], 0.3, 1.7))
        assert equal(x["fp16_compression"], ref_adasum([t.half() for t in col["f32"]]).float())
        assert x["bf16"].startswith("TypeError: allreduce_async: op=Adasum of torch.bfloat16"), x["bf16"]
        assert x["int"].startswith("TypeError: allreduce_async: op=Adasum of torch.int64"), x["int"]
        assert "Reducescatter currently only supports AVERAGE and SUM" in x["reducescatter"], x["reducescatter"]
        assert equal(x["after"], torch.full((2,), float(w)))
    # Not a sum in disguise: Adasum differs from the plain sum and the average here.
    assert not equal(res[0]["f64"], rank_sum(col["f64"])) and not equal(res[0]["f64"], rank_avg(col["f64"]))
    # Rank 0's zero tensor: its coefficient stays 1 and the others' dot with it is 0.
    if w == 2:
        assert equal(res[0]["zero_or_not"], col["zero_or_not"][1])


def test_adasum_optimizer_takes_horovods_delta_steps(ada):
    w, res = ada
    for name, kw in ADASUM_RUNS.items():
        want = adasum_train_reference(kw, w, ADASUM_STEPS)
        for rank, x in enumerate(res):
            got = x[f"train_{name}"]
            for k, v in want.items():
                assert equal(got[k], v), f"{name}: rank {rank}: {k} differs from the reference"
            st = x[f"stats_{name}"]
            assert st["op"] == "adasum" and st["steps"] == ADASUM_STEPS
            assert st["bytes_gathered"] == ADASUM_STEPS * w * sum(v.numel() * (2 if name == "fp16" else 4)
                                                                   for v in want.values())
    # Not the gradient average: a plain data-parallel SGD lands elsewhere.
    assert not equal(res[0]["train_sgd"]["0.weight"], hvd_model().state_dict()["0.weight"])


def test_adasum_refusals_are_clear(ada):
    w, res = ada
    for x in res:
        assert x["refuse_server"].startswith("ValueError: DistributedOptimizer(op=Adasum) does not take apply="), \
            x["refuse_server"]
        assert "sfb='always'" in x["refuse_sfb"] and "prefetch=True" in x["refuse_prefetch"]
        assert "comm_every" in x["refuse_comm_every"]
        assert x["refuse_predivide"].startswith("ValueError: gradient_predivide_factor is only supported with op=Av")
        assert x["refuse_bf16"].startswith("TypeError: DistributedOptimizer: parameter allreduce.noname.0.0 "
                                           "(torch.float32): op=Adasum of torch.bfloat16"), x["refuse_bf16"]
        assert "skip_synchronize() is not supported with op=Adasum" in x["skip_sync"], x["skip_sync"]
        assert "zero_grad() was called after loss.backward()" in x["zero_grad_before_step"]
        assert "accumulated 2 times before step()" in x["too_many_passes"], x["too_many_passes"]


def test_adasum_fp16_fma_rounds_once():
    """Horovod's float16 kernel adds with one float32 FMA; _fma32 rounds once
    where a float64 sum then a float32 rounding would round twice."""
    from tidewire.torch._reduce import _fma32

    # 1 + 2**-24 * x * y with x * y = 1 + 2**-30 (exact): the float64 sum rounds to
    # 1 + 2**-24, a float32 tie, which rounds to 1.0; once, it is 1 + 2**-23.
    y = 1.0 + 2.0**-10
    x = _f32(1 / y)
    eps = Fraction(x) * Fraction(y) - 1
    assert 0 < eps < Fraction(2) ** -29
    got = _fma32(torch.tensor(x), torch.tensor([y * 2.0**-24]), torch.tensor([1.0])).item()
    naive = (torch.tensor(x, dtype=torch.float64) * (y * 2.0**-24) + 1.0).float().item()
    assert naive == 1.0 and got == 1.0 + 2.0**-23
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(300, generator=g)
    ys = torch.randn(300, generator=g).half().float() * 1e-4
    zs = torch.randn(300, generator=g)
    out = _fma32(xs, ys, zs)
    for a, b, c, o in zip(xs.tolist(), ys.tolist(), zs.tolist(), out.tolist()):
        assert o == _rn32(Fraction(a) * Fraction(b) + Fraction(c))
