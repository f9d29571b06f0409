#!/usr/bin/env python3
"""compare_ddp.py - one rank of a side-by-side run: the same model, seeds and data
trained in the same processes by (a) PyTorch DDP on gloo and (b) Tidewire's
DistributedOptimizer, in alternating timed blocks; at the end, every rank checks
that the two copies of the parameters agree (torch.allclose, rtol 1e-5).

Launch one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment (gloo's rendezvous; Tidewire picks its own ports), and
TIDEWIRE_SECRET. bench/torch/compare_ddp.sh does that on loopback and under the
ci/netem harness, repeats, and writes the summary under bench/results/.

Timing: --blocks blocks of --steps steps per system. Block b runs DDP then
Tidewire when b is even, Tidewire then DDP when odd (neither always goes first).
Each system first runs --warmup untimed steps. A block's clock starts after a
gloo barrier and stops after another, so it measures the slowest rank. (With
apply='local' Tidewire's step() returns once every layer is back, as DDP's
does; with --prefetch the last step's layers may still be in flight.) Both systems
take batch(step, rank) of the same seeded generator for their own step
counter, so after the run both have taken the same warmup + blocks x steps
updates from the same data.

Rank 0 writes the run's JSON to --out.
"""
import argparse
import copy
import datetime
import hashlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "torch"))
from vgg_fc import Data, build_model  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["fc", "conv"], default="fc")
    p.add_argument("--fc-width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (K)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system before the first block")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per system")
    p.add_argument("--lr", type=float, default=0.001,
                   help="0.001: at 0.01 (momentum 0.9) DDP itself drifts from a one-process run by ~1e-5 in 20 steps")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--apply", choices=["local", "server"], default="local")
    p.add_argument("--sfb", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--label", default="", help="free text copied into the JSON (the network, say)")
    p.add_argument("--out", default="", help="rank 0 writes the run's JSON here")
    return p.parse_args()


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    import tidewire.torch as tw

    tw.init()
    if (tw.rank(), tw.size()) != (rank, world):
        sys.exit(f"tidewire sees rank {tw.rank()} of {tw.size()}, gloo rank {rank} of {world}")

    torch.manual_seed(a.seed)
    base = build_model(a.model, a.fc_width)
    m_ddp, m_tw = copy.deepcopy(base), copy.deepcopy(base)
    del base
    ddp = torch.nn.parallel.DistributedDataParallel(m_ddp)
    opt_ddp = torch.optim.SGD(m_ddp.parameters(), lr=a.lr, momentum=a.momentum)
    opt_tw = tw.DistributedOptimizer(torch.optim.SGD(m_tw.parameters(), lr=a.lr, momentum=a.momentum),
                                     named_parameters=m_tw.named_parameters(), model=m_tw, apply=a.apply,
                                     sfb={"auto": "auto", "true": True, "false": False}[a.sfb],
                                     consistency="bsp", prefetch=a.prefetch, batch_size=a.batch)
    tw.broadcast_parameters(m_tw.state_dict(), root_rank=0)
    tw.broadcast_optimizer_state(opt_tw, root_rank=0)
    data = Data(a.seed, a.batch)

    systems = {
        "gloo": dict(model=ddp, opt=opt_ddp, step=0, losses=[]),
        "tidewire": dict(model=m_tw, opt=opt_tw, step=0, losses=[]),
    }

    def run(name, n):
        s = systems[name]
        for _ in range(n):
            x, y = data.get(s["step"], rank)
            s["opt"].zero_grad()
            loss = F.cross_entropy(s["model"](x), y)
            loss.backward()
            s["opt"].step()
            s["losses"].append(loss.item())
            s["step"] += 1

    for name in ("gloo", "tidewire"):
        dist.barrier()
        run(name, a.warmup)
    blocks = []
    for b in range(a.blocks):
        for name in (("gloo", "tidewire") if b % 2 == 0 else ("tidewire", "gloo")):
            dist.barrier()
            t0 = time.perf_counter()
            run(name, a.steps)
            dist.barrier()
            dt = time.perf_counter() - t0
            blocks.append({"system": name, "block": b, "seconds": dt,
                           "samples_s": a.steps * world * a.batch / dt})
            if rank == 0:
                print(f"block {b} {name:9s} {dt:7.3f} s  {blocks[-1]['samples_s']:8.1f} samples/s", flush=True)
    # Each layer's scheme and the session's counters, then pull every layer and end the
    # optimizer's session (with prefetch, step() returns before the servers' values are back).
    try:
        tw_stats = opt_tw.tidewire_stats()
    except Exception as e:  # informational only
        tw_stats = {"error": str(e)}
    opt_tw.close()

    # The two copies of the parameters, on this rank.
    p_ddp = dict(m_ddp.named_parameters())
    max_abs = max_rel = 0.0
    close, worst = True, ""
    for n, p in m_tw.named_parameters():
        q = p_ddp[n].detach()
        p = p.detach()
        d = (p - q).abs()
        ma = d.max().item()
        mr = (d / (a.atol + a.rtol * q.abs())).max().item()  # <= 1 everywhere: allclose
        ok = torch.allclose(p, q, rtol=a.rtol, atol=a.atol)
        if ma > max_abs:
            max_abs, worst = ma, n
        max_rel = max(max_rel, mr)
        close &= ok
    h = hashlib.sha256()
    for n, p in m_tw.named_parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    mine = {"rank": rank, "allclose": bool(close), "max_abs_diff": max_abs, "allclose_margin": max_rel,
            "worst_param": worst, "tidewire_sha256": h.hexdigest(),
            "loss_gloo": systems["gloo"]["losses"][-1], "loss_tidewire": systems["tidewire"]["losses"][-1]}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    if rank == 0:
        def total(name):
            bl = [x for x in blocks if x["system"] == name]
            return sum(x["seconds"] for x in bl), [x["samples_s"] for x in bl]

        tg, bg = total("gloo")
        tt, bt = total("tidewire")
        samples = a.blocks * a.steps * world * a.batch
        out = {
            "label": a.label,
            "model": a.model,
            "params": sum(p.numel() for p in m_tw.parameters()),
            "world": world,
            "batch_per_rank": a.batch,
            "warmup": a.warmup,
            "steps_per_block": a.steps,
            "blocks": a.blocks,
            "apply": a.apply,
            "sfb": a.sfb,
            "prefetch": a.prefetch,
            "threads": a.threads,
            "lr": a.lr,
            "momentum": a.momentum,
            "seed": a.seed,
            "gloo_samples_s": samples / tg,
            "tidewire_samples_s": samples / tt,
            "ratio": tg / tt,
            "block_samples_s": {"gloo": bg, "tidewire": bt},
            "block_ratio_median": statistics.median(t / g for t, g in zip(bt, bg)),
            "block_times": blocks,
            "rtol": a.rtol,
            "atol": a.atol,
            "allclose": all(r["allclose"] for r in everyone),
            "max_abs_diff": max(r["max_abs_diff"] for r in everyone),
            "allclose_margin": max(r["allclose_margin"] for r in everyone),
            "tidewire_ranks_identical": len({r["tidewire_sha256"] for r in everyone}) == 1,
            "per_rank": everyone,
            "tidewire_stats": tw_stats,
            "torch": torch.__version__,
        }
        print(f"{a.model}: gloo {out['gloo_samples_s']:.1f} samples/s, tidewire {out['tidewire_samples_s']:.1f} "
              f"samples/s, ratio {out['ratio']:.3f}; parameters allclose(rtol={a.rtol:g}, atol={a.atol:g}) "
              f"{out['allclose']} (max abs diff {out['max_abs_diff']:.3e}, max |a-b|/(atol+rtol|b|) {out['allclose_margin']:.3f}); "
              f"tidewire ranks identical {out['tidewire_ranks_identical']}", flush=True)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1, default=str)
    ok = all(r["allclose"] for r in everyone)
    dist.barrier()
    tw.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if ok else 3)


if __name__ == "__main__":
    main()
