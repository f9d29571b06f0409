"""DistributedOptimizer in one process (a job of one): the sufficient-factor
math against autograd, the optimizer's behaviour, and its errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _common as C
import tidewire
import tidewire.torch as tw


@pytest.fixture
def job(clean_env):
    tw.init()
    yield
    tw.shutdown()


def _batch(n=8):
    x, y = C.data()
    return x[:n], y[:n]


def test_sfb_reconstructed_gradient_equals_autograd(job):
    net = C.model("wide")
    ref = copy.deepcopy(net)
    x, y = _batch(8)
    F.cross_entropy(ref(x), y).backward()
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), model=net, batch_size=8, sfb="always")
    assert {L.name: L.scheme for L in opt._tw.layers} == {"fc1": "sfb", "fc2": "sfb", "fc3": "sfb"}
    # U = delta and V = [x, 1] from the hooks, against autograd's gradient of each layer.
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    # (the layers were pushed by the hooks; their factors went out and were checked against the dense gradient)
    opt.step()
    for n, p in net.named_parameters():
        recon = before[n] - p.detach()  # lr = 1, one rank: the reconstructed gradient
        torch.testing.assert_close(recon, dict(ref.named_parameters())[n].grad, rtol=1e-4, atol=1e-6)


def test_sfb_factors_with_padding_bias_and_repeated_calls(job):
    # A layer called twice per forward, on a batch smaller than K: U^T V over both calls.
    lin = nn.Linear(5, 3)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x) + self.lin(2 * x).relu()

    m = Twice()
    ref = copy.deepcopy(m)  # before wrapping: a copy would carry the hooks along
    opt = tw.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), model=m, batch_size=8, sfb="always")
    L = opt._tw.layers[0]
    assert (L.kind, L.m, L.n, L.sfb_layout) == ("fc", 3, 6, True)
    x = torch.randn(3, 5)
    out = m(x)
    ref(x).pow(2).sum().backward()
    assert len(L.calls) == 2
    out.pow(2).sum().backward()  # the hooks push the layer, its factors checked against autograd
    assert L.checked and L.in_flight
    opt.synchronize()
    got = opt._tw.r_host.view(3, 6)
    want = torch.cat([ref.lin.weight.grad, ref.lin.bias.grad[:, None]], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with opt.skip_synchronize():
        opt.step()


def test_sfb_too_many_rows_is_a_clear_error(job):
    net = C.model("wide")
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, batch_size=4, sfb="always")
    x, y = _batch(8)
    opt.zero_grad()
    with pytest.raises(tidewire.TidewireError, match="more than K=4"):
        F.cross_entropy(net(x), y).backward()


def test_wrapped_optimizer_behaves_like_the_original(job):
    net = C.model("mlp")
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt = tw.DistributedOptimizer(base, named_parameters=net.named_parameters(), model=net)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is base.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    C.train(net, opt, 2, 16, zero=None)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sd = opt.state_dict()
    assert len(sd["state"]) == 6 and "momentum_buffer" in sd["state"][0]
    opt.load_state_dict(sd)
    for p in net.parameters():
        assert p.grad is not None
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters()), "zero_grad() sets None, as torch's"
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0 for p in net.parameters()), \
        "zero_grad(set_to_none=False) zeroes in place"
    s = opt.tidewire_stats()
    assert s["pushes"] > 0 and s["grad_rebinds"] == 0 and set(s["schemes"]) == {"fc1", "fc2", "fc3"}
    # The flat buffers: each p.grad is a view into the registered gradient buffer.
    g = opt._tw.g_host
    for p in net.parameters():
        assert g.data_ptr() <= p.grad.data_ptr() < g.data_ptr() + g.nbytes


def test_synchronize_clip_then_step(job):
    net = C.model("mlp")
    ref = copy.deepcopy(net)
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _batch(16)
    for m, o in ((net, opt), (ref, ropt)):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    with opt.skip_synchronize():
        opt.step()
    nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ropt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_construction_errors(job):
    net = C.model("mlp")

    def make(opt=None, **kw):
        o = opt or torch.optim.SGD(net.parameters(), lr=0.1)
        return tw.DistributedOptimizer(o, named_parameters=net.named_parameters(), **kw)

    with pytest.raises(ValueError, match="SGD only"):
        make(torch.optim.Adam(net.parameters()), apply="server")
    with pytest.raises(ValueError, match="Nesterov"):
        make(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True), apply="server")
    with pytest.raises(ValueError, match="dampening"):
        make(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.1), apply="server")
    with pytest.raises(ValueError, match="one param group"):
        make(torch.optim.SGD([{"params": net.fc1.parameters()}, {"params": net.fc2.parameters()}], lr=0.1),
             apply="server")
    with pytest.raises(ValueError, match="needs apply='server'"):
        make(consistency=("ssp", 2))
    with pytest.raises(ValueError, match="prefetch=True needs model"):
        make(prefetch=True)
    with pytest.raises(ValueError, match="needs model= and batch_size="):
        make(sfb=True)
    with pytest.raises(ValueError, match="apply="):
        make(apply="cloud")
    with pytest.raises(ValueError, match="misses 2 parameter"):
        tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                named_parameters=list(net.named_parameters())[2:])
    with pytest.raises(TypeError, match="float32, float16, bfloat16 and float64"):
        d = nn.Linear(2, 2).to(torch.complex64)
        tw.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), named_parameters=d.named_parameters())
    with pytest.raises(TypeError, match="several dtypes"):
        d = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
        tw.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), named_parameters=d.named_parameters())
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        tw.DistributedOptimizer(object())


def test_runtime_errors(job):
    net = C.model("mlp")
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                  apply="server")
    x, y = _batch(8)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(tidewire.TidewireError, match="backward_passes_per_step=1"):
        F.cross_entropy(net(x), y).backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.2
    with pytest.raises(tidewire.TidewireError, match="changed from"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    with pytest.raises(tidewire.TidewireError, match="add every group before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_server_mode_parameters_live_in_the_registered_buffer(job):
    net = C.model("mlp")
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model=net, apply="server")
    r = opt._tw.r_host
    for p in net.parameters():
        assert r.data_ptr() <= p.data_ptr() < r.data_ptr() + r.nbytes
    C.train(net, opt, 2, 16)
    assert opt.state_dict()["state"] == {}, "the momentum lives on the servers"


def test_cuda_training(job):
    if not torch.cuda.is_available():
        reason = "no CUDA device (torch.cuda.is_available() is False): the CUDA staging path was not run on a GPU"
        print(f"\nSKIPPED test_cuda_training: {reason}")
        pytest.skip(reason)
    dev = torch.device("cuda", tw.local_rank() % torch.cuda.device_count())
    net = C.model("bn").to(dev)
    ref = copy.deepcopy(net)
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model=net,
                                  batch_size=16, sfb="always")
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(16)
    x, y = x.to(dev), y.to(dev)
    for _ in range(3):
        for m, o in ((net, opt), (ref, ropt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_cuda_server_prefetch(job):
    if not torch.cuda.is_available():
        reason = "no CUDA device (torch.cuda.is_available() is False): server mode with CUDA parameters not run"
        print(f"\nSKIPPED test_cuda_server_prefetch: {reason}")
        pytest.skip(reason)
    dev = torch.device("cuda", 0)
    net = C.model("mlp").to(dev)
    ref = copy.deepcopy(net)
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, apply="server",
                                  prefetch=True)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _batch(16)
    x, y = x.to(dev), y.to(dev)
    for _ in range(3):
        for m, o in ((net, opt), (ref, ropt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    opt.synchronize()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_adaptive_refuses_what_a_switch_cannot_carry(job, monkeypatch):
    net = C.model("wide")
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="consistency='bsp'"):
        tw.DistributedOptimizer(copy.deepcopy(sgd), model=net, batch_size=8, sfb="adaptive",
                                apply="server", consistency=("ssp", 1))
    monkeypatch.setenv("TIDEWIRE_ADAPT_EVERY", "1")
    with pytest.raises(ValueError, match="at least 2 steps"):
        tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, batch_size=8, sfb="adaptive")


def test_adaptive_pushes_every_linear_layer_by_its_factors(job):
    net = C.model("wide")
    opt = tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, batch_size=8,
                                  sfb="adaptive")
    x, y = _batch(8)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    fc = [L for L in opt._tw.layers if L.kind == "fc"]
    assert fc and all(L.factors for L in fc), [(L.name, L.kind, L.factors) for L in opt._tw.layers]
