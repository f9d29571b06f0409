#!/usr/bin/env python3
"""digits.py - a small MLP on scikit-learn's bundled handwritten digits (8x8,
1797 images, no download), trained data-parallel by N processes with Tidewire.

    torchrun --nproc-per-node 4 examples/torch/digits.py
    python examples/torch/digits.py --procs 1          # the same run in one process, plain torch

Each step takes one global batch (--global-batch, default 64) of a permutation
that depends only on the seed and the epoch; rank r trains on the r-th of N
equal slices of it, so N processes see exactly the samples one process sees.
Tidewire averages the gradients (BSP) and the wrapped torch optimizer applies
them (apply='local'), or the servers apply SGD (--apply server).

--deterministic-check writes a JSON file (--out) with the loss of every step
(the global mean: each rank's slice mean, averaged over the ranks with
tw.push_pull), the final test accuracy, and a SHA-256 of the final parameters
of every rank. examples/torch/check_digits.sh runs it with 4 processes and
with --procs 1 and compares the two.

--comm-every T / --comm-mode accumulate|average / --quality-guided use Nexus's
communication frequency (DistributedOptimizer's comm_every, comm_mode and
quality_guided; each rank reports its loss with opt.report_quality), and
--record writes the test accuracy per epoch, T per step and the exchanges:
examples/torch/freq_experiment.sh compares T = 1, the quality-guided T and a
fixed, aggressive T this way.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks (a multiple of N)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--apply", choices=["local", "server"], default="local",
                   help="local: servers average, the torch optimizer applies; server: servers apply SGD")
    p.add_argument("--sfb", default="auto", choices=["auto", "true", "false"],
                   help="sufficient-factor broadcast for the nn.Linear layers (auto: Poseidon's cost model)")
    p.add_argument("--prefetch", action="store_true", help="P3 prefetch (with --apply server): step() does not wait")
    p.add_argument("--procs", type=int, default=None,
                   help="1: run the whole job in this process (the reference); default: the launcher's world")
    p.add_argument("--ref-backend", choices=["torch", "tidewire"], default="torch",
                   help="with --procs 1: plain torch, or Tidewire with a world of one")
    p.add_argument("--deterministic-check", action="store_true",
                   help="deterministic algorithms, and write the loss curve and parameter hashes to --out")
    p.add_argument("--out", default="digits.json", help="the JSON file --deterministic-check writes (rank 0)")
    g = p.add_argument_group("communication frequency (Nexus; with --apply local)")
    g.add_argument("--comm-every", type=int, default=1, help="exchange every T steps (default 1: every step)")
    g.add_argument("--comm-mode", choices=["accumulate", "average"], default="accumulate",
                   help="between exchanges: sum the gradients (accumulate) or step locally and average the models")
    g.add_argument("--quality-guided", action="store_true",
                   help="adjust T by the training loss (opt.report_quality each step)")
    g.add_argument("--comm-every-max", type=int, default=16, help="largest T the adjustment proposes")
    g.add_argument("--quality-period", type=int, default=4, help="exchanges per measurement window")
    g.add_argument("--quality-tolerance", type=float, default=0.02, help="relative loss increase that rejects")
    g.add_argument("--quality-revert-at", type=float, default=0.85,
                   help="back to --comm-every from this fraction of the run's steps on (default 0.85)")
    g.add_argument("--record", default=None,
                   help="write a JSON record (rank 0): per-epoch test accuracy, loss, T and exchanges")
    return p.parse_args()


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def load_data(seed):
    """Train/test split of load_digits, standardized by the training set's statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    f = lambda a: torch.from_numpy(((a - mu) / sd).astype(np.float32))
    return f(xtr), torch.from_numpy(ytr).long(), f(xte), torch.from_numpy(yte).long()


def params_sha256(model):
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    a = parse_args()
    if a.deterministic_check:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    single = a.procs == 1
    tw = None
    if single and a.ref_backend == "tidewire":
        # A world of one, without a launcher.
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    if not single or a.ref_backend == "tidewire":
        import tidewire.torch as tw

        tw.init()
    rank, world = (tw.rank(), tw.size()) if tw else (0, 1)
    if a.procs is not None and a.procs != world:
        sys.exit(f"--procs {a.procs}, but the launcher started {world} processes")
    if a.global_batch % world:
        sys.exit(f"--global-batch {a.global_batch} is not a multiple of {world} processes")
    b = a.global_batch // world

    xtr, ytr, xte, yte = load_data(a.seed)
    model = MLP(a.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    steps = len(xtr) // a.global_batch  # the last, short batch is dropped: every step has the same size
    comm = a.comm_every > 1 or a.comm_mode != "accumulate" or a.quality_guided
    if tw:
        sfb = {"auto": "auto", "true": True, "false": False}[a.sfb]
        extra = {}
        if comm:
            sfb = False
            extra = dict(comm_every=a.comm_every, comm_mode=a.comm_mode, quality_guided=a.quality_guided,
                         comm_every_max=max(a.comm_every_max, a.comm_every), quality_period=a.quality_period,
                         quality_tolerance=a.quality_tolerance,
                         quality_revert_at=int(a.quality_revert_at * steps * a.epochs))
        opt = tw.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                                      apply=a.apply, sfb=sfb, consistency="bsp", prefetch=a.prefetch,
                                      batch_size=b, **extra)
        tw.broadcast_parameters(model.state_dict(), root_rank=0)
        tw.broadcast_optimizer_state(opt, root_rank=0)

    say = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)
    mode = f"tidewire, {world} processes" if tw else "plain torch, 1 process"
    say(f"digits: {len(xtr)} train / {len(xte)} test, MLP 64-{a.hidden}-{a.hidden}-10, {mode}, "
        f"global batch {a.global_batch} ({b} per rank), {steps} steps per epoch, apply={a.apply} sfb={a.sfb}")
    schemes = opt.tidewire_stats().get("schemes") if tw and hasattr(opt, "tidewire_stats") else None
    if schemes:
        say("schemes: " + ", ".join(f"{k} {v}" for k, v in schemes.items()))
    losses = []
    record = {"epochs": [], "t_per_step": []}
    # The global mean loss costs one push_pull per step: for the deterministic check, or
    # when every step exchanges anyway (with a communication frequency, rank 0's own loss).
    global_loss = tw and world > 1 and (a.deterministic_check or not comm)
    t0 = time.time()
    for epoch in range(a.epochs):
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(a.seed * 1000 + epoch))
        epoch_loss = 0.0
        for s in range(steps):
            idx = perm[s * a.global_batch:(s + 1) * a.global_batch][rank * b:(rank + 1) * b]
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            if tw and a.quality_guided:
                opt.report_quality(loss)
            if tw and comm:
                record["t_per_step"].append(opt.tidewire_stats()["comm_every"])
            opt.step()
            g = loss.detach().reshape(1).clone()
            if global_loss:
                g = tw.push_pull(g, average=True)
            losses.append(g.item())
            epoch_loss += g.item()
        acc_e = accuracy(model, xte, yte)
        st = opt.tidewire_stats() if tw else {}
        record["epochs"].append({"epoch": epoch + 1, "loss": epoch_loss / steps, "test_accuracy": acc_e,
                                 "exchanges": st.get("exchanges"), "comm_every": st.get("comm_every")})
        say(f"epoch {epoch + 1:3d}  loss {epoch_loss / steps:.4f}  test accuracy {acc_e:.4f}  "
            + (f"T {st['comm_every']} exchanges {st['exchanges']}  " if comm and st else "")
            + f"({time.time() - t0:.1f} s)")
    if tw:
        if comm:
            opt.flush()  # the steps since the last exchange: every replica ends equal
        st = opt.tidewire_stats()
        say(f"steps {st['steps']}, exchanges {st['exchanges']}, session pushes {st['pushes']}")
        record["stats"] = {k: st[k] for k in ("steps", "exchanges", "pushes", "comm_every", "rx_direct_bytes", "rx_copied_bytes") if k in st}
        record["freq_history"] = st.get("freq_history")
        record["freq_memory"] = {str(k): v for k, v in (st.get("freq_memory") or {}).items()}
    if tw:
        # Pull every layer and end the optimizer's session, so the parameters are final (with
        # prefetch, step() returns before the servers' values are back). Note: synchronize() is for
        # the window between backward and step(); called after step() it syncs a stale gradient.
        opt.close()
    acc = accuracy(model, xte, yte)
    if a.record and rank == 0:
        record.update({"procs": world, "comm_every": a.comm_every, "comm_mode": a.comm_mode,
                       "quality_guided": a.quality_guided, "comm_every_max": a.comm_every_max,
                       "quality_period": a.quality_period, "quality_tolerance": a.quality_tolerance,
                       "quality_revert_at": a.quality_revert_at, "epochs_n": a.epochs, "seed": a.seed,
                       "lr": a.lr, "momentum": a.momentum, "global_batch": a.global_batch,
                       "final_test_accuracy": acc, "loss": losses, "torch": torch.__version__})
        os.makedirs(os.path.dirname(os.path.abspath(a.record)), exist_ok=True)
        with open(a.record, "w") as f:
            json.dump(record, f, indent=1)
        say(f"wrote {a.record}")
    say(f"final test accuracy {acc:.4f} ({world} processes, {a.epochs} epochs, {time.time() - t0:.1f} s)")

    if a.deterministic_check:
        mine = params_sha256(model)
        # Every rank's hash reaches rank 0 through Tidewire: rank r puts its 32 digest bytes
        # in row r of a zero matrix, and push_pull sums the rows (small integers: exact in float32).
        hashes = [mine]
        if tw and world > 1:
            m = torch.zeros(world, 32)
            m[rank] = torch.tensor(list(bytes.fromhex(mine)), dtype=torch.float32)
            m = tw.push_pull(m, average=False)
            hashes = [bytes(int(v) for v in row.tolist()).hex() for row in m]
            if hashes[rank] != mine:
                sys.exit(f"rank {rank}: its own hash came back altered from push_pull ({hashes[rank]} != {mine})")
        if rank == 0:
            out = {
                "procs": world,
                "backend": "tidewire" if tw else "torch",
                "apply": a.apply if tw else None,
                "sfb": a.sfb if tw else None,
                "schemes": schemes,
                "prefetch": a.prefetch if tw else None,
                "global_batch": a.global_batch,
                "epochs": a.epochs,
                "steps": len(losses),
                "seed": a.seed,
                "lr": a.lr,
                "momentum": a.momentum,
                "loss": losses,
                "test_accuracy": acc,
                "param_sha256": hashes,
                "torch": torch.__version__,
            }
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
            say(f"wrote {a.out}")
    if tw:
        tw.shutdown()


if __name__ == "__main__":
    main()
