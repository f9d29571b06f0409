"""Helpers for the multi-process tests: real processes on loopback, free
ports, a hard timeout on every run (a hang fails the test, it does not hold CI)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_CLEAR = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
          "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
          "TIDEWIRE_RANK", "TIDEWIRE_WORLD_SIZE", "TIDEWIRE_LOCAL_RANK", "TIDEWIRE_MASTER", "TIDEWIRE_SECRET",
          "TIDEWIRE_SERVERS", "TIDEWIRE_PORT_OFFSET", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE",
          "TIDEWIRE_LOCAL_SIZE", "TIDEWIRE_LOCAL_AGGREGATION", "TIDEWIRE_CACHE_STALENESS", "OMPI_COMM_WORLD_LOCAL_SIZE",
          "SLURM_NTASKS_PER_NODE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"]


def free_port(span: int = 16) -> int:
    """A port p with p .. p+span free on 127.0.0.1 (Tidewire uses p + session index),
    and p+1000 .. (its default offset from MASTER_PORT)."""
    for _ in range(200):
        p = random.randint(20000, 30000)
        socks = []
        try:
            for q in list(range(p, p + span)) + list(range(p + 1000, p + 1000 + span)):
                s = socket.socket()
                s.bind(("127.0.0.1", q))
                socks.append(s)
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def base_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TIDEWIRE_TIMEOUT", "20")
    return env


class Ranks:
    """The outcome of one multi-process run."""

    def __init__(self, out_dir: pathlib.Path, codes: List[int], logs: List[str], seconds: float) -> None:
        self.out_dir, self.codes, self.logs, self.seconds = out_dir, codes, logs, seconds

    def result(self, rank: int):
        return torch.load(self.out_dir / f"rank{rank}.pt", weights_only=False)

    def results(self):
        return [self.result(r) for r in range(len(self.codes))]

    def log(self) -> str:
        return "\n".join(f"----- rank {r} (exit {c}) -----\n{l}" for r, (c, l) in enumerate(zip(self.codes, self.logs)))


def run_ranks(tmp_path: pathlib.Path, world: int, cfg: dict, env: Optional[Dict[str, str]] = None,
              per_rank_env=None, timeout: float = 90.0, launcher: str = "tidewire", check: bool = True) -> Ranks:
    out = tmp_path / f"out-{cfg['scenario']}-{random.randrange(1 << 30)}"
    out.mkdir()
    port = free_port()
    procs = []
    t0 = time.time()
    for r in range(world):
        e = base_env()
        if launcher == "tidewire":
            e.update(TIDEWIRE_RANK=str(r), TIDEWIRE_WORLD_SIZE=str(world), TIDEWIRE_MASTER=f"127.0.0.1:{port}")
        else:  # torchrun's variables
            e.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        e["TIDEWIRE_SECRET"] = "pytest-secret"
        e["TW_TEST"] = json.dumps(cfg)
        e.update(env or {})
        if per_rank_env:
            e.update(per_rank_env(r))
        e = {k: v for k, v in e.items() if v is not None}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "_worker.py"), str(out)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs, codes = [], []
    deadline = time.time() + timeout
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, _ = p.communicate()
            logs.append(o)
            codes.append(-9)
            continue
        logs.append(o)
        codes.append(p.returncode)
    ranks = Ranks(out, codes, logs, time.time() - t0)
    if check and any(c != 0 for c in codes):
        pytest.fail(f"a rank failed or hung (timeout {timeout} s):\n{ranks.log()}")
    return ranks


def run_torchrun(out: pathlib.Path, cfg: dict, env: Optional[Dict[str, str]] = None, nproc: int = 2,
                 args=(), timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N _worker.py OUT` (the real launcher:
    its agent's store on MASTER_PORT) with the scenario ``cfg``; ``env`` on top of
    base_env() (None removes a variable). A hang past ``timeout`` fails the test."""
    e = base_env()
    e["TW_TEST"] = json.dumps(cfg)
    e.update(env or {})
    e = {k: v for k, v in e.items() if v is not None}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--monitor-interval", "0.2", *args, str(HERE / "_worker.py"), str(out)]
    try:
        return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"torchrun hung (timeout {timeout} s):\n{t.stdout}\n{t.stderr}")


@pytest.fixture
def clean_env(monkeypatch):
    """This process as a job of one (no launcher variables)."""
    for k in _CLEAR:
        monkeypatch.delenv(k, raising=False)
    yield
