#!/usr/bin/env python3
"""Reads a run folder's TensorBoard event files with TensorBoard's own loader
(`EventAccumulator`, what `tensorboard --logdir` uses: it checks every record's CRC) and
prints one JSON object: {"scalars": {tag: [[step, value], ...]}, "text": {tag: text}}.
Needs `pip install tensorboard`.

    python3 tools/read_tensorboard.py target/nlp_example/runs/<time>
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run: str) -> None:
    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]}
    text = {}
    for t in tags["tensors"]:
        for e in acc.Tensors(t):
            text[t] = b"".join(e.tensor_proto.string_val).decode()
    print(json.dumps({"scalars": scalars, "text": text}))


if __name__ == "__main__":
    main(sys.argv[1])
