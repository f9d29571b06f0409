"""The job secret: shared through torch's store under torchrun (nothing to
configure), TIDEWIRE_SECRET when set, a clear error where neither exists, and
rank 0 naming the joiners it refused."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tidewire
from conftest import free_port, run_ranks, run_torchrun
from tidewire.torch import _read_env
from tidewire.torch._env import SECRET_KEY

SUM = torch.arange(6, dtype=torch.float32) * 3  # ranks 0 and 1 push arange(6) * (rank + 1)


def _results(out, world=2):
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_torchrun_without_tidewire_secret_shares_one_through_its_store(tmp_path):
    """Nothing to configure: torchrun --standalone with TIDEWIRE_SECRET unset.
    Rank 0 puts a fresh secret in the agent's store, rank 1 reads it, and the
    push_pull that needs both to authenticate adds up."""
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.time()
    p = run_torchrun(out, {"scenario": "secret"}, env={"TIDEWIRE_SECRET": None})
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"\n[torchrun job: {time.time() - t0:.1f} s]")
    res = _results(out)
    for r, x in enumerate(res):
        assert (x["rank"], x["size"], x["launcher"]) == (r, 2, "torchrun")
        assert x["env_secret"] is None
        assert x["source"].startswith("torchrun's store at "), x["source"]
        assert x["secret_len"] == 64  # 32 random bytes, hex
        assert torch.equal(x["sum"], SUM), x["sum"]
    assert res[0]["digest"] == res[1]["digest"]


def test_torchrun_with_tidewire_secret_uses_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = run_torchrun(out, {"scenario": "secret"}, env={"TIDEWIRE_SECRET": "explicit-torchrun-secret"})
    assert p.returncode == 0, p.stdout + p.stderr
    want = hashlib.sha256(b"explicit-torchrun-secret").hexdigest()
    for x in _results(out):
        assert (x["source"], x["digest"]) == ("TIDEWIRE_SECRET", want)
        assert torch.equal(x["sum"], SUM), x["sum"]


def test_a_restarted_torchrun_job_gets_a_fresh_secret(tmp_path):
    """--max-restarts 1: every rank of the first attempt exits after its
    push_pull; torchrun's agent starts the second, whose ranks share another
    secret (the key names the restart attempt)."""
    out = tmp_path / "out"
    out.mkdir()
    p = run_torchrun(out, {"scenario": "secret", "die_first": True}, env={"TIDEWIRE_SECRET": None},
                     args=("--max-restarts", "1"), timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = _results(out / "attempt0"), _results(out)
    assert [x["attempt"] for x in first + second] == [0, 0, 1, 1]
    for x in first + second:
        assert x["source"].startswith("torchrun's store at "), x["source"]
        assert torch.equal(x["sum"], SUM), x["sum"]
    assert first[0]["digest"] == first[1]["digest"]
    assert second[0]["digest"] == second[1]["digest"]
    assert first[0]["digest"] != second[0]["digest"]


@pytest.fixture
def agent_store(clean_env, monkeypatch):
    """A real TCPStore server standing in for torchrun's agent, and the
    variables torchrun gives its workers (without TIDEWIRE_SECRET)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    yield server


def test_the_store_secret_per_run_and_attempt(agent_store, monkeypatch):
    port = agent_store.port
    # Rank 1 first: rank 0 has not shared one yet, and the wait ends with a clear error.
    monkeypatch.setenv("RANK", "1")
    t0 = time.time()
    with pytest.raises(tidewire.TidewireError, match=r"rank 0 did not share Tidewire's job secret .* within 1 s"):
        _read_env(None, None, 1.0)
    assert time.time() - t0 < 10
    monkeypatch.setenv("RANK", "0")
    e0 = _read_env(None, None, 5.0)
    assert e0.secret_source == f"torchrun's store at 127.0.0.1:{port}"
    assert len(e0.secret) == 64 and e0.secret == agent_store.get(f"{SECRET_KEY}/run-a/attempt-0")
    assert _read_env(None, None, 5.0).secret == e0.secret  # a second init in the attempt: the same one
    monkeypatch.setenv("RANK", "1")
    assert _read_env(None, None, 5.0).secret == e0.secret
    # The next attempt, and another run, get fresh ones.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    e1 = _read_env(None, None, 5.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    e2 = _read_env(None, None, 5.0)
    assert len({e0.secret, e1.secret, e2.secret}) == 3
    # TIDEWIRE_SECRET, and init(secret=...), win over the store.
    monkeypatch.setenv("TIDEWIRE_SECRET", "from-the-environment")
    e = _read_env(None, None, 5.0)
    assert (e.secret, e.secret_source) == (b"from-the-environment", "TIDEWIRE_SECRET")
    e = _read_env("given", None, 5.0)
    assert (e.secret, e.secret_source) == (b"given", "init(secret=...)")


def test_an_unreachable_agent_store_is_a_clear_error(agent_store, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens there
    monkeypatch.setenv("RANK", "1")
    t0 = time.time()
    with pytest.raises(tidewire.TidewireError, match="cannot reach torchrun's store at 127.0.0.1:.* TIDEWIRE_SECRET"):
        _read_env(None, None, 1.0)
    assert time.time() - t0 < 15


def test_an_initialized_process_group_shares_its_store(clean_env, monkeypatch):
    """Not under torchrun, but after init_process_group: its store carries the secret."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    try:
        monkeypatch.setenv("TIDEWIRE_RANK", "0")
        monkeypatch.setenv("TIDEWIRE_WORLD_SIZE", "2")
        e = _read_env(None, "127.0.0.1:5000", 5.0)
        assert e.secret_source == "the default process group's store"
        key = f"{SECRET_KEY}/none/attempt-0"
        assert len(e.secret) == 64
        assert e.secret == dist.distributed_c10d._get_default_store().get(key)
    finally:
        dist.destroy_process_group()
    # Without a process group or torchrun's store, TIDEWIRE_SECRET is required (as before).
    with pytest.raises(tidewire.TidewireError, match="TIDEWIRE_SECRET is not set.*same string on every rank"):
        _read_env(None, "127.0.0.1:5000", 5.0)


def test_rank_0_names_the_joiner_it_refused(tmp_path):
    """Rank 1 has another secret: it hears at once that rank 0 refused it, and
    rank 0's rendezvous timeout names the refusal (from where, the rank
    claimed, why), not only the missing rank. (The native session, whose
    rendezvous timeout can be short; tidewire.torch waits 60 s at least.)"""
    cfg = {"scenario": "native_build", "secrets": ["pytest-secret", "another"], "timeout": 3.0}
    r = run_ranks(tmp_path, 2, cfg, timeout=60)
    x0, x1 = r.result(0), r.result(1)
    e0, e1 = x0["error"], x1["error"]
    assert e1 and "rank 0 refused this rank: authentication failed" in e1, e1
    assert x1["seconds"] < 2.5, x1  # refused at once, not after the timeout
    assert e0 and "timed out after 3s waiting for ranks [1] to join the rendezvous" in e0, e0
    assert "rank 0 refused 1 joiner: 127.0.0.1:" in e0, e0
    assert "claiming rank 1 of job" in e0 and "does not have this job's secret" in e0, e0
    assert "TIDEWIRE_SECRET" in e0, e0
    assert x0["seconds"] < 15, x0
