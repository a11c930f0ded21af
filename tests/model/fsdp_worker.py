"""Run under ``torchrun`` by tests/model/test_distributed.py: several FSDP and DDP training runs in one process group.

Usage: ``torchrun --standalone --nproc-per-node 2 tests/model/fsdp_worker.py RUNS.json``, where the file
holds a list of config dicts (TrainConfig keys; ``fsdp`` is set here unless the run sets ``ddp``). Runs go in order, so a
resume follows the run it continues. Rank 0 writes each run's files; nothing else is written.
"""

from __future__ import annotations

import json
import sys

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.model.distributed import close_distributed
from segmented_checkpointing.engine.train.loop import train


def main(path: str) -> None:
    for values in json.loads(open(path, encoding="utf-8").read()):
        config, ignored = TrainConfig.from_dict(values if values.get("ddp") else {**values, "fsdp": True})
        assert not ignored, ignored
        train(config, log=lambda line: None)
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
