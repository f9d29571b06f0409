"""hvd.elastic on Tidewire: a rank SIGKILLed under torchrun --max-restarts 1
(the job resumes from the last commit), without restarts (the error
surfaces), ObjectState's and TorchState's commits, restores and disk copies."""

from __future__ import annotations

import os

import pytest
import torch

import tidewire.torch as tw
from _hvd_scenarios import hvd_batch, hvd_model
from conftest import run_ranks, run_torchrun
from test_horovod import rank_sum

STEPS, COMMIT_EVERY, KILL_AFTER = 8, 2, 5


def reference(steps: int, momentum: float):
    """One process: each step's gradients of the ranks' shards, averaged as
    Tidewire's servers do (float32 sum in rank order, times 1/size), then
    torch's SGD. The parameters, and the momentum buffers."""
    w = 2
    net = hvd_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        grads = []
        for r in range(w):
            net.zero_grad()
            xb, yb = hvd_batch(step, r, w)
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for i, p in enumerate(net.parameters()):
            p.grad = rank_sum([g[i] for g in grads]) * (torch.tensor(1.0) / w)
        opt.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in net.parameters()] if momentum else []
    return net.state_dict(), bufs


def equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_killed_rank_resumes_from_the_last_commit_under_torchrun(tmp_path):
    """Rank 1 SIGKILLs itself after step 5 (commits after steps 2 and 4).
    torchrun restarts both ranks; they resume from commit 2 (after step 4),
    not from scratch and not from the uncommitted step 5, call the reset
    callbacks, and end with exactly the parameters and momentum of 8
    uninterrupted steps, bitwise equal on both ranks."""
    out, commits = tmp_path / "out", tmp_path / "commits"
    out.mkdir()
    cfg = {"scenario": "elastic_train", "steps": STEPS, "commit_every": COMMIT_EVERY, "kill_rank": 1,
           "kill_after": KILL_AFTER}
    p = run_torchrun(out, cfg, env={"TIDEWIRE_SECRET": None, "TIDEWIRE_ELASTIC_DIR": str(commits)},
                     args=("--max-restarts", "1"), timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    # The first attempt: rank 1 got through step 5 (one step after the commit) and was killed.
    dead = torch.load(out / "attempt0-rank1.pt", weights_only=False)
    assert dead["batch"] == KILL_AFTER and dead["history"] == list(range(KILL_AFTER))
    assert "resuming from commit 2 in " in p.stderr, p.stderr
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    want, bufs = reference(STEPS, 0.9)
    for r, x in enumerate(res):
        assert x["attempt"] == 1, x["attempt"]
        assert x["starts"] == [4], x["starts"]  # the committed batch: not 0, not 5
        assert x["resets"] == [("first", 4), ("second", 4)], x["resets"]
        assert x["history"] == list(range(STEPS)), x["history"]  # step 4 once: the rolled-back one redone
        assert x["batch"] == STEPS
        for k, v in want.items():
            assert equal(x["params"][k], v), f"rank {r}: {k} differs from 8 uninterrupted steps"
        assert len(x["momentum"]) == len(bufs) and all(equal(a, b) for a, b in zip(x["momentum"], bufs))
    for k in want:
        assert equal(res[0]["params"][k], res[1]["params"][k])
    # Step 5's parameters were not what the job resumed from: they differ from the commit's.
    at4, _ = reference(4, 0.9)
    assert not all(equal(dead["params"][k], at4[k]) for k in at4)
    # On disk: the first attempt's commits (the last attempt has no restart left, so it writes none).
    run_dir = commits / "run-1"
    assert sorted(os.listdir(run_dir)) == ["commit-00000001.pt", "commit-00000002.pt"]
    snap = torch.load(run_dir / "commit-00000002.pt", weights_only=False)
    assert snap["objects"]["batch"] == 4 and snap["objects"]["history"] == [0, 1, 2, 3]
    for k, v in at4.items():
        assert equal(snap["handlers"]["model"][k], v), k


def test_without_restarts_the_error_surfaces(tmp_path):
    """Not under torchrun: the survivor's next step fails with TidewireError,
    which elastic.run lets through (no retry in the same processes)."""
    cfg = {"scenario": "elastic_train", "steps": STEPS, "commit_every": COMMIT_EVERY, "kill_rank": 1,
           "kill_after": KILL_AFTER, "catch": True}
    r = run_ranks(tmp_path, 2, cfg, env={"TIDEWIRE_TIMEOUT": "5"}, timeout=90, check=False)
    assert r.codes[1] == -9, r.log()
    assert r.codes[0] == 0, r.log()
    x = r.result(0)
    assert "rank 1" in x["error"], x["error"]  # the survivor names the rank it lost
    assert x["starts"] == [0] and x["resets"] == []
    assert x["history"] == list(range(KILL_AFTER)), x["history"]  # the step it failed in is not in it


def test_object_state_commit_restore_sync_and_a_restart(clean_env, monkeypatch, tmp_path):
    """A job of one under torchrun's variables: ObjectState's commit, restore
    and sync; the disk copy a restarted process restores, with the reset
    callbacks; check_host_updates does nothing."""
    from tidewire.torch import elastic

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run x/1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert elastic.commit_dir() == os.path.join(__import__("tempfile").gettempdir(), "tidewire-elastic-run_x_1")
    monkeypatch.setenv("TIDEWIRE_ELASTIC_DIR", str(tmp_path))
    assert elastic.commit_dir() == str(tmp_path)
    monkeypatch.setattr(elastic, "_calls", 0)
    tw.init()
    try:
        s = elastic.ObjectState(epoch=0, seen=[])
        assert (s.epoch, s.seen) == (0, [])
        s.epoch, s.seen = 3, ["a"]
        s.commit()
        s.epoch, s.seen = 4, ["a", "b"]
        s.restore()
        assert (s.epoch, s.seen) == (3, ["a"])
        assert s.check_host_updates() is None

        @elastic.run
        def work(state, until):
            while state.epoch < until:
                state.epoch += 1
                state.seen = state.seen + [state.epoch]
                state.commit()
            state.epoch = 99  # not committed
            return state.epoch

        (tmp_path / "run-1").mkdir()
        (tmp_path / "run-1" / "commit-00000009.pt").write_bytes(b"stale")  # an earlier run's: removed
        assert work(s, 6) == 99
        files = sorted(os.listdir(tmp_path / "run-1"))
        assert files == ["commit-00000003.pt", "commit-00000004.pt"], files  # the newest two of 4
        # The process restarts: a fresh state, torchrun's next attempt.
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        monkeypatch.setattr(elastic, "_calls", 0)
        fresh = elastic.ObjectState(epoch=0, seen=[])
        calls = []
        fresh.register_reset_callbacks([lambda: calls.append((fresh.epoch, list(fresh.seen)))])
        assert work(fresh, 7) == 99
        assert calls == [(6, ["a", 4, 5, 6])]
        assert fresh.seen == ["a", 4, 5, 6, 7]
        # The last attempt writes nothing: commit 5 exists only in memory.
        assert sorted(os.listdir(tmp_path / "run-1")) == files
        fresh.restore()
        assert fresh.epoch == 7
    finally:
        tw.shutdown()


def test_torch_state_restores_model_and_optimizer_in_memory(clean_env):
    tw.init()
    try:
        net = hvd_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        state = tw.elastic.TorchState(net, opt, epoch=1)
        xb, yb = hvd_batch(0, 0, 1)
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
        state.epoch = 2
        state.commit()
        saved = {k: v.clone() for k, v in net.state_dict().items()}
        buf = opt.state[next(net.parameters())]["momentum_buffer"].clone()
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
        state.epoch = 3
        assert not equal(net.state_dict()["0.weight"], saved["0.weight"])
        state.restore()
        assert state.epoch == 2 and state.model is net and state.optimizer is opt
        assert all(equal(net.state_dict()[k], v) for k, v in saved.items())
        assert equal(opt.state[next(net.parameters())]["momentum_buffer"], buf)
        with pytest.raises(ValueError, match="apply='server'"):
            tw.elastic.TorchState(net, tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                                               apply="server"))
    finally:
        tw.shutdown()
