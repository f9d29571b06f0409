"""BytePS's suspend and resume on real processes."""

from __future__ import annotations

import torch

from conftest import run_ranks
from test_elastic import equal, reference


def test_suspend_and_resume(tmp_path):
    """BytePS's suspend/resume on two ranks: the same DistributedOptimizer
    trains on after each resume (num_workers the ranks, then the hosts),
    exactly as four uninterrupted steps; a different
    number of workers, another rank, or a negative server count is refused
    on every rank with the reason, and the job stays suspended."""
    w = 2
    r = run_ranks(tmp_path, w, {"scenario": "suspend_resume"}, timeout=120)
    want, _ = reference(4, 0.0)
    res = r.results()
    for rank, x in enumerate(res):
        assert "not suspended" in x["not_suspended"], x["not_suspended"]
        assert "not initialized" in x["while_suspended"] and not x["is_initialized_while_suspended"]
        # BytePS answers its rank and size queries while suspended (its elastic example logs with them).
        assert x["who_while_suspended"] == (rank, w, 0, w) and x["who_after_refusal"] == (rank, w)
        assert "ranks 0, 1: num_workers=3, but the job has 2 workers (1 host of 2)" in x["more_workers"], x["more_workers"]
        assert "changing their number in place is not supported" in x["more_workers"]
        assert "rank 1: global_rank=0 on rank 1" in x["other_rank"], x["other_rank"]
        assert "rank 0:" not in x["other_rank"]
        assert "num_servers=-1" in x["bad_servers"], x["bad_servers"]
        assert "not initialized" in x["still_suspended"]
        assert (x["size_after"], x["rank_after"]) == (w, rank)
        assert equal(x["sum_after"], torch.tensor([3.0]))
        for k, v in want.items():
            assert equal(x["params"][k], v), f"rank {rank}: {k}"
