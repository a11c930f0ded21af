"""Part (i) of the GPU check (``bench/gpu_check.py``): DDP and FSDP2 on 2 GPUs, as LoRA users run them.

One ``torchrun --standalone --nproc-per-node 2`` job (NCCL on CUDA) trains the same run under ``--ddp``
and under ``--fsdp``, per-block checkpointing, batch 1 per process; the same config trains in this
process at batch 2 (the global batch, one GPU). Per column: sec/step (median after the warm-up),
rank 0's peak (``max_memory_allocated``, weights included: the per-rank peak), the largest loss
difference to the one-process run over every step (fp32 base and compute, so the difference is the
batch split's summation order only; pass <= 1e-4 relative) and the ratios to the one-process run.
The model: a mid-size Flux (4 double + 8 single blocks, width 1024; ``gpu_check.MID``) saved as a
diffusers transformer folder and loaded by each process, at 512 px, rank-16 LoRA.

The arena ratio of the issue's part (i) (pinned bytes allocated / bytes used, full-size Flux.1-dev
streamed) is the ``arena`` column of part (f), which streams that base through the trainer.

Needs 2 CUDA devices; with fewer it says so and runs nothing. ``--smoke`` (CPU, CI): 2 gloo
processes on the tiny Flux preset at 64 px, the same code path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

NPROC = 2
TOLERANCE = 1e-4
"""Largest loss difference to the one-process run, relative to its loss."""


def settings(smoke: bool, folder: Path, mid: dict) -> dict:
    """The TrainConfig keys shared by every column (the model saved under ``folder`` on a GPU)."""
    common = {"batch_size": 2, "steps": 4, "timing_warmup_steps": 1, "watchdog_slowdown": 0, "seed": 0,
              "lora_rank": 16, "lora_alpha": 16, "guardrails": None, "mixed_precision": "fp32",
              "base_model_precision": "fp32", "learning_rate": 1e-4}
    if smoke:
        return {**common, "family": "flux", "resolution": 64, "device": "cpu", "lora_rank": 4, "lora_alpha": 4,
                "steps": 3}
    import diffusers

    from segmented_checkpointing.engine.model.bundle import tiny_vae_config
    torch.manual_seed(0)
    diffusers.FluxTransformer2DModel(**{**mid, "guidance_embeds": False}).save_pretrained(folder / "transformer")
    diffusers.AutoencoderKL(**tiny_vae_config(16)).save_pretrained(folder / "vae")
    return {**common, "model_path": str(folder / "transformer"), "vae_path": str(folder / "vae"), "resolution": 512,
            "device": "cuda"}


def multi_gpu_check(smoke: bool, mid: dict, log) -> tuple[list[str], bool]:
    """Part (i) (see the module docstring): ``(markdown rows, passed)``; ``mid`` is the mid-size Flux
    config. Without 2 CUDA devices (and not ``smoke``): a row that says so, and passed."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not smoke and gpus < NPROC:
        return [f"**Not run**: this machine has {gpus} CUDA device(s); DDP and FSDP2 need {NPROC}. "
                "No multi-GPU figure is claimed."], True
    from segmented_checkpointing.engine.config import TrainConfig
    from segmented_checkpointing.engine.train.loop import train

    rows = ["| column | processes x batch | sec/step | per-rank peak | largest loss difference | time / peak vs one "
            "process |", "|---|---|---:|---:|---:|---:|"]
    unit, scale = ("MiB", 2**20) if smoke else ("GiB", 2**30)
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-multi-") as tmp:
        folder = Path(tmp)
        common = settings(smoke, folder, mid)
        log("  one process, batch 2 ...")
        train(TrainConfig.from_dict({**common, "output": str(folder / "one")})[0], log=lambda line: None)
        runs = [{**common, "batch_size": 1, kind: True, "output": str(folder / kind)} for kind in ("ddp", "fsdp")]
        (folder / "runs.json").write_text(json.dumps(runs))
        log(f"  torchrun, {NPROC} processes: ddp, fsdp ...")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(NPROC), __file__, "--worker", str(folder / "runs.json")],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            return [f"**FAILED**: torchrun exited {proc.returncode}: "
                    f"{(proc.stderr or proc.stdout).strip().splitlines()[-1][:300]}"], False
        one = _figures(folder / "one")
        ok = True
        for name, kind in (("one process", "one"), ("DDP", "ddp"), ("FSDP2", "fsdp")):
            cell = _figures(folder / kind)
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(cell["losses"], one["losses"]))
            ok &= diff <= TOLERANCE and len(cell["losses"]) == len(one["losses"])
            shape = "1 x 2" if kind == "one" else f"{NPROC} x 1"
            rows.append(f"| {name} | {shape} | {cell['sec']:.3f} | {cell['peak'] / scale:.3f} {unit} | {diff:.1e} | "
                        f"{cell['sec'] / one['sec']:.2f}x / {cell['peak'] / one['peak']:.2f}x |")
    rows += ["", f"Losses of every step against the one-process run: {'pass' if ok else 'FAIL'} (<= {TOLERANCE:g} "
             "relative). SimpleTuner measured DDP 3-6x ahead of FSDP2 for a LoRA on 8x H100 (documentation/FSDP2.md)."]
    return rows, ok


def _figures(folder: Path) -> dict:
    report = json.loads((folder / "report.json").read_text())
    return {"losses": [step["loss"] for step in report["steps"]], "sec": report["totals"]["sec_per_step"],
            "peak": report["totals"]["peak_bytes"]}


def worker(path: str) -> None:
    """Under torchrun: train each config of the JSON list at ``path`` in order (rank 0 writes)."""
    from segmented_checkpointing.engine.config import TrainConfig
    from segmented_checkpointing.engine.model.distributed import close_distributed
    from segmented_checkpointing.engine.train.loop import train
    for values in json.loads(Path(path).read_text()):
        train(TrainConfig.from_dict(values)[0], log=lambda line: None)
    close_distributed()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
