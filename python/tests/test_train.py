"""Multi-process training through tidewire.torch.DistributedOptimizer:
real processes on loopback, compared rank against rank and against plain
single-process PyTorch on the global batch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import _common as C
from conftest import run_ranks

STEPS, BATCH = 6, 16

MODES = {
    "local": {"opt": "momentum"},
    "server": {"opt": "momentum", "apply": "server"},
    "prefetch": {"opt": "momentum", "apply": "server", "prefetch": True},
    "staged": {"opt": "momentum", "env": {"TIDEWIRE_TORCH_STAGING": "1"}},
    "passes": {"opt": "momentum", "passes": 2},
    "model_zero_grad": {"opt": "momentum", "model_zero_grad": True},
    "zero_in_place": {"opt": "momentum", "zero_in_place": True},
    "sfb": {"model": "wide", "opt": "momentum", "sfb": "always"},
    "ps": {"model": "wide", "opt": "momentum", "sfb": False},
    # HybComm in seconds at a GPU's rates (free GEMM and sums, no message cost):
    # the same choice as Poseidon's bytes. Then at a slow CPU GEMM: every layer
    # by the PS, since rebuilding the peers' gradients costs more than moving them.
    "hybrid": {"model": "wide", "opt": "momentum", "sfb": "auto", "env": {"TIDEWIRE_RATES": json.dumps(
        {"link_bytes_per_s": 1e9, "msg_s": 0.0, "sum_bytes_per_s": 1e15, "gemm_flop_per_s": 1e15})}},
    "hybrid_cpu": {"model": "wide", "opt": "momentum", "sfb": "auto", "env": {"TIDEWIRE_RATES": json.dumps(
        {"link_bytes_per_s": 1e9, "msg_s": 1e-5, "sum_bytes_per_s": 1e9, "gemm_flop_per_s": 1e6})}},
    # Decided in the run every 2 steps (rank 0 measures the start-up choice,
    # then an alternative); every linear layer goes as its factors.
    "adaptive": {"model": "wide", "opt": "momentum", "sfb": "adaptive", "env": {"TIDEWIRE_ADAPT_EVERY": "2"}},
    # The same with the servers applying SGD with momentum: a switch moves the momentum too.
    "adaptive_server": {"model": "wide", "opt": "momentum", "sfb": "adaptive", "apply": "server",
                        "env": {"TIDEWIRE_ADAPT_EVERY": "2"}},
    "ssp": {"opt": "momentum", "apply": "server", "consistency": ["ssp", 1]},
    "f64": {"opt": "momentum", "dtype": "float64"},
    "bf16": {"opt": "momentum", "dtype": "bfloat16"},
}
QUIRKS = {q: {"model": q, "opt": "momentum"} for q in ("unused", "frozen", "tied", "bn")}


def _with_defaults(runs):
    return {k: dict({"steps": STEPS, "batch": BATCH}, **v) for k, v in runs.items()}


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    r = run_ranks(tmp_path_factory.mktemp("modes"), 2, {"scenario": "multi", "runs": _with_defaults(MODES)},
                  timeout=180)
    print(f"\n[modes: {len(MODES)} trainings on 2 ranks in {r.seconds:.1f} s]")
    return r.results()


@pytest.fixture(scope="module")
def quirks(tmp_path_factory):
    r = run_ranks(tmp_path_factory.mktemp("quirks"), 2, {"scenario": "multi", "runs": _with_defaults(QUIRKS)},
                  timeout=120)
    print(f"\n[quirks: {len(QUIRKS)} trainings on 2 ranks in {r.seconds:.1f} s]")
    return r.results()


def reference(model: str, opt: str, steps: int = STEPS, batch: int = BATCH, dtype=torch.float32):
    """Plain PyTorch, one process, the global batch."""
    torch.set_num_threads(1)
    net = C.model(model).to(dtype)
    o = C.optimizer(opt, net.parameters())
    losses = C.train(net, o, steps, batch)
    return net.state_dict(), losses


def assert_bitwise_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_close(a, b, what, rtol=1e-4, atol=1e-5):
    assert a.keys() == b.keys(), what
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), f"{what}: {k}"


def test_every_rank_ends_bitwise_identical(modes):
    for name in MODES:
        if name == "ssp":
            continue  # SSP pulls may be stale on one rank and fresh on the other
        assert_bitwise_equal(modes[0][name]["state"], modes[1][name]["state"], f"{name}: rank 0 vs rank 1")


def test_local_mode_matches_single_process_on_the_global_batch(modes):
    ref, ref_losses = reference("mlp", "momentum")
    assert_close(modes[0]["local"]["state"], ref, "local mode vs one process")
    # The parameters moved: training happened.
    init = C.model("mlp").state_dict()
    assert not torch.equal(init["fc1.weight"], ref["fc1.weight"])
    got = [(a + b) / 2 for a, b in zip(modes[0]["local"]["losses"], modes[1]["local"]["losses"])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)


def test_float64_and_bfloat16_models_are_staged_through_float32(modes):
    # float64 parameters: widened at push, summed in float32, narrowed at pull; so
    # the run matches one float64 process to float32's precision, not float64's.
    ref, _ = reference("mlp", "momentum", dtype=torch.float64)
    got = modes[0]["f64"]["state"]
    assert all(v.dtype == torch.float64 for v in got.values() if v.is_floating_point())
    assert_close(got, ref, "float64 model vs one float64 process", rtol=1e-5, atol=1e-6)
    # bfloat16 parameters stay bfloat16, and training moves them the way float32 does.
    bf = modes[0]["bf16"]["state"]
    assert all(v.dtype == torch.bfloat16 for v in bf.values() if v.is_floating_point())
    f32 = modes[0]["local"]["state"]
    assert_close({k: v.float() for k, v in bf.items()}, f32, "bfloat16 vs float32 model", rtol=5e-2, atol=2e-2)
    assert modes[0]["bf16"]["losses"][-1] < modes[0]["bf16"]["losses"][0], "bfloat16 training lowers the loss"


def test_server_mode_sgd_momentum_matches_local_mode(modes):
    assert_close(modes[0]["server"]["state"], modes[0]["local"]["state"], "server vs local (SGD + momentum)")


def test_prefetch_p3_matches_server_mode(modes):
    assert_bitwise_equal(modes[0]["prefetch"]["state"], modes[0]["server"]["state"], "prefetch vs server")


def test_staged_path_matches_direct(modes):
    # The CUDA path's staging (device flat buffers, host copies before push and
    # after pull), run with CPU "device" tensors.
    assert_bitwise_equal(modes[0]["staged"]["state"], modes[0]["local"]["state"], "staged vs direct")


def test_backward_passes_per_step(modes):
    # Two half-batches per step: the same gradient as one full batch, up to rounding.
    assert_close(modes[0]["passes"]["state"], modes[0]["local"]["state"], "2 passes vs 1")


def test_model_zero_grad_set_to_none_is_rebound(modes):
    r = modes[0]["model_zero_grad"]
    assert r["stats"]["grad_rebinds"] > 0, r["stats"]
    assert modes[0]["local"]["stats"]["grad_rebinds"] == 0
    assert_bitwise_equal(r["state"], modes[0]["local"]["state"], "model.zero_grad(set_to_none=True) vs zero_grad()")


def test_zero_grad_sets_none_and_matches_zeroing_in_place(modes):
    # zero_grad() (set_to_none, torch's default) leaves .grad None for every layer
    # pushed from the buffer; backward's first gradient is then copied in, which
    # must give the same bits as zeroing in place and adding into the zeros.
    for r in (0, 1):
        after = modes[r]["local"]["grads_after_zero"]
        assert after and all(after.values()), after
        assert modes[r]["local"]["stats"]["grad_rebinds"] == 0
        assert modes[r]["zero_in_place"]["stats"]["grad_rebinds"] == 0
        # After step() every .grad is the buffer's view again (never None, as with DDP).
        assert modes[r]["local"]["grads_none"] == [], modes[r]["local"]["grads_none"]
    # Layers pushed as their factors are zeroed in place: their .grad stays.
    sfb = modes[0]["sfb"]["grads_after_zero"]
    assert sfb and not any(sfb.values()), sfb
    assert_bitwise_equal(modes[0]["zero_in_place"]["state"], modes[0]["local"]["state"],
                         "zero_grad(set_to_none=False) vs zero_grad()")


def test_sfb_two_ranks_matches_ps_only(modes):
    assert set(modes[0]["sfb"]["stats"]["schemes"].values()) == {"sfb"}
    assert modes[0]["sfb"]["stats"]["factor_sends"] > 0
    assert set(modes[0]["ps"]["stats"]["schemes"].values()) == {"ps"}
    assert_close(modes[0]["sfb"]["state"], modes[0]["ps"]["state"], "SFB vs PS only", rtol=1e-4, atol=1e-5)
    ref, _ = reference("wide", "momentum")
    assert_close(modes[0]["ps"]["state"], ref, "PS only vs one process")


def test_hybcomm_chooses_per_layer(modes):
    # 2 colocated nodes, K = 8, at a GPU's rates: seconds order the schemes as
    # Poseidon's bytes do. SFB moves 2K(M+N), the PS 2MN.
    schemes = modes[0]["hybrid"]["stats"]["schemes"]
    assert schemes == {"fc1": "sfb", "fc2": "sfb", "fc3": "ps"}, schemes
    assert_close(modes[0]["hybrid"]["state"], modes[0]["ps"]["state"], "HybComm vs PS only")
    # At a slow CPU's GEMM, HybComm steps aside: every layer through the PS.
    cpu = modes[0]["hybrid_cpu"]["stats"]["schemes"]
    assert cpu == {"fc1": "ps", "fc2": "ps", "fc3": "ps"}, cpu
    assert modes[1]["hybrid_cpu"]["stats"]["schemes"] == cpu
    # The rates it decided with are reported: the ones TIDEWIRE_RATES gave.
    assert modes[1]["hybrid_cpu"]["stats"]["rates"]["gemm_flop_per_s"] == 1e6
    assert "rates" not in modes[0]["ps"]["stats"]
    assert_close(modes[0]["hybrid_cpu"]["state"], modes[0]["ps"]["state"], "HybComm (CPU rates) vs PS only")


def test_adaptive_decides_in_the_run_and_matches_ps_only(modes):
    # Points 2, 4 and 6 in 6 steps: rank 0 takes each; rank 1 may have left before the last.
    assert modes[0]["adaptive"]["stats"]["decisions"] == 3, modes[0]["adaptive"]["stats"]
    assert modes[1]["adaptive"]["stats"]["decisions"] >= 2, modes[1]["adaptive"]["stats"]
    assert_bitwise_equal(modes[0]["adaptive"]["state"], modes[1]["adaptive"]["state"], "adaptive, rank 0 vs 1")
    assert_close(modes[0]["adaptive"]["state"], modes[0]["ps"]["state"], "adaptive vs PS only")
    # The servers' SGD with momentum, decided in the run: the momentum moves with each switch.
    s = modes[0]["adaptive_server"]
    assert s["stats"]["decisions"] == 3, s["stats"]
    assert_bitwise_equal(s["state"], modes[1]["adaptive_server"]["state"], "adaptive_server, rank 0 vs 1")
    assert_close(s["state"], modes[0]["ps"]["state"], "adaptive_server vs PS only")


def test_ssp_server_mode_trains(modes):
    for r in (0, 1):
        s = modes[r]["ssp"]
        assert len(s["losses"]) == STEPS
        assert all(torch.isfinite(v).all() for v in s["state"].values())
    ref, _ = reference("mlp", "momentum")
    assert_close(modes[0]["ssp"]["state"], ref, "SSP(1) vs one process", rtol=0.2, atol=0.05)


def test_quirk_unused_parameter(quirks):
    for r in (0, 1):
        assert len(quirks[r]["unused"]["losses"]) == STEPS
    assert_bitwise_equal(quirks[0]["unused"]["state"], quirks[1]["unused"]["state"], "unused")
    init = C.model("unused").state_dict()
    # Its gradient is zero every step (never None, as with DDP): momentum and weight
    # decay still apply to it.
    net = C.model("unused")
    o = C.optimizer("momentum", net.parameters())

    def zero():
        o.zero_grad(set_to_none=False)
        for p in net.unused.parameters():
            p.grad = torch.zeros_like(p)

    C.train(net, o, STEPS, BATCH, zero=zero)
    assert_close(quirks[0]["unused"]["state"], net.state_dict(), "unused vs one process")
    assert not torch.equal(init["fc1.weight"], quirks[0]["unused"]["state"]["fc1.weight"])


def test_quirk_frozen_parameter(quirks):
    s0, s1 = quirks[0]["frozen"]["state"], quirks[1]["frozen"]["state"]
    assert_bitwise_equal(s0, s1, "frozen")
    init = C.model("frozen").state_dict()
    assert torch.equal(s0["fc1.weight"], init["fc1.weight"]), "a frozen parameter moved"
    assert "fc1" not in quirks[0]["frozen"]["stats"]["schemes"]
    ref, _ = reference("frozen", "momentum")
    assert_close(s0, ref, "frozen vs one process")


def test_quirk_tied_weights(quirks):
    s0 = quirks[0]["tied"]["state"]
    assert_bitwise_equal(s0, quirks[1]["tied"]["state"], "tied")
    assert torch.equal(s0["a.weight"], s0["b.weight"])
    schemes = quirks[0]["tied"]["stats"]["schemes"]
    assert "a" in schemes and "b" in schemes  # b's bias is its own layer; the tied weight counts once, in a
    ref, _ = reference("tied", "momentum")
    assert_close(s0, ref, "tied vs one process")


def test_quirk_batchnorm_buffers_stay_in_sync(quirks):
    s0, s1 = quirks[0]["bn"]["state"], quirks[1]["bn"]["state"]
    assert_bitwise_equal(s0, s1, "bn")
    assert int(s0["bn.num_batches_tracked"]) == STEPS
    assert not torch.equal(s0["bn.running_mean"], torch.zeros_like(s0["bn.running_mean"]))


def test_three_ranks_adam(tmp_path):
    runs = {"adam": {"opt": "adam", "steps": 5, "batch": 24}}
    r = run_ranks(tmp_path, 3, {"scenario": "multi", "runs": runs}, timeout=120)
    res = r.results()
    for k in (1, 2):
        assert_bitwise_equal(res[0]["adam"]["state"], res[k]["adam"]["state"], f"rank 0 vs rank {k}")
    ref, _ = reference("mlp", "adam", steps=5, batch=24)
    assert_close(res[0]["adam"]["state"], ref, "3 ranks (Adam) vs one process")


def test_sparse_embedding_gradients_use_the_sparse_push(tmp_path):
    """nn.Embedding(sparse=True): its layer carries the sparse hint, its sparse
    gradients are added into the flat buffer, ranks end bitwise equal, and the
    result matches the same model with a dense embedding."""
    runs = _with_defaults({
        "dense": {"model": "emb", "opt": "momentum"},
        "sparse": {"model": "emb_sparse", "opt": "momentum"},
        "sparse_zero": {"model": "emb_sparse", "opt": "momentum", "model_zero_grad": True},
    })
    res = run_ranks(tmp_path, 2, {"scenario": "multi", "runs": runs}, timeout=120).results()
    for name in runs:
        assert_bitwise_equal(res[0][name]["state"], res[1][name]["state"], f"{name}: rank 0 vs rank 1")
    ref, _ = reference("emb", "momentum")
    for name in ("sparse", "sparse_zero"):
        assert_close(res[0][name]["state"], res[0]["dense"]["state"], f"{name} vs dense")
        assert_close(res[0][name]["state"], ref, f"{name} vs one process")
        pushed = sum(r[name]["stats"]["sparse_pushes"] for r in res)
        assert pushed > 0, f"{name}: no slice went as pairs ({[r[name]['stats'] for r in res]})"
        nz = sum(r[name]["stats"]["sparse_nonzeros"] for r in res)
        el = sum(r[name]["stats"]["sparse_elements"] for r in res)
        assert 0 < nz < el, f"{name}: {nz} nonzeros of {el}"
    assert sum(r["dense"]["stats"]["sparse_pushes"] for r in res) == 0
