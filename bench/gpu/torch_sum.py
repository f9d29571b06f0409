#!/usr/bin/env python3
"""torch's equivalents of `tidewire bench aggregate`'s GPU sum, on the same GPU
in the same run: P inputs of MiB each summed into an f32 accumulator.

  stacked   torch.sum(X, dim=0, out=acc) over a contiguous [P, N] tensor
            (reads P*N, writes N: less traffic than ours, which also reads acc)
  inplace   acc.add_(x) for each input (P passes over acc)
  accumulate  torch.sum(X, dim=0, out=tmp) then acc.add_(tmp): acc += sum, ours
            with init false (the aggregator's operation after the first input)

`stacked` is the same operation as ours with init (acc = x0 + ... + x(P-1));
`accumulate` the same as ours without. ci/gpu-bench.sh compares time per sum,
operation for operation.

Prints one JSON object: GB/s counted as tidewire counts its own kernel,
(P+2)*N*4 bytes per sum, and the time per sum in ms, so the ratio can be
taken either way. Timed with CUDA events, best of --reps.
"""
import argparse
import json

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--inputs", type=int, default=8)
ap.add_argument("--mib", type=int, default=64)
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()
n = a.mib << 18
dev = torch.device("cuda:0")
X = torch.stack([torch.full((n,), 1e-3 * (p + 1), device=dev) for p in range(a.inputs)])
xs = [X[p].clone() for p in range(a.inputs)]
acc = torch.zeros(n, device=dev)
tmp = torch.zeros(n, device=dev)


def best_ms(f, inner=10):
    f()
    torch.cuda.synchronize()
    out = []
    for _ in range(a.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            f()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / inner)
    return min(out)


def inplace():
    for x in xs:
        acc.add_(x)


def accumulate():
    torch.sum(X, dim=0, out=tmp)
    acc.add_(tmp)


stacked_ms = best_ms(lambda: torch.sum(X, dim=0, out=acc))
inplace_ms = best_ms(inplace)
accumulate_ms = best_ms(accumulate)
bytes_ = (a.inputs + 2) * n * 4
print(json.dumps({
    "device": torch.cuda.get_device_name(0),
    "torch": torch.__version__,
    "inputs": a.inputs, "mib": a.mib,
    "stacked_ms": stacked_ms, "inplace_ms": inplace_ms, "accumulate_ms": accumulate_ms,
    "stacked_gbps_as_ours": bytes_ / stacked_ms / 1e6,
    "inplace_gbps_as_ours": bytes_ / inplace_ms / 1e6,
}))
