#!/usr/bin/env python3
"""The main job on a machine shared with a real neighbour, ours and PyTorch FSDP's alike: does
our lead hold when other work runs on the same cores?

For each neighbour it starts the neighbour, waits `--settle` seconds, then runs PyTorch's main
job (tools/nlp_example_pytorch.py, no evaluation to speak of) and ours (`fsdp launch` of
nlp_example with the same arguments) one after the other, `--steps` optimizer steps each, and
stops the neighbour (the process group this script started for it, nothing else). Neighbours:

* `none`: the quiet machine, the figure to compare with;
* `job`: a second `fsdp launch` of the main job, 2 processes, running for as long as needed;
* `build`: `cargo build --release -p fsdp-nn` into a scratch target folder, restarted when it
  finishes (a compiler's processes and their memory traffic).

Prints each run's samples/s, the share of its quiet figure and ours / PyTorch, and one JSON line
at the end. Not run by CI: needs `pip install torch transformers`, the assets of
tools/fetch-test-assets.sh and release builds of `fsdp` and the examples. From the repository
root:

    python3 tools/bench_shared_machine.py --ours target/release/fsdp --steps 60
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

EXAMPLE = "target/release/examples/nlp_example"


def start_neighbour(kind, ours, scratch):
    """The neighbour's process (a session of its own), or None for `none`."""
    if kind == "none":
        return None
    if kind == "job":
        cmd = [ours, "launch", "--num_processes", "2", "--main_process_port", "0", EXAMPLE,
               "--num_epochs", "50", "--output_dir", os.path.join(scratch, "neighbour-job")]
    elif kind == "build":
        target = os.path.join(scratch, "neighbour-target")
        cmd = ["bash", "-c", f"while true; do rm -rf '{target}'; "
               f"cargo build -q --release -p fsdp-nn --target-dir '{target}'; done"]
    else:
        sys.exit(f"unknown neighbour {kind!r}: none, job or build")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop_neighbour(proc):
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_pytorch(a):
    out = subprocess.run(
        [sys.executable, "tools/nlp_example_pytorch.py", "--max_train_steps", str(a.steps),
         "--max_eval_samples", "32", "--port", str(a.port)],
        capture_output=True, text=True, check=True).stdout
    line = [l for l in out.splitlines() if l.startswith("RESULT pytorch ")][-1]
    return json.loads(line[len("RESULT pytorch "):])["samples_per_s"]


def run_ours(a, scratch):
    out = subprocess.run(
        [a.ours, "launch", "--num_processes", "2", "--main_process_port", "0", EXAMPLE,
         "--max_train_steps", str(a.steps), "--max_eval_samples", "32",
         "--output_dir", tempfile.mkdtemp(prefix="ours-", dir=scratch)],
        capture_output=True, text=True, check=True).stdout
    line = [l for l in out.splitlines() if ": trained " in l][-1]
    return float(re.search(r"\(([\d.]+) samples/s\)", line).group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ours", required=True, help="path to the fsdp binary")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds the neighbour runs before the measured runs start")
    p.add_argument("--neighbours", default="none,job,build")
    p.add_argument("--port", type=int, default=29671, help="PyTorch's rendezvous port")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp-shared-") as scratch:
        for kind in a.neighbours.split(","):
            neighbour = start_neighbour(kind, a.ours, scratch)
            try:
                time.sleep(a.settle if neighbour else 0)
                torch_rate = run_pytorch(a)
                ours_rate = run_ours(a, scratch)
            finally:
                stop_neighbour(neighbour)
            rows.append({"neighbour": kind, "pytorch": torch_rate, "ours": ours_rate})
    quiet = next((r for r in rows if r["neighbour"] == "none"), None)
    for r in rows:
        r["ratio"] = r["ours"] / r["pytorch"]
        if quiet:
            r["pytorch_share_of_quiet"] = r["pytorch"] / quiet["pytorch"]
            r["ours_share_of_quiet"] = r["ours"] / quiet["ours"]
        shares = (f", of quiet: PyTorch {r['pytorch_share_of_quiet']:.0%}, ours "
                  f"{r['ours_share_of_quiet']:.0%}" if quiet else "")
        print(f"{r['neighbour']:>6}: PyTorch {r['pytorch']:.1f}, ours {r['ours']:.1f} samples/s "
              f"= {r['ratio']:.2f}x{shares}")
    print(json.dumps({"benchmark": "shared_machine", "steps": a.steps, "settle_s": a.settle,
                      "rows": rows}))


if __name__ == "__main__":
    main()
