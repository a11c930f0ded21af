"""The one GPU check (issue 11): everything a real GPU run needs, measured in one device call.

(a) CUDA gradient equality: the LoRA gradients of every mode x backend x attention offload (the
    planner's 26 candidates) against no checkpointing; fp32, a mid-size Flux (4 double + 8 single
    blocks, width 1024, 1024 image + 512 text tokens); pass when every relative error <= 1e-6.
(b) The main job on CUDA: ``segckpt train --device cuda`` with its defaults, then with
    ``--base-precision int8-torchao`` and ``fp8-torchao``: losses finite, sec/step, peak, and the
    report's memory split (frozen weights / LoRA + optimizer state / activation peak).
(c) The documents' matrix on a full-size Flux.1-dev architecture (random init, 19 double + 38
    single blocks, 1024 px = 4096 + 512 tokens, rank-16 LoRA, batch 1): columns none, torch,
    interval 2, interval 2 stride 4, torch-ffn, unsloth, unsloth-ffn, the attention-offload
    variants that move something, and diffusers' own no-checkpoint and per-block runs; rows base
    bf16 / int8-torchao / fp8-torchao. Cells ``sec/step / peak GiB`` (2 warm-up + 3 measured
    steps; ``max_memory_allocated``, weights included), ratios to ``none`` and to diffusers'
    per-block run of the same row.
(d) The planner: for three budgets between the smallest and the no-checkpoint predicted peak of a
    mid-size Flux at 512 px, its choice, the predicted and the measured peak of that choice.
(e) The pre-flight (issue 15): a full-size Flux.1-dev architecture on aspect-ratio buckets of
    three shapes at 1024 px (square, 3:2, 2:3); per bucket the pre-flight's predicted peak under
    interval 2 stride 4 and the peak a run of that bucket measures (after warm-up), and the error.
(f) Weight streaming (issue 21): a full-size Flux.1-dev at 1024 px, bf16 and int8-torchao bases,
    trained through the trainer: resident per-block, every block streamed at interval 1 and at
    interval 2 stride 4, the planner's choice under 12, 16 and 24 GiB; cells ``sec/step / peak``,
    weight H2D per step, stall share, ratios to resident per-block. Part (a) also checks the
    gradients of streamed schedules (every base mode, other backends, block counts, prefetch).
(g) Video (issue 24): a full-size Wan 2.1 14B at 480x832 px with 33 and 81 frames (latents
    16 x 9 (21) x 60 x 104): none, per-block, interval 2 stride 4, unsloth, per-block with weights
    streamed; ``sec/step / peak`` (``bench/gpu_video.py``).
(h) Saved attention and per-block compile (issue 25): a full-size Flux.1-dev at 1024 and 2048 px,
    per-block and interval 2 stride 4, each eager / save_attention / compiled / both, and no
    checkpointing; ``sec/step / peak`` and the ratio to no checkpointing (``bench/gpu_compile.py``).
(i) Several GPUs (issue 36): DDP and FSDP2 on 2 GPUs (NCCL), per-block, batch 1 per process, against
    one process at batch 2: sec/step, per-rank peak, losses (``bench/gpu_multi.py``; not run with fewer
    than 2 devices). Part (f)'s arena column gives the pinned arena's allocated / used bytes of the
    full-size Flux.1-dev streamed base.

Every step runs under the trainer's own SDPA choice (``auto``: cuDNN attention left out).

Run on one CUDA device:  ``bash bench/gpu_check.sh [--budget-s 420] [--out FILE]``
CPU check (CI, < 2 min): ``bash bench/gpu_check.sh --smoke`` (tiny sizes; memory in MiB of the
                         CPU tracker; written to the temporary directory unless ``--out``)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import diffusers
import peft
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_compile import compile_check  # noqa: E402
from gpu_multi import multi_gpu_check  # noqa: E402
from gpu_streaming import STREAM_BASES, streaming_check  # noqa: E402
from gpu_sweep import Cell, Preset, default_dtype, fmt_cell, guarded_cell, mem_unit  # noqa: E402
from gpu_video import video_check  # noqa: E402

from segmented_checkpointing import cli  # noqa: E402
from segmented_checkpointing.engine.config import LoraSettings, MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.model import AUTO_KERNELS as AUTO  # noqa: E402
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.memory import device_budget  # noqa: E402
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner  # noqa: E402
from segmented_checkpointing.engine.data.buckets import shape_classes
from segmented_checkpointing.engine.families import TextBatch, get_family  # noqa: E402
from segmented_checkpointing.engine.measure import costs  # noqa: E402
from segmented_checkpointing.engine.measure.planner import PlannerError, predict  # noqa: E402
from segmented_checkpointing.engine.measure.planning import plan_for_budget  # noqa: E402
from segmented_checkpointing.engine.measure.preflight import preflight  # noqa: E402
from segmented_checkpointing.engine.measure.probe import probe  # noqa: E402
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.measure.sweep import (  # noqa: E402
    sweep_schedules,
)
from segmented_checkpointing.engine.model.attention_kernels import sdpa_context
from segmented_checkpointing.engine.model.bundle import ModelBundle, tiny_vae_config
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.model.precision import Precision, apply_base_precision, resolve_precision
from segmented_checkpointing.engine.model.text_encoders import DeterministicTextEmbedder

FAMILY = get_family("flux")
PREDICT_ONLY = MeasureConfig.create(timing_steps=0)
FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
            "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
MID = {**FLUX_DEV, "num_layers": 4, "num_single_layers": 8, "num_attention_heads": 8, "joint_attention_dim": 1024}
TINY = {**FAMILY.tiny_config, "num_layers": 4, "num_single_layers": 8}
MATRIX = [("none", False), ("torch", False), ("interval2", False), ("interval2-stride4", False), ("torch-ffn", False),
          ("unsloth", False), ("unsloth-ffn", False), ("none", True), ("interval2-stride4", True), ("torch-ffn", True),
          ("unsloth-ffn", True), ("diffusers-none", False), ("diffusers-layer", False)]
BASES = ("bf16", "int8-torchao", "fp8-torchao")
STREAM_EXTRA = [CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
                                   gradient_checkpointing_backend=backend, weight_offload="stream",
                                   weight_offload_blocks=blocks, weight_offload_prefetch=prefetch)
                for backend, blocks, prefetch in (("unsloth", 3, 2), ("torch-ffn", None, 0), ("unsloth-ffn", 5, 1))]
"""Streamed schedules of part (a) besides the sweep's four: other backends, block counts and prefetch."""
TOLERANCE = 1e-6
PARTS = "abcdefghi"


@dataclass(frozen=True)
class Sizes:
    """Model configs, latent sides (pixels / 8), text tokens and steps of one check size."""

    label: str
    mid: dict
    grad_latent: int
    full: dict
    full_latent: int
    text_tokens: int
    planner_resolution: int
    preflight_resolution: int
    main_job: tuple[str, ...]
    warmup: int
    steps: int


FULL = Sizes("", MID, 64, FLUX_DEV, 128, 512, 512, 1024, (), 2, 3)
SMOKE = Sizes(" (smoke: tiny Flux stand-ins, CPU)", TINY, 8, TINY, 16, 8, 64, 64,
              ("--steps", "2", "--resolution", "64", "--timing-warmup-steps", "1"), 1, 1)




def flux_with_lora(config: dict, device: torch.device, precision: Precision) -> torch.nn.Module:
    """A random-init Flux at ``precision`` on ``device`` with a rank-16 LoRA whose B is non-zero."""
    torch.manual_seed(0)
    with torch.device(device), default_dtype(precision.storage_dtype):  # never a 48 GiB fp32 copy
        model = diffusers.FluxTransformer2DModel(**config)
    apply_base_precision(model, precision, device)
    add_lora(model, LoraSettings(rank=16, alpha=16, init="gaussian"), FAMILY.lora_targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model.to(device).train()


def flux_inputs(model, latent: int, tokens: int, device: torch.device):
    """Random ``(latents (1, 16, latent, latent), target, inputs)`` for ``model``."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, FAMILY.latent_channels, latent, latent, generator=g).to(device)
    target = torch.randn(latents.shape, generator=g).to(device)
    cfg = model.config
    text = TextBatch(torch.randn(1, tokens, cfg.joint_attention_dim, generator=g),
                     torch.ones(1, tokens, dtype=torch.bool),
                     torch.randn(1, cfg.pooled_projection_dim, generator=g)).to(device)
    sigmas = torch.full((1,), 0.5, device=device)
    return latents, target, FAMILY.make_inputs(model, latents, sigmas, text)


def step_context(precision: Precision, device: torch.device):
    """Autocast and the trainer's SDPA kernel choice, as one context factory."""
    @contextlib.contextmanager
    def both():
        with precision.autocast(device), sdpa_context(AUTO):
            yield
    return both


# (a) ---------------------------------------------------------------------------------------------
def gradient_equality(sizes: Sizes, device: torch.device) -> tuple[list[str], bool]:
    """Rows ``| mode | relative error |`` and whether every mode is within :data:`TOLERANCE`."""
    precision = resolve_precision("fp32", "fp32", device)
    model = flux_with_lora(sizes.mid, device, precision)
    latents, target, inputs = flux_inputs(model, sizes.grad_latent, sizes.text_tokens, device)
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def grads(schedule: CheckpointSchedule) -> list[torch.Tensor]:
        runner = SegmentRunner(model, FAMILY, effective_plan(FAMILY, schedule, count_blocks(FAMILY, model),
                                                             warn=False)).install()
        try:
            with sdpa_context(AUTO):
                output = runner.forward(**inputs)
                F.mse_loss(FAMILY.read_output(model, output, latents).float(), target).backward()
            return [p.grad.detach().clone() for _, p in lora]
        finally:
            runner.close()  # a streamed run leaves the streamed weights in host memory: back to the device
            model.to(device).disable_gradient_checkpointing()
            model.zero_grad(set_to_none=True)

    reference = grads(CheckpointSchedule(gradient_checkpointing=False))
    rows, ok = [], True
    for schedule in sweep_schedules(True, streaming=True)[1:] + STREAM_EXTRA:
        got = grads(schedule)
        error = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(got, reference))
        ok &= error <= TOLERANCE
        rows.append(f"| {schedule.mode} | {error:.2e} | {'ok' if error <= TOLERANCE else 'FAIL'} |")
    return ["| mode | max relative error of LoRA gradients vs none | |", "|---|---:|---|", *rows], ok


# (b) ---------------------------------------------------------------------------------------------
def main_job(sizes: Sizes, device: torch.device, folder: Path) -> tuple[list[str], bool]:
    """``segckpt train`` with defaults and with each quantized base; one row each."""
    rows, ok = [], True
    for base in ("auto", "int8-torchao", "fp8-torchao"):
        out = folder / f"main-{base}"
        argv = ["train", "--device", device.type, "--output", str(out), *sizes.main_job]
        argv += [] if base == "auto" else ["--base-precision", base]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = cli.main(argv)
        if status != 0:
            ok = False
            rows.append(f"| {base} | exit {status}: {printed.getvalue().strip().splitlines()[-1][:200]} | | | | |")
            continue
        report = json.loads((out / "report.json").read_text())
        losses = [s["loss"] for s in report["steps"]]
        finite = all(loss == loss and abs(loss) != float("inf") for loss in losses)
        ok &= finite
        t, m, p = report["totals"], report["memory"], report["precision"]
        rows.append(f"| {p['base_model_precision']} (compute {p['compute']}, {p['quantized_linear_layers']}/"
                    f"{p['linear_layers']} Linear quantized) | {len(losses)} steps, {'finite' if finite else 'NOT FINITE'}, "
                    f"last {losses[-1]:.4f} | {t['sec_per_step']:.3f} | {t['peak_mib']:.1f} | "
                    f"{m['frozen_weight_bytes'] / 2**20:.2f} / {(m['lora_bytes'] + m['optimizer_state_bytes']) / 2**20:.2f} "
                    f"/ {m['activation_peak_bytes'] / 2**20:.2f} |")
    head = ["| base | losses | sec/step | peak MiB | frozen / LoRA+optimizer / activation MiB |",
            "|---|---|---:|---:|---|"]
    return head + rows, ok


# (c) ---------------------------------------------------------------------------------------------
def matrix(sizes: Sizes, device: torch.device, budget_s: float, t0: float, notes: set[str], log) -> list[str]:
    """The documents' matrix: one model per base precision, every column on it."""
    preset = Preset((), (), torch.bfloat16, sizes.warmup, sizes.steps)
    rows: dict[str, list[Cell]] = {}
    for base in BASES:
        rows[base] = cells = []
        try:
            precision = resolve_precision(base, "auto", device)
            model = flux_with_lora(sizes.full, device, precision)
        except Exception as exc:  # noqa: BLE001 - e.g. fp8 refused on this device: the row says so
            notes.add(f"{base}: {type(exc).__name__}: {exc}"[:300])
            cells.extend(Cell("failed") for _ in MATRIX)
            continue
        latents, target, inputs = flux_inputs(model, sizes.full_latent, sizes.text_tokens, device)
        options = {"family": FAMILY, "inputs": inputs, "context": step_context(precision, device)}
        for mode, attn in MATRIX:
            slowest = max((c.wall for c in cells), default=0.0)
            if time.monotonic() - t0 + slowest > budget_s:
                cells.append(Cell("not run"))
                continue
            cells.append(guarded_cell(model, latents, target, mode, attn, device, preset, notes, **options))
            log(f"  {base} | {_column(mode, attn)}: {fmt_cell(cells[-1], device)} ({cells[-1].wall:.1f} s)")
        del model, inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    unit, scale = mem_unit(device)
    head = "| base | " + " | ".join(_column(m, a) for m, a in MATRIX) + " |"
    rule = "|---|" + "---:|" * len(MATRIX)
    out = [f"sec/step / peak {unit}", "", head, rule]
    out += [f"| {b} | " + " | ".join(fmt_cell(c, device) for c in cells) + " |" for b, cells in rows.items()]
    for ref in ("none", "diffusers-layer"):
        index = [m for m, _ in MATRIX].index(ref)
        out += ["", f"Ratio to `{ref}` of the same row: time / peak", "", head, rule]
        for b, cells in rows.items():
            r = cells[index]
            out.append(f"| {b} | " + " | ".join(
                f"{c.sec / r.sec:.2f}x / {c.peak / r.peak:.2f}x" if c.status == r.status == "ok" else "-"
                for c in cells) + " |")
    return out


def _column(mode: str, attn: bool) -> str:
    return f"{mode} +attn-offload" if attn else mode


# (d) ---------------------------------------------------------------------------------------------
def planner_check(sizes: Sizes, device: torch.device) -> list[str]:
    """Three budgets between the smallest and the no-checkpoint predicted peak; the choice's
    predicted and measured peak (after warm-up)."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(**{**sizes.mid, "guidance_embeds": False})
    vae = diffusers.AutoencoderKL(**tiny_vae_config(FAMILY.latent_channels))
    bundle = ModelBundle(FAMILY, transformer.eval(), vae.eval(),
                         DeterministicTextEmbedder(FAMILY.text(transformer.config)), "random-init mid-size Flux")
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-check-") as folder:
        config = TrainConfig.create(resolution=sizes.planner_resolution, device=device.type, output=folder)
        with RunWorkspace(config, bundle) as workspace:
            measured_probe = probe(workspace)
        peaks = sorted(predict(measured_probe, s).peak_bytes for s in sweep_schedules(True))
        unit, scale = mem_unit(device)
        rows = [f"| budget {unit} | choice | predicted peak {unit} | measured peak {unit} | error | fits |",
                "|---:|---|---:|---:|---:|---|"]
        for fraction in (0.25, 0.5, 0.75):
            budget = int((peaks[0] + fraction * (peaks[-1] - peaks[0])) / 0.95)  # the planner keeps 5% headroom
            try:
                chosen = plan_for_budget(RunWorkspace(config, bundle), PREDICT_ONLY, budget,
                                         probe_=measured_probe).chosen
            except PlannerError as exc:
                rows.append(f"| {budget / scale:.3f} | {exc} | | | | |")
                continue
            with RunWorkspace(config, bundle) as workspace:
                measured = peak_after_warmup(workspace.run(chosen.schedule, 1, 2), 1)
            error = (chosen.peak_bytes - measured) / measured
            rows.append(f"| {budget / scale:.3f} | {chosen.schedule.mode} | {chosen.peak_bytes / scale:.3f} | "
                        f"{measured / scale:.3f} | {error:+.1%} | {'yes' if measured <= budget else 'NO'} |")
    return rows


def preflight_check(sizes: Sizes, device: torch.device) -> list[str]:
    """Per bucket of three aspect ratios: the pre-flight's predicted peak under interval 2 stride 4
    and the measured peak (after warm-up) of a run on that bucket."""
    from PIL import Image

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(**{**sizes.full, "guidance_embeds": False})
    vae = diffusers.AutoencoderKL(**tiny_vae_config(FAMILY.latent_channels))
    bundle = ModelBundle(FAMILY, transformer.eval(), vae.eval(),
                         DeterministicTextEmbedder(FAMILY.text(transformer.config)), "random-init Flux")
    schedule = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
    r = sizes.preflight_resolution
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-check-") as folder:
        data = Path(folder) / "data"
        data.mkdir()
        for i, size in enumerate([(r, r), (r * 3 // 2, r), (r, r * 3 // 2)] * 2):
            Image.new("RGB", size, (40 * i, 120, 200)).save(data / f"img{i}.png")
        config = TrainConfig.create(data=str(data), resolution=r, buckets=True, device=device.type, schedule=schedule,
                             output=str(Path(folder) / "out"))
        budget = device_budget(device)
        verdict = preflight(RunWorkspace(config, bundle), budget)
        unit, scale = mem_unit(device)
        rows = [f"| bucket (latent) | share | predicted peak {unit} | measured peak {unit} | error |",
                "|---|---:|---:|---:|---:|"]
        with RunWorkspace(config, bundle) as workspace:
            classes = {"x".join(map(str, (config.data.batch_size, *shape))): rows_ for shape, rows_ in
                       shape_classes(workspace.data_cache())}
            for phase in (p for p in verdict.phases if p.kind == "train"):
                run = workspace.start(schedule, 1, 2, rows=classes[phase.shape])
                for _ in run:
                    pass
                measured = peak_after_warmup(run.result, 1)
                error = (phase.peak_bytes - measured) / measured
                rows.append(f"| {phase.shape} | {phase.share:.0%} | {phase.peak_bytes / scale:.3f} | "
                            f"{measured / scale:.3f} | {error:+.1%} |")
    return rows


def environment(device: torch.device) -> str:
    """Date, device and versions, one line."""
    try:
        import torchao
        ao = torchao.__version__
    except ImportError:
        ao = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    return (f"{datetime.date.today().isoformat()}; device {device} ({name}); torch {torch.__version__}, "
            f"diffusers {diffusers.__version__}, peft {peft.__version__}, torchao {ao}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--out", default=None, help="markdown file; default bench/gpu_check_results.md "
                        "(with --smoke: gpu_check_smoke.md in the temporary directory)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no matrix cell after this (seconds)")
    parser.add_argument("--video-budget-s", type=float, default=600.0,
                        help="start no cell of part (g) after this, from its start (seconds)")
    parser.add_argument("--compile-budget-s", type=float, default=600.0,
                        help="start no cell of part (h) after this, from its start (seconds)")
    parser.add_argument("--parts", default=PARTS,
                        help=f"which parts to run, in this order, as letters (default {PARTS}: all); the results file "
                             "is written again after each part, so a run stopped by a time limit keeps what it measured")
    parser.add_argument("--stream-bases", nargs="+", default=list(STREAM_BASES), choices=STREAM_BASES,
                        help="the base precisions of part (f) (default: both)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts {args.parts!r}: unknown part(s) {', '.join(unknown)}; allowed: letters of {PARTS}")
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:  # the smoke checks that every part runs; the planner's accuracy is bench/planner_accuracy.py's
        costs.CALIBRATION_STEPS = 2
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: more threads only add contention
    out = Path(args.out or (Path(tempfile.gettempdir()) / "gpu_check_smoke.md" if args.smoke
                            else Path(__file__).with_name("gpu_check_results.md")))
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, notes = time.monotonic(), set()
    log = lambda line: print(line, flush=True)  # noqa: E731
    sections, failed = [f"# GPU check{sizes.label}", "", environment(device)], []
    for letter in args.parts:
        title, run = _part(letter, args, sizes, device, t0, notes, log)
        log(f"{title} ...")
        try:
            rows, passed = run()
        except Exception:  # noqa: BLE001 - one part's crash (a missing package, another torch) never hides the rest
            rows, passed = ["```", *traceback.format_exc().strip().splitlines()[-12:], "```"], False
            log("\n".join(rows))
        failed += [letter] if passed is False else []
        verdict = "" if passed is None else (": pass" if passed else ": FAIL")
        sections += ["", f"## {title}{verdict}", "", *rows]
        _write(out, sections, notes, t0, failed, done=False)
    text = _write(out, sections, notes, t0, failed, done=True)
    print("\n" + text)
    print(f"wrote {out}")
    return 1 if failed else 0


def _part(letter: str, args, sizes: Sizes, device: torch.device, t0: float, notes: set[str], log):
    """``(title, run)`` of one part; ``run()`` returns ``(rows, passed)``, ``passed`` None where the
    part has no pass/fail verdict (a table of figures)."""
    table = lambda rows: (rows, None)  # noqa: E731
    pixels_video = "64x112 px, 5 and 9 frames (tiny Wan)" if args.smoke else "480x832 px, 33 and 81 frames"
    pixels_compile = "64 and 128 px (tiny Flux; eager and saved attention)" if args.smoke else "1024 and 2048 px"
    where = "2 CPU processes (gloo), tiny Flux" if args.smoke else "2 GPUs (NCCL), mid-size Flux, 512 px"

    def multi():
        rows, passed = multi_gpu_check(args.smoke, sizes.mid, log)
        return rows + ["", "The pinned arena's allocated / used ratio for the full-size Flux.1-dev streamed base: "
                       "part (f), arena column."], passed

    def job():
        with tempfile.TemporaryDirectory(prefix="segckpt-gpu-check-") as folder:
            return main_job(sizes, device, Path(folder))

    return {
        "a": ("(a) Gradient equality, fp32, mid-size Flux", lambda: gradient_equality(sizes, device)),
        "b": ("(b) The main job", job),
        "c": ("(c) The documents' matrix, full-size Flux.1-dev, 1024 px",
              lambda: table(matrix(sizes, device, args.budget_s, t0, notes, log))),
        "d": ("(d) The planner's choice under three budgets", lambda: table(planner_check(sizes, device))),
        "e": ("(e) The pre-flight per bucket, Flux.1-dev architecture, interval 2 stride 4",
              lambda: table(preflight_check(sizes, device))),
        "f": (f"(f) Weight streaming, full-size Flux.1-dev, {sizes.preflight_resolution} px, "
              f"{' and '.join(args.stream_bases)} base{'s' if len(args.stream_bases) > 1 else ''}",
              lambda: table(streaming_check(sizes, device, log, tuple(args.stream_bases)))),
        "g": (f"(g) Video LoRA, full-size Wan 2.1 14B architecture, {pixels_video}",
              lambda: table(video_check(args.smoke, device, args.video_budget_s, log))),
        "h": (f"(h) Saved attention outputs and per-block compile, full-size Flux.1-dev, {pixels_compile}",
              lambda: table(compile_check(args.smoke, device, args.compile_budget_s, log))),
        "i": (f"(i) DDP and FSDP2, {where}", multi),
    }[letter]


def _write(out: Path, sections: list[str], notes: set[str], t0: float, failed: list[str], done: bool) -> str:
    """Write the results so far to ``out`` (atomically: a killed run leaves the last whole file)."""
    status = ("all checks pass" if not failed else f"A CHECK FAILED: part(s) {', '.join(failed)}") if done else \
        "still running: the parts below the last one were not reached"
    text = "\n".join([*sections, "", "## Notes", "", *[f"- {n}" for n in sorted(notes)], "",
                      f"total wall time {time.monotonic() - t0:.0f} s; {status}"]) + "\n"
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text)
    partial.replace(out)
    return text


if __name__ == "__main__":
    sys.exit(main())
