"""tidewire.torch's collectives (push_pull, the broadcasts) and init()."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import tidewire
import tidewire.torch as tw
from conftest import HERE, base_env, free_port, run_ranks


def test_collectives_three_ranks(tmp_path):
    w = 3
    res = run_ranks(tmp_path, w, {"scenario": "collectives"}, timeout=90).results()
    for r, x in enumerate(res):
        assert torch.equal(x["sum"], torch.arange(6, dtype=torch.float32) * 6)
        assert torch.equal(x["mean"], torch.full((3, 2), 1.0))
        assert x["big_ok"]
        assert torch.equal(x["bcast_i64"], torch.tensor([2**40 + 2, -5]))
        assert x["bcast_f64"].dtype == torch.float64 and float(x["bcast_f64"]) == 1 / 3
        assert torch.equal(x["bcast_bool"], torch.tensor([True, True, False]))
        assert x["object"]["rank"] == 1 and torch.equal(x["object"]["t"], torch.ones(2))
        for k, v in x["params"].items():
            assert torch.equal(v, res[0]["params"][k]), k
        st = x["opt_state"]["state"]
        assert len(st) == len(res[0]["opt_state"]["state"]) > 0
        for i in st:
            for k, v in st[i].items():
                assert torch.equal(v, res[0]["opt_state"]["state"][i][k])


def test_mismatches_raise_on_every_rank_without_hang(tmp_path):
    r = run_ranks(tmp_path, 2, {"scenario": "mismatch"}, timeout=60)
    assert r.seconds < 40, f"took {r.seconds:.1f} s"
    for x in r.results():
        assert "ranks disagree" in x["size"] and "10 elements" in x["size"] and "11 elements" in x["size"]
        assert "ranks disagree" in x["name"] and "name hash" in x["name"]
        assert torch.equal(x["after"], torch.full((2,), 2.0))
        assert "ranks [1] would build a different DistributedOptimizer" in x["table"], x["table"]


def test_a_collective_one_rank_skips_fails_at_once(tmp_path):
    # Rank 1 shuts down without the collective: the servers know it can never
    # complete, so rank 0 fails at once (no need to wait for the timeout).
    r = run_ranks(tmp_path, 2, {"scenario": "straggler"}, env={"TIDEWIRE_TIMEOUT": "30"}, timeout=60)
    x = r.result(0)
    # Iteration 0 of the utility session is init()'s own (the ranks' topology).
    assert x["error"] and "worker rank 1 finished without pushing iteration 1" in x["error"], x["error"]
    assert x["seconds"] < 10
    assert "finished without pushing" in r.result(1)["shutdown"], r.result(1)


def test_a_collective_one_rank_stalls_in_times_out(tmp_path):
    # Rank 1 is alive but silent: rank 0's wait times out, and its shutdown
    # aborts the job instead of waiting for the collective; rank 1 hears why.
    r = run_ranks(tmp_path, 2, {"scenario": "straggler", "stall": 6}, env={"TIDEWIRE_TIMEOUT": "3"}, timeout=60)
    x = r.result(0)
    assert x["error"] and "timed out after 3s" in x["error"], x["error"]
    assert x["seconds"] < 10
    assert "abort" in r.result(1)["shutdown"], r.result(1)


def test_a_rank_that_dies_fails_the_others(tmp_path):
    r = run_ranks(tmp_path, 2, {"scenario": "straggler", "die": True}, env={"TIDEWIRE_TIMEOUT": "5"},
                  timeout=60)
    x = r.result(0)
    assert x["error"], "rank 0 did not notice that rank 1 died"
    assert x["seconds"] < 15, x


def test_missing_secret_is_a_clear_error(tmp_path):
    r = run_ranks(tmp_path, 2, {"scenario": "nosecret"}, env={"TIDEWIRE_SECRET": None}, timeout=30)
    for x in r.results():
        assert "TIDEWIRE_SECRET is not set" in x["error"] and "same string on every rank" in x["error"]


def test_torchrun_with_gloo_side_by_side(tmp_path):
    """The real launcher: torchrun --standalone (its agent listens on MASTER_PORT,
    TORCHELASTIC_USE_AGENT_STORE=True), gloo's process group and Tidewire in one
    process each."""
    out = tmp_path / "out"
    out.mkdir()
    env = base_env()
    env.update(TIDEWIRE_SECRET="torchrun-secret", TW_TEST='{"scenario": "gloo"}')
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.2", str(HERE / "_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"\n[torchrun job: {time.time() - t0:.1f} s]")
    for r in (0, 1):
        x = torch.load(out / f"rank{r}.pt", weights_only=False)
        assert x["source"] == "torchrun" and x["local_rank"] == r
        assert torch.equal(x["gloo"], x["tidewire"])
        assert torch.equal(x["tidewire"], torch.arange(5, dtype=torch.float32) * 3)
        assert x["same_params"]


def test_single_process_job(clean_env):
    tw.init()
    try:
        assert (tw.rank(), tw.size(), tw.local_rank()) == (0, 1, 0)
        t = torch.arange(4.0)
        assert torch.equal(tw.push_pull(t), t)
        assert torch.equal(tw.broadcast(torch.tensor([7], dtype=torch.int32)), torch.tensor([7], dtype=torch.int32))
        with pytest.raises(TypeError):
            tw.push_pull([1.0, 2.0])
        with pytest.raises(tidewire.TidewireError, match="root_rank 1"):
            tw.broadcast(t, root_rank=1)
    finally:
        tw.shutdown()
    assert not tw.is_initialized()
    with pytest.raises(tidewire.TidewireError, match="init"):
        tw.rank()


def test_environment_parsing(clean_env, monkeypatch):
    from tidewire.torch import _read_env

    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    e = _read_env("s", None, None)
    assert (e.rank, e.size, e.local_rank, e.source) == (3, 4, 1, "slurm")
    assert e.master(0) == "10.0.0.1:30500" and e.master(2) == "10.0.0.1:30502"
    monkeypatch.setenv("TIDEWIRE_PORT_OFFSET", "7")
    assert _read_env("s", None, None).master(1) == "10.0.0.1:29508"
    monkeypatch.setenv("TIDEWIRE_MASTER", "10.0.0.1:29500")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(tidewire.TidewireError, match="torchrun's agent listens there"):
        _read_env("s", None, None)
    monkeypatch.setenv("TIDEWIRE_MASTER", "[::1]:4000")
    assert _read_env("s", None, None).master(3) == "[::1]:4003"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _read_env("s", None, None).source == "torchrun"  # torchrun's win over Slurm's
    monkeypatch.setenv("TIDEWIRE_RANK", "0")
    with pytest.raises(tidewire.TidewireError, match="TIDEWIRE_WORLD_SIZE"):
        _read_env("s", None, None)
    monkeypatch.setenv("TIDEWIRE_WORLD_SIZE", "x")
    with pytest.raises(tidewire.TidewireError, match="not a number"):
        _read_env("s", None, None)
    monkeypatch.setenv("TIDEWIRE_WORLD_SIZE", "2")
    monkeypatch.delenv("TIDEWIRE_MASTER")
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(tidewire.TidewireError, match="TIDEWIRE_MASTER=host:port"):
        _read_env("s", None, None)
    with pytest.raises(tidewire.TidewireError, match="TIDEWIRE_SECRET"):
        _read_env(None, "127.0.0.1:5000", None)
