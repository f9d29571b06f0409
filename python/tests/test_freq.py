"""Communication frequency in tidewire.torch (Nexus): comm_every with the
'accumulate' and 'average' modes against single-process references that do
the same arithmetic (bit for bit), and the quality-guided controller end to
end on 2 ranks with a scripted quality figure."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import _common as C
import tidewire.torch as tw
from conftest import run_ranks

WORLD, BATCH = 2, 16
SCRIPT = {"rank": 1, "above": 2, "base": 1.0, "bad": 2.0}
RUNS = {
    # 10 steps, T = 3: exchanges at steps 2, 5, 8, and flush() syncs step 9's gradients.
    "acc3": {"opt": "momentum", "steps": 10, "batch": BATCH, "flush": True,
             "comm": {"comm_every": 3, "comm_mode": "accumulate"}},
    "avg4": {"opt": "momentum", "steps": 10, "batch": BATCH, "flush": True,
             "comm": {"comm_every": 4, "comm_mode": "average"}},
    # Average mode with a layer no backward reaches: what it exchanges is its value.
    "avg_unused": {"model": "unused", "opt": "momentum", "steps": 6, "batch": BATCH, "flush": True,
                   "comm": {"comm_every": 2, "comm_mode": "average"}},
    "guided": {"opt": "sgd", "steps": 50, "batch": BATCH, "quality_script": SCRIPT,
               "comm": {"comm_mode": "accumulate", "quality_guided": True, "comm_every_max": 8,
                        "quality_period": 2, "quality_tolerance": 0.05, "quality_revert_at": 40}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = run_ranks(tmp_path_factory.mktemp("freq"), WORLD, {"scenario": "multi", "runs": RUNS}, timeout=150)
    return r.results()


def _shards(s, world=WORLD, batch=BATCH):
    x, y = C.data()
    lo = (s * batch) % (x.shape[0] - batch + 1)
    xb, yb = x[lo : lo + batch], y[lo : lo + batch]
    per = batch // world
    return [(xb[r * per : (r + 1) * per], yb[r * per : (r + 1) * per]) for r in range(world)]


def _grads(net, x, y):
    loss = F.cross_entropy(net(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(net.parameters()))]


def _mean(parts):
    """What the servers compute: the sum in rank order, times 1/P in float32."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc * torch.tensor(1.0 / len(parts), dtype=torch.float32)


def ref_accumulate(t, steps, opt_name):
    """One process: each rank's gradients summed over the T steps (step order), the
    servers' mean over the ranks, then the torch optimizer; the last span is flushed."""
    torch.set_num_threads(1)
    net = C.model("mlp")
    opt = C.optimizer(opt_name, net.parameters())
    acc = [None] * WORLD
    for s in range(steps):
        for r, (x, y) in enumerate(_shards(s)):
            gs = _grads(net, x, y)
            acc[r] = gs if acc[r] is None else [a + g for a, g in zip(acc[r], gs)]
        if (s + 1) % t == 0 or s == steps - 1:
            for i, p in enumerate(net.parameters()):
                p.grad = _mean([acc[r][i] for r in range(WORLD)])
            opt.step()
            acc = [None] * WORLD
    return net.state_dict()


def ref_average(t, steps, opt_name):
    """One process: a model and an optimizer per rank, each stepping on its own shard;
    every T steps (and at the end) the parameters become the servers' mean."""
    torch.set_num_threads(1)
    nets = [C.model("mlp") for _ in range(WORLD)]
    opts = [C.optimizer(opt_name, n.parameters()) for n in nets]
    for s in range(steps):
        for r, (x, y) in enumerate(_shards(s)):
            for p, g in zip(nets[r].parameters(), _grads(nets[r], x, y)):
                p.grad = g
            opts[r].step()
        if (s + 1) % t == 0 or s == steps - 1:
            with torch.no_grad():
                for ps in zip(*(n.parameters() for n in nets)):
                    m = _mean([p.detach() for p in ps])
                    for p in ps:
                        p.copy_(m)
    return nets[0].state_dict()


@pytest.mark.parametrize("name,ref", [("acc3", ref_accumulate), ("avg4", ref_average)])
def test_comm_every_equals_a_reference_that_does_the_same_bitwise(runs, name, ref):
    cfg = RUNS[name]
    want = ref(cfg["comm"]["comm_every"], cfg["steps"], cfg["opt"])
    for rank, res in enumerate(runs):
        got = res[name]["state"]
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{name} rank {rank}: {k} differs (max {float((got[k] - v).abs().max()):.3g})"
        st = res[name]["stats"]
        t = cfg["comm"]["comm_every"]
        assert st["steps"] == cfg["steps"] and res[name]["flushed"] is True
        # The scheduled exchanges, and the flush of the last partial span.
        assert st["exchanges"] == cfg["steps"] // t + 1, st
        assert st["comm_every"] == t
    # A fixed T changes nothing between the ranks' stats.
    assert runs[0][name]["stats"]["pushes"] == runs[1][name]["stats"]["pushes"]


def test_average_mode_exchanges_an_unused_layer_by_its_value(runs):
    # Its gradient is zero every step, so each rank's optimizer moves it alike (weight
    # decay only), and the exchanges average equal values: it must come back as a
    # one-process optimizer with zero gradients leaves it (never as zeros).
    init = C.model("unused").state_dict()
    net = C.model("unused")
    o = C.optimizer("momentum", net.unused.parameters())
    for _ in range(RUNS["avg_unused"]["steps"]):
        for p in net.unused.parameters():
            p.grad = torch.zeros_like(p)
        o.step()
    want = {f"unused.{k}": v.detach() for k, v in net.unused.named_parameters()}
    assert want and all(float(v.abs().max()) > 0 for v in want.values())
    for rank, res in enumerate(runs):
        got = res["avg_unused"]["state"]
        for k, v in want.items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} differs (max {float((got[k] - v).abs().max()):.3g})"
        assert not torch.equal(got["fc1.weight"], init["fc1.weight"]), "the used layers train"
    for k, v in runs[0]["avg_unused"]["state"].items():
        assert torch.equal(v, runs[1]["avg_unused"]["state"][k]), k


def test_quality_guided_schedule_end_to_end(runs):
    """Period 2, tolerance 5%, T up to 8, back to 1 at step 40; rank 1 reports a worse
    loss whenever T > 2. Derived by hand from the schedule in engine/src/freq.rs."""
    want_history = [
        {"decision": "propose", "from": 1, "to": 2, "step": 1},
        {"decision": "accept", "t": 2, "next": 4, "step": 5},
        {"decision": "reject", "t": 4, "back_to": 2, "learner": 1, "step": 13},
        {"decision": "propose", "from": 2, "to": 3, "step": 17},
        {"decision": "reject", "t": 3, "back_to": 2, "learner": 1, "step": 23},
        {"decision": "revert", "to": 1, "step": 39},
    ]
    want_t = [1] * 2 + [2] * 4 + [4] * 8 + [2] * 4 + [3] * 6 + [2] * 16 + [1] * 10
    for rank, res in enumerate(runs):
        r = res["guided"]
        st = r["stats"]
        got = [{k: v for k, v in d.items() if k != "exchange"} for d in st["freq_history"]]
        assert got == want_history, f"rank {rank}: {got}"
        assert r["t_per_step"] == want_t, f"rank {rank}: {r['t_per_step']}"
        assert st["steps"] == 50 and st["exchanges"] == 28, st
        mem = st["freq_memory"]
        assert mem[4]["rejected"] and mem[3]["rejected"] and not mem[2]["rejected"], mem
        assert mem[4]["quality"] == pytest.approx(1.5) and mem[2]["quality"] == pytest.approx(1.0)
    # Both ranks stepped the same model at the same steps.
    for k, v in runs[0]["guided"]["state"].items():
        assert torch.equal(v, runs[1]["guided"]["state"][k]), k


@pytest.fixture
def job(clean_env):
    tw.init()
    yield
    tw.shutdown()


def test_comm_options_are_checked(job):
    net = C.model("mlp")

    def make(**kw):
        return tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters(), **kw)

    with pytest.raises(ValueError, match="comm_every=0"):
        make(comm_every=0)
    with pytest.raises(ValueError, match="comm_mode="):
        make(comm_every=2, comm_mode="gossip")
    with pytest.raises(ValueError, match="needs apply='local'"):
        make(comm_every=2, apply="server")
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        make(comm_every=2, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="comm_every_max"):
        make(comm_every=4, quality_guided=True, comm_every_max=2)
    with pytest.raises(ValueError, match="quality_tolerance"):
        make(quality_guided=True, quality_tolerance=-1.0)
    with pytest.raises(ValueError, match="quality_period"):
        make(quality_guided=True, quality_period=0)
    opt = make(quality_guided=True, comm_mode="average")
    x, y = C.data()
    F.cross_entropy(net(x[:8]), y[:8]).backward()
    with pytest.raises(tw.TidewireError, match="report_quality"):
        opt.step()  # T = 1: the first step exchanges, and no figure was reported
    opt.close()


def test_accumulate_holds_the_model_between_exchanges(job):
    """A job of one: the T-1 steps between exchanges leave the parameters alone
    and the gradients add up through zero_grad()."""
    net = C.model("mlp")
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                  named_parameters=net.named_parameters(), comm_every=3)
    x, y = C.data()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grads = []
    for s in range(2):
        opt.zero_grad()
        F.cross_entropy(net(x[s * 8 : (s + 1) * 8]), y[s * 8 : (s + 1) * 8]).backward()
        grads.append(net.fc1.weight.grad.clone())
        opt.step()
        for k, v in net.state_dict().items():
            assert torch.equal(v, before[k]), f"step {s} changed {k}"
    assert not torch.equal(grads[0], grads[1])  # the second backward added to the first
    opt.zero_grad()
    F.cross_entropy(net(x[16:24]), y[16:24]).backward()
    opt.step()
    assert not torch.equal(net.fc1.weight, before["fc1.weight"])
    st = opt.tidewire_stats()
    assert st["steps"] == 3 and st["exchanges"] == 1
    assert opt.flush() is False  # nothing left since the exchange
    opt.close()
