"""One rank of a multi-process test: `python _worker.py OUT_DIR` with the
scenario in TW_TEST (JSON) and the rank in the environment. Writes
OUT_DIR/rank{r}.pt: what the test compares."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

import torch

torch.set_num_threads(1)

import _common as C  # noqa: E402
import tidewire  # noqa: E402
import tidewire.torch as tw  # noqa: E402


def save(out_dir: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


def train_one(cfg) -> dict:
    """Trains one model under a DistributedOptimizer built from ``cfg``."""
    net = C.model(cfg.get("model", "mlp")).to(getattr(torch, cfg.get("dtype", "float32")))
    opt = C.optimizer(cfg.get("opt", "sgd"), [p for p in net.parameters()], lr=cfg.get("lr", 0.05))
    env = {k: os.environ.get(k) for k in cfg.get("env", {})}
    os.environ.update(cfg.get("env", {}))
    try:
        opt = tw.DistributedOptimizer(
            opt,
            named_parameters=net.named_parameters(),
            model=net,
            apply=cfg.get("apply", "local"),
            sfb=cfg.get("sfb", False),
            batch_size=cfg.get("batch", 16) // tw.size(),
            backward_passes_per_step=cfg.get("passes", 1),
            prefetch=cfg.get("prefetch", False),
            consistency=tuple(cfg["consistency"]) if "consistency" in cfg else "bsp",
            **cfg.get("comm", {}),
            **cfg.get("checkpoint", {}),
        )
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    tw.broadcast_parameters(net.state_dict(), root_rank=0)
    zero = (lambda: net.zero_grad(set_to_none=True)) if cfg.get("model_zero_grad") else None
    grads_after_zero = None
    if cfg.get("zero_in_place"):
        zero = lambda: opt.zero_grad(set_to_none=False)  # noqa: E731
    elif zero is None and hasattr(opt, "tidewire_stats"):
        # What zero_grad() leaves: None for layers pushed from the buffer (torch's default).
        # (Taken at the second step, after a whole step has bound every .grad to the buffer.)
        zeroed = []

        def zero():
            nonlocal grads_after_zero
            opt.zero_grad()
            zeroed.append(1)
            if len(zeroed) == 2:
                grads_after_zero = {n: p.grad is None for n, p in net.named_parameters() if p.requires_grad}
    t_per_step = []
    if "quality_script" in cfg:
        # A scripted quality figure: `base`, or `bad` on rank `rank` while T > `above`.
        sc, plain_step = cfg["quality_script"], opt.step

        def step(closure=None):
            t = opt.tidewire_stats()["comm_every"]
            t_per_step.append(t)
            worse = tw.rank() == sc["rank"] and t > sc["above"]
            opt.report_quality(sc["bad"] if worse else sc["base"])
            return plain_step(closure)

        opt.step = step
    t0 = time.time()
    first = getattr(opt, "start_step", 0)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if "die_after" in cfg and (first_attempt or not cfg.get("die_on_first_attempt_only")):
        # A lost job: every rank stops dead after this many steps (no shutdown).
        C.train(net, opt, cfg["die_after"], cfg.get("batch", 16), tw.rank(), tw.size(), first=first)
        c = cfg["checkpoint"]
        due = cfg["die_after"] - cfg["die_after"] % c["checkpoint_every"]
        want = os.path.join(c["checkpoint_dir"], f"step-{due:08d}")
        deadline = time.time() + 30
        # The checkpoint threads write off the training path: give them their time.
        while tidewire._native.newest_checkpoint(c["checkpoint_dir"]) != want and time.time() < deadline:
            time.sleep(0.05)
        os._exit(17)
    losses = C.train(net, opt, cfg.get("steps", 6), cfg.get("batch", 16), tw.rank(), tw.size(),
                     passes=cfg.get("passes", 1), zero=zero, first=first)
    flushed = opt.flush() if cfg.get("flush") else None
    opt.synchronize()
    took = time.time() - t0
    stats = opt.tidewire_stats()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    grads_none = [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
    return {"state": state, "losses": losses, "stats": stats, "seconds": took, "grads_none": grads_none,
            "grads_after_zero": grads_after_zero, "t_per_step": t_per_step, "flushed": flushed, "start_step": first,
            "resumed_from": getattr(opt, "resumed_from", None)}


def multi(cfg) -> dict:
    """Several trainings in one job (one DistributedOptimizer each), by name."""
    tw.init()
    res = {name: train_one(c) for name, c in cfg["runs"].items()}
    tw.shutdown()
    return res


def native(cfg) -> dict:
    """The extension module directly, over NumPy-free torch tensors."""
    r, w = int(os.environ["TIDEWIRE_RANK"]), int(os.environ["TIDEWIRE_WORLD_SIZE"])
    layers = [("a", "other", 2, 3), ("fc", "fc", 4, 5)]
    n = 6 + 20
    params = torch.full((n,), float(r + 1))  # rank 0's values win at build
    grads = torch.zeros(n)
    config = tidewire.SessionConfig(layers, rank=r, world=w, master=os.environ["TIDEWIRE_MASTER"], secret="s3",
                                    batch=2, apply="sum", policy="ps", timeout=20.0)
    s = tidewire.Session(config, params=params, grads=grads)
    res = {"init": params.clone(), "schemes": [s.scheme(0), s.scheme(1)], "len": len(s),
           "names": s.layer_names, "sizes": s.layer_sizes, "transport": s.transport[0]}
    grads[:6] = float(r + 1)
    s.push(0)
    res["in_flight"] = s.in_flight(0)
    s.pull(0)
    res["after0"] = params[:6].clone()
    res["poll_unpushed"] = s.poll(1)
    # Layer 1 by sufficient factors (K=2): U 2x4, V 2x5, formed into U^T V and summed.
    u = torch.arange(8, dtype=torch.float32).reshape(2, 4) * (r + 1)
    v = torch.ones(2, 5)
    s.push_factors(1, u.numpy(), v.numpy())
    while not s.poll(1):
        time.sleep(0.001)
    res["after1"] = params[6:].clone()
    errors = {}
    for what, f in [
        ("unknown_layer", lambda: s.push(7)),
        ("bad_factors", lambda: s.push_factors(1, b"\0" * 4, b"\0" * 4)),
    ]:
        try:
            f()
            errors[what] = None
        except tidewire.TidewireError as e:
            errors[what] = str(e)
    s.push(0)
    try:
        s.push(0)
        errors["push_twice"] = None
    except tidewire.TidewireError as e:
        errors["push_twice"] = str(e)
    s.pull_all()
    res["stats"] = s.stats()
    res["errors"] = errors
    s.shutdown()
    res["closed"] = s.closed
    try:
        s.pull(0)
        res["after_shutdown"] = None
    except tidewire.TidewireError as e:
        res["after_shutdown"] = str(e)
    return res


def native_servers(cfg) -> dict:
    """Two workers and one server-only rank (servers=1)."""
    r, w = int(os.environ["TIDEWIRE_RANK"]), int(os.environ["TIDEWIRE_WORLD_SIZE"])
    params, grads = torch.zeros(8), torch.zeros(8)
    config = tidewire.SessionConfig([("w", "other", 2, 4)], rank=r, world=w, servers=1,
                                    master=os.environ["TIDEWIRE_MASTER"], secret="s3", apply=("sgd", 0.5, 0.0, 0.0),
                                    timeout=20.0)
    s = tidewire.Session(config, params=params, grads=grads)
    res = {"role": s.role}
    if s.role == "server":
        try:
            s.push(0)
        except tidewire.TidewireError as e:
            res["push"] = str(e)
        s.shutdown()  # serves until both workers have shut down
        return res
    for step in range(3):
        grads[:] = float(r + 1)
        s.push(0)
        s.pull(0)
    res["params"] = params.clone()
    s.shutdown()
    return res


def collectives(cfg) -> dict:
    tw.init()
    r, w = tw.rank(), tw.size()
    res = {}
    res["sum"] = tw.push_pull(torch.arange(6, dtype=torch.float32) * (r + 1), average=False)
    res["mean"] = tw.push_pull(torch.full((3, 2), float(r)), average=True)
    big = torch.arange(2_500_000, dtype=torch.float32) + r  # several pieces
    res["big_ok"] = bool(torch.equal(tw.push_pull(big, average=False), torch.arange(2_500_000) * w + sum(range(w))))
    res["bcast_i64"] = tw.broadcast(torch.tensor([2**40 + r, -3 - r], dtype=torch.int64), root_rank=w - 1)
    res["bcast_f64"] = tw.broadcast(torch.tensor([1 / 3 + r], dtype=torch.float64), root_rank=0)
    res["bcast_bool"] = tw.broadcast(torch.tensor([r == 0, True, False]), root_rank=0)
    res["object"] = tw.broadcast_object({"rank": r, "t": torch.ones(2) * r}, root_rank=1 % w)
    net = C.model("bn", seed=r)  # different weights per rank
    tw.broadcast_parameters(net.state_dict(), root_rank=0)
    res["params"] = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    if r == 0:
        net(torch.randn(4, C.D_IN)).sum().backward()
        opt.step()
    tw.broadcast_optimizer_state(opt, root_rank=0)
    res["opt_state"] = opt.state_dict()
    tw.barrier()
    tw.shutdown()
    return res


def mismatch(cfg) -> dict:
    tw.init()
    r = tw.rank()
    res = {}
    try:
        tw.push_pull(torch.ones(10 + r))
        res["size"] = None
    except tidewire.TidewireError as e:
        res["size"] = str(e)
    try:
        tw.push_pull(torch.ones(4), name=f"tensor{r}")
        res["name"] = None
    except tidewire.TidewireError as e:
        res["name"] = str(e)
    # Still usable afterwards.
    res["after"] = tw.push_pull(torch.ones(2), average=False)
    try:
        net = C.model("mlp" if r == 0 else "wide")
        tw.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
        res["table"] = None
    except tidewire.TidewireError as e:
        res["table"] = str(e)
    tw.shutdown()
    return res


def straggler(cfg) -> dict:
    """Rank 1 skips a collective and shuts down (rank 0 must hear that the
    collective can never complete), stalls first (rank 0 must time out), or
    dies (rank 0 must hear it)."""
    tw.init()
    r = tw.rank()
    if r == 1:
        if cfg.get("die"):
            os._exit(0)  # no shutdown, no goodbye: the process is gone
        if cfg.get("stall"):
            time.sleep(cfg["stall"])  # alive but silent: rank 0's wait must time out
        try:
            tw.shutdown()  # rank 0 gives up on the collective and aborts: this fails, and does not hang
            return {"shutdown": None}
        except tidewire.TidewireError as e:
            return {"shutdown": str(e)}
    t0 = time.time()
    try:
        tw.push_pull(torch.ones(3))
        err = None
    except tidewire.TidewireError as e:
        err = str(e)
    took = time.time() - t0
    try:
        tw.shutdown()
    except tidewire.TidewireError:
        pass
    return {"error": err, "seconds": took}


def nosecret(cfg) -> dict:
    try:
        tw.init()
        return {"error": None}
    except tidewire.TidewireError as e:
        return {"error": str(e)}


def gloo(cfg) -> dict:
    """torchrun-style environment: a gloo process group and Tidewire side by side."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tw.init()
    r = tw.rank()
    t = torch.arange(5, dtype=torch.float32) * (r + 1)
    g = t.clone()
    dist.all_reduce(g)
    mine = tw.push_pull(t, average=False)
    net = C.model("mlp", seed=r)
    tw.broadcast_parameters(net.state_dict())
    ref = [p.detach().clone() for p in net.parameters()]
    for p in ref:
        dist.broadcast(p, 0)
    same = all(torch.equal(a, b.detach()) for a, b in zip(ref, net.parameters()))
    res = {"gloo": g, "tidewire": mine, "same_params": same, "source": tw._state.env.source,
           "local_rank": tw.local_rank(), "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
    tw.shutdown()
    dist.destroy_process_group()
    return res


def secret(cfg) -> dict:
    """Under torchrun: where the job secret came from, its digest, and a
    push_pull's sum. With ``die_first``, every rank of the first attempt writes
    its result to OUT_DIR/attempt0/ and exits 3, so that torchrun restarts the job."""
    tw.init()
    r = tw.rank()
    env = tw._state.env
    res = {
        "rank": r,
        "size": tw.size(),
        "launcher": env.source,
        "source": env.secret_source,
        "secret_len": len(env.secret),
        "digest": hashlib.sha256(env.secret).hexdigest(),
        "sum": tw.push_pull(torch.arange(6, dtype=torch.float32) * (r + 1), average=False),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "env_secret": os.environ.get("TIDEWIRE_SECRET"),
    }
    tw.shutdown()
    if cfg.get("die_first") and res["attempt"] == 0:
        first = os.path.join(sys.argv[1], "attempt0")
        os.makedirs(first, exist_ok=True)
        save(first, r, res)
        sys.stdout.flush()
        os._exit(3)
    return res


def native_build(cfg) -> dict:
    """Builds a native session with this rank's secret (``cfg["secrets"]``) and a
    short rendezvous timeout; returns the build's error, or None."""
    r, w = int(os.environ["TIDEWIRE_RANK"]), int(os.environ["TIDEWIRE_WORLD_SIZE"])
    params, grads = torch.zeros(4), torch.zeros(4)
    config = tidewire.SessionConfig([("w", "other", 1, 4)], rank=r, world=w, master=os.environ["TIDEWIRE_MASTER"],
                                    secret=cfg["secrets"][r], timeout=cfg["timeout"],
                                    connect_timeout=cfg["timeout"])
    t0 = time.time()
    try:
        s = tidewire.Session(config, params=params, grads=grads)
    except tidewire.TidewireError as e:
        return {"error": str(e), "seconds": time.time() - t0}
    s.shutdown()
    return {"error": None, "seconds": time.time() - t0}


from _elastic_scenarios import SCENARIOS as _ELASTIC  # noqa: E402
from _hvd_scenarios import SCENARIOS as _HVD  # noqa: E402

SCENARIOS = {**_HVD, **_ELASTIC, "multi": multi, "native": native, "native_servers": native_servers, "collectives": collectives, "mismatch": mismatch,
             "nosecret": nosecret, "straggler": straggler, "gloo": gloo, "secret": secret,
             "native_build": native_build}


def main() -> int:
    out_dir = sys.argv[1]
    cfg = json.loads(os.environ.get("TW_TEST", "{}"))
    rank = int(os.environ.get("TIDEWIRE_RANK", os.environ.get("RANK", "0")))
    try:
        res = SCENARIOS[cfg["scenario"]](cfg)
    except BaseException:
        traceback.print_exc()
        return 1
    save(out_dir, rank, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
