"""Synthetic reference sweep (docs/SCHEDULES.md "Benchmark protocol") of our SegmentRunner on one
device.

Model: a diffusers ``ModelMixin`` stack of pre-norm residual blocks made of real diffusers parts
(``Attention`` with the SDPA processor and RMS q/k norm, ``FeedForward`` GELU x4), looping over
its blocks the standard way (``if torch.is_grad_enabled() and self.gradient_checkpointing:``), so
every block call goes through our :class:`SegmentRunner`. Its family adapter is declared here
(list ``blocks``, FFN ``ff``, attention ``attn``), not registered. Default sizes: 24 blocks of
width 3072 (24 heads x 128) on 2x2-packed latents of 64/128/256 px sides (1024/4096/16384
tokens), then, if the budget allows, 32 blocks of width 4096 (32 x 128) on 3072 tokens (96x128).
Frozen bf16 base, rank-16 LoRA on ``to_q/to_k/to_v/to_out.0`` (bf16 too, no autocast), AdamW,
batch 1, MSE loss; 2 warm-up + 3 measured steps per cell.

Columns: none / torch-ffn / torch / interval2 / interval2-stride4 / unsloth-ffn / unsloth
(backends per block; the interval columns use the torch backend), each without and with
``gradient_checkpointing_offload_attention``. A cell is ``median post-warm-up
sec/step / peak``: on CUDA ``max_memory_allocated`` over the measured steps in GiB (absolute,
weights included; reset after each cell's warm-up); on CPU (``--smoke``) the live-tensor peak of
the measured steps in MiB, host pool excluded (transient only). Status cells: ``OOM``, ``failed``
(errors listed under Notes), ``unsupported``, ``not run``. A cell starts only while the seconds
since the sweep began (imports excluded) plus the slowest finished cell of its row fit in
``--budget-s`` (default 400). Printed, and written to ``--out``: that table, the ratios to
``torch`` without attention offload in the same row (time / peak), per-cell runner and offload
counters (last measured step), and notes (plan notes, warnings, options that had no effect).

Run on a CUDA machine:  ``bash bench/gpu_sweep.sh [--budget-s 400] [--skip-large] [--out FILE]``
CPU check (< 30 s):     ``python bench/gpu_sweep.py --smoke`` (4-6 blocks of width 64/96, fp32;
                        written to gpu_sweep_smoke.md in the temporary directory unless ``--out``)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import diffusers
import peft
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.memory import GIB, MIB, PeakMemory, StepTimer
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families.base import (
    SINGLE,
    BlockList,
    FamilyAdapter,
    TextSpec,
)
from segmented_checkpointing.engine.families.packing import pack_2x2, unpack_2x2
from segmented_checkpointing.engine.model.lora_files import add_lora


class Block(nn.Module):
    """Pre-norm residual transformer block: ``h + attn(norm1(h))``, then ``h + ff(norm2(h))``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(width, heads=heads, dim_head=width // heads, bias=True, qk_norm="rms_norm",
                              eps=1e-6, processor=AttnProcessor2_0())
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(width, activation_fn="gelu-approximate")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states))
        return hidden_states + self.ff(self.norm2(hidden_states))


class SyntheticStack(ModelMixin, ConfigMixin):
    """Packed latent tokens -> ``depth`` blocks -> packed tokens, with diffusers' checkpoint hook."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, in_channels: int = 64, width: int = 3072, heads: int = 24, depth: int = 24):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.proj_out = nn.Linear(width, in_channels)
        self.gradient_checkpointing = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(B, T, in_channels)`` packed latent tokens -> ``(B, T, in_channels)``."""
        hidden_states = self.proj_in(hidden_states)  # (B, T, width)
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = self._gradient_checkpointing_func(block, hidden_states)
            else:
                hidden_states = block(hidden_states)
        return self.proj_out(hidden_states)


FAMILY = FamilyAdapter(
    name="synthetic", model_class="SyntheticStack",
    block_lists=(BlockList("blocks", "blocks", SINGLE, ffn="ff", attention="attn"),),
    text=lambda cfg: TextSpec(1), tiny_config={"width": 64, "heads": 2, "depth": 2}, latent_channels=16,
    make_inputs=lambda model, latents, sigmas, text: {"hidden_states": pack_2x2(latents)},
    read_output=lambda model, output, latents: unpack_2x2(output, *latents.shape[-2:]),
)
LARGE_RESERVE_S = 60.0  # start the large stack only with at least this much budget left
MODES = ("none", "torch-ffn", "torch", "interval2", "interval2-stride4", "unsloth-ffn", "unsloth")
COLUMNS = [(mode, attn) for mode in MODES for attn in (False, True)]


@dataclass(frozen=True)
class Stack:
    width: int
    heads: int
    depth: int


@dataclass(frozen=True)
class Preset:
    """Rows are ``(stack, latent height, latent width)``; the last ``large`` rows run only if time allows."""

    rows: tuple[tuple[Stack, int, int], ...]
    large: tuple[tuple[Stack, int, int], ...]
    dtype: torch.dtype
    warmup: int
    steps: int


FULL = Preset(rows=tuple((Stack(3072, 24, 24), s, s) for s in (64, 128, 256)),
              large=((Stack(4096, 32, 32), 96, 128),), dtype=torch.bfloat16, warmup=2, steps=3)
SMOKE = Preset(rows=((Stack(64, 2, 4), 16, 16), (Stack(64, 2, 4), 16, 32)),
               large=((Stack(96, 2, 6), 16, 24),), dtype=torch.float32, warmup=1, steps=1)


@dataclass
class Cell:
    """One sweep cell: status (ok / OOM / failed / unsupported / not run), median sec/step, peak
    bytes, peak bytes above the allocation at the start of the measured steps, the cell's wall
    seconds (warm-up and set-up included), runner/offload counters, and the error if any."""

    status: str = "not run"
    sec: float = 0.0
    peak: int = 0
    step_bytes: int = 0
    wall: float = 0.0
    stats: dict = field(default_factory=dict)
    error: str = ""


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside are ``dtype`` (a full-size model never takes a float32 copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def schedule_for(mode: str, attn: bool) -> CheckpointSchedule:
    """The schedule of a column: ``none``, a backend (per block), ``interval2`` or
    ``interval2-stride4`` (torch backend), with or without attention offload."""
    keys = {"gradient_checkpointing_offload_attention": attn}
    if mode == "none":
        return CheckpointSchedule(gradient_checkpointing=False, **keys)
    if mode.startswith("interval2"):
        stride = 4 if mode.endswith("stride4") else None
        return CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=stride, **keys)
    return CheckpointSchedule(gradient_checkpointing_backend=mode, **keys)


def build(stack: Stack, device: torch.device, dtype: torch.dtype) -> SyntheticStack:
    """Random-init stack on ``device`` with a frozen base and a rank-16 LoRA, all in ``dtype``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = SyntheticStack(4 * FAMILY.latent_channels, stack.width, stack.heads, stack.depth)
    add_lora(model, LoraSettings(rank=16, alpha=16), FAMILY.lora_targets)  # peft makes LoRA fp32
    return nn.Module.to(model, dtype)  # not ModelMixin.to: it warns about an empty fp32-module list


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


REFERENCES = ("diffusers-none", "diffusers-layer")
"""Reference columns: the model called directly, without and with diffusers' own per-block
checkpointing (``enable_gradient_checkpointing()`` with its default function)."""


def run_cell(model, latents, target, schedule, device, warmup: int, steps: int, notes: set[str],
             family: FamilyAdapter = FAMILY, inputs: dict | None = None,
             context: Callable[[], Any] = contextlib.nullcontext) -> Cell:
    """Warm-up steps, then measured steps of one schedule; raises on OOM / failure.

    Args:
        schedule: a :class:`CheckpointSchedule` run by our runner, or one of :data:`REFERENCES`.
        family, inputs: the adapter and the model's inputs (default: this script's stack).
        context: a fresh context manager per forward + backward (autocast, SDPA kernels).
    """
    inputs = inputs if inputs is not None else family.make_inputs(model, latents, None, None)
    runner = None
    if schedule in REFERENCES:
        if schedule == "diffusers-layer":
            model.enable_gradient_checkpointing()
        forward = functools.partial(model, **inputs)
    else:
        plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
        notes.update(plan.notes)
        runner = SegmentRunner(model, family, plan).install()
        forward = functools.partial(runner.forward, **inputs)
    off = runner.offloader if runner else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    timer = StepTimer(device, warmup)
    memory = PeakMemory(device, exclude=off.pool.is_host if off else None)

    def step() -> None:
        if runner:
            runner.stats.reset()
        if off:
            off.stats.reset()
        with timer.step():
            with context():
                prediction = family.read_output(model, forward(), latents)
                F.mse_loss(prediction.float(), target.float()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(warmup):
            step()
        with memory.measure() as reading:
            for _ in range(steps):
                step()
        s = runner.stats if runner else None
        if s:
            notes.update(s.fallbacks)
        stats = dict(ckpt_calls=s.checkpoint_calls if s else 0, recomputed_blocks=s.recomputed_blocks if s else 0,
                     recomputed_ffn=s.recomputed_ffn if s else 0, off_tensors=off.stats.tensors if off else 0,
                     off_bytes=off.stats.bytes if off else 0, pool_bytes=off.pool.pool_bytes if off else 0,
                     pinned=("yes" if off.pool.pinned else "no") if off else "-")
        return Cell("ok", timer.median_s(), reading.peak_bytes, reading.step_bytes, stats=stats)
    finally:
        if runner:
            runner.close()
        model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)


def guarded_cell(model, latents, target, mode, attn, device, preset, notes, **cell_options) -> Cell:
    """:func:`run_cell` with status cells for unsupported / OOM / failed, memory freed afterwards.

    ``mode`` is a column of :data:`MODES` or one of :data:`REFERENCES`; ``cell_options`` go to
    :func:`run_cell` (family, inputs, context)."""
    start = time.monotonic()
    schedule = mode if mode in REFERENCES else schedule_for(mode, attn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cell = run_cell(model, latents, target, schedule, device, preset.warmup, preset.steps, notes,
                            **cell_options)
        except ScheduleError as exc:
            cell = Cell("unsupported", error=str(exc))
        except torch.cuda.OutOfMemoryError as exc:
            cell = Cell("OOM", error=str(exc).splitlines()[0][:200])
        except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the sweep goes on
            cell = Cell("failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    notes.update(str(w.message).splitlines()[0] for w in caught)
    if device.type == "cuda" or cell.status != "ok":  # gc.collect alone costs ~0.3 s on CPU
        free_memory(device)  # after an OOM: the frames holding the step's tensors are gone now
    cell.wall = time.monotonic() - start
    return cell


def row_label(stack: Stack, h: int, w: int) -> str:
    return f"{h // 2 * (w // 2)} tok ({h}x{w} latent), {stack.depth}x{stack.width}"


def sweep(preset: Preset, device: torch.device, budget_s: float, skip_large: bool, notes: set[str],
          log=print) -> dict[str, list[Cell]]:
    """Every row's cells in order, one model per stack (freed before the next is built).

    A cell starts only while the elapsed seconds plus the slowest finished cell of its row fit in
    ``budget_s``; the large stack is built only with ``LARGE_RESERVE_S`` of the budget left.
    """
    t0, rows, model, built, missing = time.monotonic(), {}, None, None, Cell()
    for stack, h, w, large in [(*r, False) for r in preset.rows] + [(*r, True) for r in preset.large]:
        label = row_label(stack, h, w)
        rows[label] = cells = []
        if stack != built:
            model, built, missing = None, stack, Cell("not run")
            free_memory(device)  # the previous stack is released before the next one is built
            if not (large and skip_large) and time.monotonic() - t0 + LARGE_RESERVE_S * large < budget_s:
                try:
                    model = build(stack, device, preset.dtype)
                except Exception as exc:  # noqa: BLE001 - e.g. OOM: the whole row says so
                    status = "OOM" if isinstance(exc, torch.cuda.OutOfMemoryError) else "failed"
                    missing = Cell(status, error=f"building the stack: {type(exc).__name__}: {exc}"[:300])
                    free_memory(device)
        g = torch.Generator().manual_seed(1)
        latents = torch.randn(1, FAMILY.latent_channels, h, w, generator=g).to(device, preset.dtype)
        target = torch.randn(latents.shape, generator=g).to(device)
        for mode, attn in COLUMNS:
            slowest = max((c.wall for c in cells), default=0.0)
            if model is None or time.monotonic() - t0 + slowest > budget_s:
                cells.append(dataclasses.replace(missing) if model is None else Cell("not run"))
                continue
            cells.append(guarded_cell(model, latents, target, mode, attn, device, preset, notes))
            log(f"  {label} | {column_name(mode, attn)}: {fmt_cell(cells[-1], device)} ({cells[-1].wall:.1f} s)")
    return rows


def column_name(mode: str, attn: bool) -> str:
    return f"{mode} +attn-offload" if attn else mode


def mem_unit(device: torch.device) -> tuple[str, int]:
    return ("GiB", GIB) if device.type == "cuda" else ("MiB", MIB)


def fmt_cell(cell: Cell, device: torch.device) -> str:
    if cell.status != "ok":
        return cell.status
    unit, scale = mem_unit(device)
    return f"{cell.sec:.3f} / {cell.peak / scale:.3f}"


def tables(rows: dict[str, list[Cell]], device: torch.device, notes: set[str]) -> str:
    unit, scale = mem_unit(device)
    head = "| row | " + " | ".join(column_name(m, a) for m, a in COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(COLUMNS)
    ref_index = COLUMNS.index(("torch", False))
    out = [f"### sec/step / peak {unit}", "", head, rule]
    out += [f"| {label} | " + " | ".join(fmt_cell(c, device) for c in cells) + " |" for label, cells in rows.items()]
    out += ["", "### Ratio to `torch` (no attention offload) in the same row: time / peak", "", head, rule]
    for label, cells in rows.items():
        ref = cells[ref_index]
        out.append(f"| {label} | " + " | ".join(
            f"{c.sec / ref.sec:.2f}x / {c.peak / ref.peak:.2f}x" if c.status == "ok" and ref.status == "ok"
            and ref.sec > 0 and ref.peak > 0 else "-" for c in cells) + " |")
    out += ["", "### Per-cell counters (last measured step)", "",
            f"| row | mode | ckpt calls | recomputed blocks | recomputed FFN | offloaded tensors | "
            f"offloaded MiB/step | pool MiB | pinned | peak above step start {unit} |", "|---|---|" + "---:|" * 8]
    for label, cells in rows.items():
        for (mode, attn), c in zip(COLUMNS, cells):
            if c.status == "ok":
                s = c.stats
                out.append(f"| {label} | {column_name(mode, attn)} | {s['ckpt_calls']} | {s['recomputed_blocks']} | "
                           f"{s['recomputed_ffn']} | {s['off_tensors']} | {s['off_bytes'] / MIB:.1f} | "
                           f"{s['pool_bytes'] / MIB:.1f} | {s['pinned']} | {c.step_bytes / scale:.3f} |")
    for label, cells in rows.items():
        for mode in MODES:
            off_, on = cells[COLUMNS.index((mode, False))], cells[COLUMNS.index((mode, True))]
            if off_.status == on.status == "ok" and off_.stats["off_bytes"] == on.stats["off_bytes"]:
                notes.add(f"{mode}: attention offload moved nothing (every block runs inside a whole-block "
                          "checkpoint region), so its two columns measure the same schedule")
        errors: dict[str, list[str]] = {}
        for (mode, attn), c in zip(COLUMNS, cells):
            if c.error:
                errors.setdefault(f"{c.status}: {c.error}", []).append(column_name(mode, attn))
        notes.update(f"{label} | {', '.join(cols)}: {error}" for error, cols in errors.items())
    out += ["", "### Notes", ""] + [f"- {n}" for n in sorted(notes)]
    return "\n".join(out)


def environment(device: torch.device, preset: Preset) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    stacks = sorted({f"{s.depth} blocks x width {s.width} ({s.heads} heads x {s.width // s.heads})"
                     for s, _, _ in preset.rows + preset.large})
    return (f"device {device} ({name}); torch {torch.__version__}, diffusers {diffusers.__version__}, peft "
            f"{peft.__version__}, Python {platform.python_version()}; dtype {str(preset.dtype).split('.')[-1]}; "
            f"LoRA rank 16 on to_q/to_k/to_v/to_out.0; batch 1; {preset.warmup} warm-up + {preset.steps} "
            f"measured steps per cell; stacks: {'; '.join(stacks)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 CPU sweep (< 30 s)")
    parser.add_argument("--out", default=None, help="markdown file; default bench/gpu_sweep_results.md, "
                        "with --smoke gpu_sweep_smoke.md in the temporary directory (never the results)")
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no cell after this (seconds)")
    parser.add_argument("--skip-large", action="store_true", help="leave the 32x4096 stack out")
    args = parser.parse_args(argv)
    preset = SMOKE if args.smoke else FULL
    out = Path(args.out or (Path(tempfile.gettempdir()) / "gpu_sweep_smoke.md" if args.smoke
                            else Path(__file__).with_name("gpu_sweep_results.md")))
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: more threads only add contention
    start = time.monotonic()
    env = environment(device, preset)
    print(env, flush=True)
    notes: set[str] = set()
    rows = sweep(preset, device, args.budget_s, args.skip_large, notes,
                 log=lambda line: print(line, flush=True))
    report = tables(rows, device, notes)
    total = f"total wall time {time.monotonic() - start:.0f} s (budget {args.budget_s:.0f} s)"
    print("\n" + report + "\n\n" + total)
    text = f"# Synthetic reference sweep{' (smoke)' if args.smoke else ''}\n\n{env}\n\n{report}\n\n{total}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
