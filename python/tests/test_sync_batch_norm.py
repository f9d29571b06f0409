"""SyncBatchNorm on three ranks (batches of different sizes and
distributions) against torch's BatchNorm over the ranks' batches together:
outputs, input gradients, the parameters' gradients summed over the ranks,
running statistics (bitwise equal on every rank), evaluation."""

from __future__ import annotations

import pytest
import torch

import tidewire.torch as tw
from _elastic_scenarios import BN_CASES, bn_data, bn_module
from conftest import run_ranks


def equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def sync_bn(tmp_path_factory):
    w = 3
    r = run_ranks(tmp_path_factory.mktemp("syncbn"), w, {"scenario": "sync_bn"}, timeout=120)
    return w, r.results()


#: torch's BatchNorm for an input of each rank beyond the batch dimension: (C,) and (C, L) 1d, ...
BN_CLS = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm2d, 4: torch.nn.BatchNorm3d}


def _reference_bn(name: str, w: int):
    """torch's BatchNorm of the matching dimension over the ranks' batches
    concatenated, through the same steps as bn_case."""
    kw, shape = BN_CASES[name]
    m = bn_module(BN_CLS[len(shape)], shape[0], **kw)
    xs, gs = bn_data(w, shape)
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for s in range(2):
        x = (torch.cat(xs) * (1 + s)).requires_grad_(True)
        if m.affine:
            m.weight.grad = m.bias.grad = None
        y = m(x)
        (y * torch.cat(gs)).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        if m.affine:
            out["dw"].append(m.weight.grad.clone())
            out["db"].append(m.bias.grad.clone())
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        out[k] = getattr(m, k)
    m.eval()
    with torch.no_grad():
        out["eval"] = m(torch.cat(xs))
    return out, xs


@pytest.mark.parametrize("name", list(BN_CASES))
def test_sync_batch_norm_matches_one_batch_norm_over_every_rank(sync_bn, name):
    w, res = sync_bn
    ref, xs = _reference_bn(name, w)
    rows = [x.shape[0] for x in xs]
    starts = [sum(rows[:r]) for r in range(w)]
    close = dict(rtol=1e-4, atol=1e-5)
    for r, x in enumerate(res):
        mine = x[name]
        sl = slice(starts[r], starts[r] + rows[r])
        for s in range(2):
            torch.testing.assert_close(mine["y"][s], ref["y"][s][sl], **close)
            torch.testing.assert_close(mine["dx"][s], ref["dx"][s][sl], **close)
        torch.testing.assert_close(mine["eval"], ref["eval"][sl], **close)
        for k in ("running_mean", "running_var", "num_batches_tracked"):
            if ref[k] is None:
                assert mine[k] is None
            else:
                torch.testing.assert_close(mine[k], ref[k], **close)
                assert equal(mine[k], res[0][name][k]), f"rank {r}: {k} differs from rank 0's"
    # The weight's and bias's gradients: each rank's part, which sum to the whole batch's.
    for s in range(len(ref["dw"])):
        torch.testing.assert_close(sum(x[name]["dw"][s] for x in res), ref["dw"][s], **close)
        torch.testing.assert_close(sum(x[name]["db"][s] for x in res), ref["db"][s], **close)
    # Not vacuous: each rank's own BatchNorm (without the sync) is far from the reference.
    kw, shape = BN_CASES[name]
    alone = bn_module(BN_CLS[len(shape)], shape[0], **kw)
    assert not torch.allclose(alone(xs[1]), ref["y"][0][starts[1] : starts[1] + rows[1]], **close)


def test_sync_batch_norm_errors_and_one_rank(sync_bn, clean_env):
    w, res = sync_bn
    assert all("expected at least 2D input" in x["one_d_input"] for x in res)
    # A job of one, and before init: BatchNorm itself.
    m, ref = bn_module(tw.SyncBatchNorm, 4), bn_module(torch.nn.BatchNorm2d, 4)
    x = torch.randn(5, 4, 2, 2)
    assert equal(m(x), ref(x)) and equal(m.running_var, ref.running_var)
    tw.init()
    try:
        assert equal(m(x), ref(x)) and equal(m.running_mean, ref.running_mean)
    finally:
        tw.shutdown()
