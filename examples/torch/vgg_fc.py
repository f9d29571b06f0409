#!/usr/bin/env python3
"""vgg_fc.py - throughput of a VGG-style model with a large fully connected head,
trained data-parallel with Tidewire on generated 32x32 images (seeded).

    torchrun --nproc-per-node 4 examples/torch/vgg_fc.py
    torchrun --nproc-per-node 4 examples/torch/vgg_fc.py --model conv

Models (both take 3x32x32 images, 10 classes):

  fc    VGG's shape at CIFAR scale: conv3-32, pool, conv3-64, pool, conv3-64, pool
        (4x4x64 = 1024 features), then FC 1024-4096, FC 4096-4096, FC 4096-10.
        21.1 M parameters, 99.7% of them in the FC layers (VGG19's fc6/fc7/fc8
        hold 86% of its 144 M). One step at 32 images per rank takes about
        0.15 s on one core of this 2-core machine, so four ranks share the
        cores and a run of a few dozen steps finishes in a minute or two,
        while the gradient (84 MB) is the size at which the network, not the
        CPU, decides the step time at 1 GbE. A 4096x4096 layer's gradient
        is 16.8 M values; its sufficient factors at K = 32 are 32x(4096+4096)
        = 262 k values per rank, so SFB (Poseidon) sends ~1/64 of the
        bytes a parameter server or a ring all-reduce sends for it.
  conv  the convolution-heavy contrast: conv3-32, conv3-32, pool, conv3-64,
        conv3-64, pool, conv3-128, pool, FC 2048-10: 0.16 M parameters and
        about 0.09 s per step at K = 32 on one core, so the step time is compute.

The data: a fixed random template per class (seed), and each sample is its
class's template plus unit Gaussian noise, drawn from a generator seeded by
(seed, step, rank); the loss goes down, so a broken update shows.
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 10


def build_model(kind="fc", fc_width=4096):
    """The two models of the module docstring (fc_width sets the FC head's width)."""
    if kind == "fc":
        cfg, head = [32, "M", 64, "M", 64, "M"], [64 * 4 * 4, fc_width, fc_width, CLASSES]
    elif kind == "conv":
        cfg, head = [32, 32, "M", 64, 64, "M", 128, "M"], [128 * 4 * 4, CLASSES]
    else:
        raise ValueError(f"model {kind!r}: fc or conv")
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    layers.append(nn.Flatten())
    for i, (m_in, m_out) in enumerate(zip(head, head[1:])):
        layers.append(nn.Linear(m_in, m_out))
        if i < len(head) - 2:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class Data:
    """Seeded synthetic images: batch(step, rank) is the same in every process and run."""

    def __init__(self, seed, batch):
        self.seed, self.batch = seed, batch
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(CLASSES, 3, 32, 32, generator=g)

    def get(self, step, rank):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1009 + rank)
        y = torch.randint(0, CLASSES, (self.batch,), generator=g)
        x = self.templates[y] + torch.randn(self.batch, 3, 32, 32, generator=g)
        return x, y


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["fc", "conv"], default="fc")
    p.add_argument("--fc-width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (K)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--apply", choices=["local", "server"], default="local")
    p.add_argument("--sfb", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--prefetch", action="store_true", help="DistributedOptimizer(prefetch=True)")
    return p.parse_args()


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    import tidewire.torch as tw

    tw.init()
    rank, world = tw.rank(), tw.size()
    torch.manual_seed(a.seed)
    model = build_model(a.model, a.fc_width)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    opt = tw.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model,
                                  apply=a.apply, sfb={"auto": "auto", "true": True, "false": False}[a.sfb],
                                  consistency="bsp", prefetch=a.prefetch, batch_size=a.batch)
    tw.broadcast_parameters(model.state_dict(), root_rank=0)
    tw.broadcast_optimizer_state(opt, root_rank=0)
    data = Data(a.seed, a.batch)
    n_params = sum(p.numel() for p in model.parameters())
    say = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)
    say(f"vgg_fc: model {a.model} ({n_params / 1e6:.2f} M parameters), {world} processes x {a.batch} samples, "
        f"apply={a.apply} sfb={a.sfb} prefetch={a.prefetch}, {a.threads} torch thread(s) each")

    t0 = t_last = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            tw.barrier()
            t0 = t_last = time.perf_counter()
        x, y = data.get(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step >= a.warmup and (step - a.warmup + 1) % 10 == 0:
            now = time.perf_counter()
            say(f"step {step + 1:4d}  loss {loss.item():.4f} (rank 0)  {10 * world * a.batch / (now - t_last):8.1f} samples/s")
            t_last = now
    schemes = opt.tidewire_stats()["schemes"]
    opt.close()  # pulls every layer (with prefetch the last step's may be in flight), ends the session
    dt = time.perf_counter() - t0
    say(f"{a.steps} steps in {dt:.2f} s: {a.steps * world * a.batch / dt:.1f} samples/s "
        f"({world} processes, {dt / a.steps * 1000:.0f} ms per step)")
    say("schemes: " + ", ".join(f"{k} {v}" for k, v in schemes.items()))
    tw.shutdown()


if __name__ == "__main__":
    main()
