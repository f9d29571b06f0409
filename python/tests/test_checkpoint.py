"""Checkpoints (`tidewire train --checkpoint-dir`, the library's
`tidewire::checkpoint`) load with the `safetensors` package: every layer
under its name with its shape and its values (the run's final parameters,
bit for bit, by the run's own digests), the metadata naming the iteration,
and the optimizer state (momentum) complete and right: with SGD momentum
`w_k = w_(k-1) - v_k`, which two consecutive checkpoints must satisfy exactly.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

CLI = os.environ.get("TIDEWIRE_CLI")


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<f4").tobytes()).hexdigest()


def _train(args):
    if not CLI or not Path(CLI).is_file():
        pytest.skip(
            f"TIDEWIRE_CLI={CLI!r} is not the tidewire binary: ci/python.sh builds it "
            "(cargo build --release -p tidewire-cli) and sets TIDEWIRE_CLI"
        )
    out = subprocess.run(
        [CLI, "train", "--json", "--time-scale", "0", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _momentum(step: Path, manifest: dict, name: str, numel: int, model: dict) -> np.ndarray:
    """A layer's momentum: whole in model.safetensors (a worker's SFB layer), or in
    1-D pieces `momentum/{layer}/{first element}` across the servers' files."""
    if f"momentum/{name}" in model:
        return model[f"momentum/{name}"].reshape(-1)
    full = np.full(numel, np.nan, dtype=np.float32)
    covered = 0
    for f in manifest["files"]:
        if not f.startswith("server-"):
            continue
        for key, piece in load_file(str(step / f)).items():
            _, layer, first = key.split("/")
            if layer == name:
                first = int(first)
                assert np.isnan(full[first : first + piece.size]).all(), f"{key} overlaps another piece"
                full[first : first + piece.size] = piece
                covered += piece.size
    assert covered == numel, f"the momentum pieces of {name} cover {covered} of {numel} values"
    return full


@pytest.mark.parametrize("cluster", [["--servers", "2"], ["--colocate"]])
def test_checkpoint_files_load_with_safetensors(tmp_path, cluster):
    d = tmp_path / "ckpt"
    r = _train(
        ["--model", "vgg19-mini", "--workers", "2", *cluster, "--iters", "6", "--verify",
         "--checkpoint-dir", str(d), "--checkpoint-every", "1", "--checkpoint-keep", "2",
         # Poseidon's bytes, whatever this machine's rates: the FC layers go by SFB.
         "--cost-model", "bytes"]
    )
    assert r["verified"] is True
    assert sorted(p.name for p in d.iterdir()) == ["step-00000005", "step-00000006"]
    steps = {k: d / f"step-{k:08d}" for k in (5, 6)}
    manifests = {k: json.loads((s / "manifest.json").read_text()) for k, s in steps.items()}
    models = {k: load_file(str(s / "model.safetensors")) for k, s in steps.items()}
    assert manifests[6]["iteration"] == 6 and manifests[6]["format"] == "tidewire-checkpoint"
    with safe_open(str(steps[6] / "model.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    assert meta["iteration"] == "6" and meta["run"] == manifests[6]["run"], meta
    assert len(r["layers"]) == len(manifests[6]["layers"])
    sfb = 0
    for row, want in zip(r["layers"], r["digests"]):
        name, shape = row["name"], tuple(row["shape"])
        w = models[6][name]
        assert w.dtype == np.float32 and w.shape == shape, (name, w.dtype, w.shape, shape)
        # The last checkpoint holds the run's final parameters, bit for bit.
        assert _digest(w) == want, f"{name}: the checkpoint's values are not the run's"
        # SGD with momentum (Caffe form): w6 = w5 - v6, exactly, in f32.
        v6 = _momentum(steps[6], manifests[6], name, w.size, models[6])
        w5 = models[5][name].reshape(-1)
        assert np.array_equal(w5 - v6, w.reshape(-1)), f"{name}: w6 != w5 - v6"
        assert np.any(v6 != 0), f"{name}: all-zero momentum"
        sfb += row["scheme"] == "sfb"
    assert sfb > 0, "the hybrid run was meant to have SFB layers (their momentum is the worker's)"


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert torch.equal(a[k].view(-1).view(torch.int32) if a[k].dtype == torch.float32 else a[k],
                           b[k].view(-1).view(torch.int32) if b[k].dtype == torch.float32 else b[k]), \
            f"{what}: {k} differs"


@pytest.mark.parametrize("apply,opt", [("server", "momentum"), ("local", "adam")])
def test_a_lost_torch_job_run_again_resumes_where_it_stopped_bitwise(tmp_path, apply, opt):
    """tidewire.torch with checkpoint_dir and resume=True, as a script that
    torchrun's elastic restart runs again: the first run dies (every rank,
    os._exit, no shutdown) after step 7; the second resumes from the
    checkpoint of step 6 and trains to step 10. Its parameters equal an
    uninterrupted run's, bit for bit, and the checkpoint's torch side loads."""
    from conftest import run_ranks

    steps, batch = 10, 16
    plain = {"opt": opt, "apply": apply, "steps": steps, "batch": batch}
    d = tmp_path / "ckpt"
    ck = {"checkpoint_dir": str(d), "checkpoint_every": 3, "resume": True}
    want = run_ranks(tmp_path, 2, {"scenario": "multi", "runs": {"a": plain}}, timeout=120).results()
    lost = run_ranks(tmp_path, 2, {"scenario": "multi", "runs": {"a": {**plain, "checkpoint": ck, "die_after": 7}}},
                     timeout=120, check=False)
    assert lost.codes == [17, 17], lost.log()
    assert sorted(p.name for p in d.iterdir()) == ["step-00000003", "step-00000006"]
    step = d / "step-00000006"
    state = torch.load(step / "framework.bin", weights_only=False)
    assert state["step"] == 6 and set(state) == {"step", "model", "optimizer"}
    model = load_file(str(step / "model.safetensors"))
    assert all(v.dtype == np.float32 for v in model.values()) and model
    again = run_ranks(tmp_path, 2, {"scenario": "multi", "runs": {"a": {**plain, "checkpoint": ck}}},
                      timeout=120).results()
    for r in (0, 1):
        assert again[r]["a"]["start_step"] == 6 and again[r]["a"]["resumed_from"] == str(step)
        _bitwise(want[r]["a"]["state"], again[r]["a"]["state"], f"rank {r}: resumed vs uninterrupted")
    if apply == "server":
        # model.safetensors holds the servers' parameters after step 6: each
        # layer (a module's parameters, back to back) equals the torch side's.
        torch_side = state["model"]
        layers = [n for n in model if not n.startswith("momentum/")]
        assert layers
        for name in layers:
            flat = np.concatenate(
                [t.numpy().ravel() for k, t in torch_side.items() if k.rsplit(".", 1)[0] == name])
            assert np.array_equal(flat.view(np.int32), model[name].ravel().view(np.int32)), name


def test_torchrun_elastic_restart_resumes_from_the_newest_checkpoint(tmp_path):
    """The real thing: `torchrun --max-restarts 1` runs the script; on the first
    attempt every rank dies after step 7 (os._exit), torchrun's agent starts
    them again, and with resume=True they go on from the checkpoint of step 6,
    ending bitwise where an uninterrupted run ends."""
    import random
    import sys

    from conftest import HERE, base_env, run_ranks

    steps, batch = 10, 16
    plain = {"opt": "momentum", "apply": "server", "steps": steps, "batch": batch}
    want = run_ranks(tmp_path, 2, {"scenario": "multi", "runs": {"a": plain}}, timeout=120).results()
    d = tmp_path / "ckpt"
    ck = {"checkpoint_dir": str(d), "checkpoint_every": 3, "resume": True}
    cfg = {"scenario": "multi",
           "runs": {"a": {**plain, "checkpoint": ck, "die_after": 7, "die_on_first_attempt_only": True}}}
    out = tmp_path / f"out-elastic-{random.randrange(1 << 30)}"
    out.mkdir()
    env = base_env()
    env.update(TIDEWIRE_SECRET="pytest-elastic", TW_TEST=json.dumps(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(HERE / "_worker.py"), str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    got = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in (0, 1):
        assert got[r]["a"]["start_step"] == 6, got[r]["a"]["start_step"]
        _bitwise(want[r]["a"]["state"], got[r]["a"]["state"], f"rank {r}: after the elastic restart")
