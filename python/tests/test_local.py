"""Nexus's local aggregation from PyTorch (``TIDEWIRE_LOCAL_AGGREGATION=1``
under torchrun's variables): two nodes of two learner processes, where each
node's local rank 0 sums its learners' gradients and pushes once, against
the same four processes without it."""

from __future__ import annotations

import pytest
import torch

from conftest import run_ranks
from test_train import assert_bitwise_equal, assert_close, reference

RUNS = {
    "local": {"opt": "momentum", "steps": 6, "batch": 16},
    "server": {"opt": "momentum", "apply": "server", "steps": 6, "batch": 16},
    "bf16": {"opt": "momentum", "dtype": "bfloat16", "steps": 4, "batch": 16},
}


def _job(tmp_path, local: bool):
    def per_rank(r):
        e = {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
        if local:
            e["TIDEWIRE_LOCAL_AGGREGATION"] = "1"
        return e

    r = run_ranks(tmp_path, 4, {"scenario": "multi", "runs": RUNS}, launcher="torchrun", per_rank_env=per_rank,
                  timeout=150)
    return r.results()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("local"), True), _job(tmp_path_factory.mktemp("flat"), False)


def test_every_learner_ends_bitwise_identical(jobs):
    local, _ = jobs
    for name in RUNS:
        for r in range(1, 4):
            assert_bitwise_equal(local[0][name]["state"], local[r][name]["state"], f"{name}: rank 0 vs rank {r}")


def test_local_aggregation_trains_like_the_flat_job_and_one_process(jobs):
    local, flat = jobs
    for name in ("local", "server"):
        # The sums differ in order only (node sums first): equal to rounding.
        assert_close(local[0][name]["state"], flat[0][name]["state"], f"{name}: local aggregation vs flat")
    ref, _ = reference("mlp", "momentum")
    assert_close(local[0]["local"]["state"], ref, "local aggregation vs one process on the global batch")


def test_each_node_sends_about_half(jobs):
    """Node 1 (ranks 2 and 3; rank 0 seeds the servers, so node 0 sends more
    at set-up): with local aggregation only rank 2 talks to the network."""
    local, flat = jobs
    for name in ("local", "server"):
        tx_local = local[2][name]["stats"]["tx_payload_bytes"]
        assert local[3][name]["stats"]["tx_payload_bytes"] == 0, "a learner puts nothing on the network"
        tx_flat = flat[2][name]["stats"]["tx_payload_bytes"] + flat[3][name]["stats"]["tx_payload_bytes"]
        ratio = tx_flat / tx_local
        print(f"{name}: node 1 sent {tx_flat} bytes flat, {tx_local} with local aggregation: {ratio:.2f}x")
        # Colocated ranks: pushes fall by more than L (fewer remote shards), broadcasts by L.
        assert ratio >= 1.9, ratio


def test_bad_layouts_are_clear_errors(tmp_path):
    import tidewire.torch as tw

    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "TIDEWIRE_SECRET": "x"}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    try:
        with pytest.raises(tw.TidewireError, match="consecutive ranks"):
            tw._read_env(None, None, None, True)
        mp.setenv("LOCAL_RANK", "1")
        e = tw._read_env(None, None, None, True)
        assert (e.local_agg, e.local_size, tw._place(e, 0)["rank"], tw._place(e, 0)["world"]) == (True, 2, 0, 2)
        assert tw._read_env(None, None, None, False).local_agg is False
    finally:
        mp.undo()
