#!/usr/bin/env python3
"""A run that moves from PyTorch + Accelerate to fsdp-rs and back, and ends where PyTorch
alone does. The tiny BERT of `make_accelerate_resume_fixture.py` (same model, optimizer,
batches):

1. fsdp-rs loads Accelerate's FSDP2 checkpoint of step 3
   (`crates/fsdp/tests/data/accelerate_resume/fsdp2/checkpoint`), trains steps 4-6 on 2
   processes and saves with `fsdp_checkpoint_format: torch-dcp`, with a constant schedule's
   state at step 6 (the ignored test
   `checkpoint_torch_dcp::writes_the_checkpoint_for_the_roundtrip_fixture`, run here
   through cargo);
2. PyTorch + Accelerate, with FSDP1 and with FSDP2 on 2 CPU processes, `accelerator.load_state`
   of those files (the schedule's step restored into a prepared LambdaLR) and trains steps 7-9;
3. PyTorch alone trains steps 1-9 (FSDP2), for comparison.

FSDP2 continues exactly as fsdp-rs does and ends where PyTorch alone does. FSDP1's
`load_state` (Accelerate 1.15, PyTorch 2.15) leaves the optimizer without state — with
Accelerate's own FSDP1 checkpoints too — so from step 8 on its run differs (recorded:
`rank0_params_with_state_after_load`).

    python3 tools/make_accelerate_roundtrip_fixture.py crates/fsdp/tests/data/accelerate_roundtrip

writes OUT/expected.json (the length and CRC-32 of every file fsdp-rs wrote, which the test
checks it still writes; the losses of steps 7-9 for FSDP1 and FSDP2; all 9 losses of fsdp-rs's
part and of PyTorch alone) and OUT/fsdpN/final.safetensors (weights after step 9). Not run by
CI: needs `pip install torch==2.15.0 accelerate==1.15.0 transformers==5.24.0`.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_accelerate_resume_fixture import prepare, save_weights, train_step  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(out):
    """fsdp-rs's steps 4-6 from Accelerate's checkpoint, saved as DCP into `out`."""
    env = dict(os.environ, FSDP_DCP_FIXTURE_OUT=out)
    test = "checkpoint_torch_dcp::writes_the_checkpoint_for_the_roundtrip_fixture"
    run = subprocess.run(["cargo", "test", "-q", "-p", "fsdp", "--test", "integration", "--", "--ignored",
                          "--exact", test, "--nocapture"], cwd=REPO, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(run.stdout + run.stderr)
    line = next(l for l in run.stdout.splitlines() if l.startswith("OURS "))
    return json.loads(line[len("OURS "):])["losses"]


def digests(root):
    """Every file under `root`: its length and CRC-32, as the Rust test prints them."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            data = open(path, "rb").read()
            out[os.path.relpath(path, root)] = f"{len(data)} bytes, crc32 {zlib.crc32(data):08x}"
    return dict(sorted(out.items()))


def state_entries(optimizer):
    """How many of this rank's parameters have optimizer state."""
    return sum(1 for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p))


def continue_worker(rank, checkpoint, out, version):
    acc, model, optimizer = prepare(rank, version, 29675 + version)
    # fsdp-rs saved a constant schedule at step 6: PyTorch reads it as this LambdaLR's state.
    scheduler = acc.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    acc.load_state(checkpoint)
    assert scheduler.scheduler.last_epoch == 6, scheduler.scheduler.last_epoch
    assert scheduler.scheduler.base_lrs == [1e-3, 1e-3], scheduler.scheduler.base_lrs
    # FSDP1's load_state leaves the optimizer without state (here, and with Accelerate's own
    # FSDP1 checkpoints alike): its run then continues with fresh Adam moments and steps.
    loaded = state_entries(optimizer)
    losses = [train_step(acc, model, optimizer, step, rank) for step in range(6, 9)]
    save_weights(acc, model, f"{out}/final.safetensors")
    if rank == 0:
        json.dump({"losses": losses, "rank0_params_with_state_after_load": loaded},
                  open(f"{out}/losses.json", "w"))


def alone_worker(rank, out):
    acc, model, optimizer = prepare(rank, 2, 29679)
    losses = [train_step(acc, model, optimizer, step, rank) for step in range(9)]
    save_weights(acc, model, f"{out}/final.safetensors")
    if rank == 0:
        json.dump(losses, open(f"{out}/losses.json", "w"))


def max_difference(a, b):
    from safetensors.torch import load_file
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys()
    return max(float(((a[k] - b[k]).abs() / b[k].abs().clamp(min=1.0)).max()) for k in a)


def main(root):
    work = tempfile.mkdtemp()
    checkpoint = os.path.join(work, "ours")
    expected = {"ours": ours(checkpoint), "files": digests(checkpoint)}
    for version in (1, 2):
        out = os.path.join(root, f"fsdp{version}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        mp.spawn(continue_worker, args=(checkpoint, out, version), nprocs=2)
        expected[f"fsdp{version}"] = json.load(open(f"{out}/losses.json"))
        os.remove(f"{out}/losses.json")
    alone = os.path.join(work, "alone")
    os.makedirs(alone)
    mp.spawn(alone_worker, args=(alone,), nprocs=2)
    expected["pytorch_alone"] = {"losses": json.load(open(f"{alone}/losses.json"))}
    json.dump(expected, open(os.path.join(root, "expected.json"), "w"), indent=1)
    print("steps 7-9: PyTorch after fsdp-rs (FSDP1, FSDP2) and PyTorch alone:")
    for i in range(3):
        print(f"  step {i + 7}: {expected['fsdp1']['losses'][i]:.9f} {expected['fsdp2']['losses'][i]:.9f}"
              f" {expected['pytorch_alone']['losses'][i + 6]:.9f}")
    print("fsdp-rs steps 4-9:", expected["ours"], "PyTorch alone:", expected["pytorch_alone"]["losses"][3:])
    for version in (1, 2):
        print(f"FSDP{version}: rank 0's parameters with optimizer state after load_state:",
              expected[f"fsdp{version}"]["rank0_params_with_state_after_load"])
        d = max_difference(os.path.join(root, f"fsdp{version}", "final.safetensors"),
                           os.path.join(alone, "final.safetensors"))
        print(f"FSDP{version}: weights after step 9 within {d:.2e} of PyTorch alone")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(sys.argv[1])
