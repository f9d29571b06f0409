"""The extension module tidewire._native on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tidewire
from conftest import run_ranks


def test_error_class():
    assert issubclass(tidewire.TidewireError, RuntimeError)
    assert tidewire.TidewireError.__module__ == "tidewire"
    assert tidewire._native.TidewireError is tidewire.TidewireError


def test_push_pull_push_factors_poll_two_ranks(tmp_path):
    res = run_ranks(tmp_path, 2, {"scenario": "native"}, timeout=60).results()
    for r in res:
        assert torch.equal(r["init"], torch.ones(26)), "rank 0's initial values reach every rank"
        assert r["schemes"] == ["ps", "ps"] and r["len"] == 2
        assert r["names"] == ["a", "fc"] and r["sizes"] == [6, 20]
        assert r["transport"] in ("tcp", "portable", "rdma")
        assert torch.equal(r["after0"], torch.full((6,), 3.0)), "sum of 1s and 2s"
        assert r["in_flight"] is True and r["poll_unpushed"] is True
        # Sum over ranks of U_r^T V with U_r = arange(8).reshape(2, 4) * (r + 1), V = ones(2, 5).
        col = torch.tensor([4.0, 6.0, 8.0, 10.0]) * 3
        assert torch.equal(r["after1"].view(4, 5), col[:, None].expand(4, 5))
        e = r["errors"]
        assert "layer 7 does not exist" in e["unknown_layer"]
        assert "factors of 1 and 1 values" in e["bad_factors"], e["bad_factors"]
        assert "pushed and not pulled" in e["push_twice"], e["push_twice"]
        assert r["stats"]["pushes"] > 0 and "rx_direct_bytes" in r["stats"]
        assert r["closed"] is True
        assert "shut down" in r["after_shutdown"]


def test_server_only_rank_serves(tmp_path):
    res = run_ranks(tmp_path, 3, {"scenario": "native_servers"}, timeout=60).results()
    assert [r["role"] for r in res] == ["worker", "worker", "server"]
    assert "is a server only" in res[2]["push"]
    # Three SGD steps of lr 0.5 on the mean gradient (1 + 2) / 2 from 0.
    for r in res[:2]:
        assert torch.equal(r["params"], torch.full((8,), -2.25))


def _config(**settings):
    args = dict(layers=[("a", "other", 2, 3)], rank=0, world=1, master="127.0.0.1:1", secret="s")
    args.update(settings)
    return tidewire.SessionConfig(**args)


def _session(params=None, grads=None, **settings):
    params = torch.zeros(6) if params is None else params
    grads = torch.zeros(6) if grads is None else grads
    return tidewire.Session(_config(**settings), params=params, grads=grads)


def test_one_rank_session_over_numpy_arrays():
    p, g = np.full(6, 2.0, dtype=np.float32), np.zeros(6, dtype=np.float32)
    s = _session(params=p, grads=g, apply=("sgd", 0.5, 0.0, 0.0))
    g[:] = 1.0
    s.push(0)
    s.pull(0)
    assert np.array_equal(p, np.full(6, 1.5, dtype=np.float32))
    assert "open" in repr(s)
    s.shutdown()
    assert s.closed
    with pytest.raises(tidewire.TidewireError, match="shut down"):
        s.shutdown()


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"params": torch.zeros(6, dtype=torch.int32)}, ValueError, "float32, float16, bfloat16 or float64"),
        ({"params": torch.zeros(6, dtype=torch.float64)}, ValueError, "params are f64 but grads are f32"),
        ({"params": torch.zeros(12)[::2]}, ValueError, "contiguous"),
        ({"grads": torch.zeros(5)}, ValueError, "needs 24"),
        ({"params": [0.0] * 6}, TypeError, "torch.Tensor"),
        ({"apply": "median"}, ValueError, "apply"),
        ({"apply": ("adam", 1.0, 0.0, 0.0)}, ValueError, "sgd"),
        ({"consistency": ("ssp",)}, TypeError, "consistency"),
        ({"policy": "x"}, ValueError, "policy"),
        ({"transport": "carrier-pigeon"}, ValueError, "transport"),
        ({"secret": ""}, ValueError, "secret"),
        ({"master": "nowhere"}, ValueError, "master"),
        ({"rank": 3}, tidewire.TidewireError, "outside a world"),
        ({"timeout": -1.0}, ValueError, "timeout"),
        ({"trigger": "quorum:x"}, ValueError, "quorum:K"),
    ],
)
def test_bad_arguments_are_clear_errors(kw, err, match):
    with pytest.raises(err, match=match):
        _session(**kw)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"rank": "0"}, TypeError, "^SessionConfig.rank: "),
        ({"world": -1}, OverflowError, "^SessionConfig.world: "),
        ({"layers": [("a", "other", 2)]}, ValueError, "^SessionConfig.layers: expected tuple of length 4"),
        ({"layers": "a"}, TypeError, "^SessionConfig.layers: "),
        ({"rates": tidewire.Rates("fast", 0.0, 0.0, 0.0)}, TypeError, "^SessionConfig.rates.link_bytes_per_s: "),
        ({"local": (1, 0, "/x", 1, 0)}, AttributeError, "^SessionConfig.local.learners: "),
        ({"rates": tidewire.Rates(0.0, 0.0, 0.0, 0.0)}, ValueError, "^rates: "),
        ({"comm": tidewire.CommConfig("sometimes", 1, 1, 1, 0.0, None)}, ValueError, 'comm mode "sometimes"'),
    ],
)
def test_a_config_field_refused_is_named(kw, err, match):
    with pytest.raises(err, match=match):
        _session(**kw)


def test_config_is_frozen_and_keeps_its_secret():
    import dataclasses

    c = _config(secret="hush")
    assert "hush" not in repr(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 1  # type: ignore[misc]
    assert dataclasses.replace(c, rank=1).rank == 1 and c.rank == 0


def test_config_and_keywords_do_not_mix():
    with pytest.raises(TypeError, match=r"not as keywords \(.*'rank'"):
        tidewire.Session(_config(), params=torch.zeros(6), grads=torch.zeros(6), rank=0)


def test_the_keyword_form_of_earlier_versions_still_builds():
    # Session(layers, params=, grads=, **settings), records as plain tuples.
    p, g = torch.full((6,), 2.0), torch.zeros(6)
    s = tidewire.Session([("a", "other", 2, 3)], params=p, grads=g, rank=0, world=1, master="127.0.0.1:1",
                         secret="s", apply=("sgd", 0.5, 0.0, 0.0), rates=(1e9, 1e-6, 1e9, 1e10))
    g[:] = 1.0
    s.push(0)
    s.pull(0)
    assert torch.equal(p, torch.full((6,), 1.5))
    s.shutdown()
    with pytest.raises(AttributeError, match="^SessionConfig.layers: 'list' object has no attribute 'layers'"):
        tidewire.Session([("a", "other", 2, 3)], params=p, grads=g)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ranks'"):
        tidewire.Session([("a", "other", 2, 3)], params=p, grads=g, ranks=0, world=1, master="127.0.0.1:1",
                         secret="s")


def test_overlapping_buffers_are_refused():
    t = torch.zeros(12)
    with pytest.raises(ValueError, match="overlap"):
        _session(params=t[:6], grads=t[3:9])


def test_gil_is_released_while_waiting():
    # A second thread runs Python while the main thread blocks in the constructor's
    # rendezvous (rank 0 of 2, whose peer never comes): it must make progress.
    import threading
    import time

    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.time())
            time.sleep(0.01)

    t = threading.Thread(target=tick)
    t.start()
    try:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with pytest.raises(tidewire.TidewireError):
            _session(world=2, master=f"127.0.0.1:{port}", connect_timeout=1.0, timeout=1.0)
    finally:
        stop.set()
        t.join()
    assert len(ticks) > 20, f"only {len(ticks)} ticks while the constructor waited: the GIL was held"
