"""What Train LoRA shows while it trains: ComfyUI's progress bar, the loss curve, the previews and
the guardrails' notes (the pre-flight's progress and verdict, out-of-memory switches, the
watchdog), sent to the page as the pack's events (``web/train_loss_curve.js`` draws them on the
node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import api
from .environment import Host
from .messages import node_words


class LiveRun:
    """The page events of one Train LoRA run.

    Args:
        host: the ComfyUI host (progress, events, folders). node: the node's id.
        config: the run's config (its steps and output folder).
    """

    def __init__(self, host: Host, node: Any, config: api.TrainConfig):
        self.host, self.node, self.notes, self.status = host, node, [], None
        self.update = host.progress(node, config.steps)
        self.folder = Path(config.outputs.output).resolve().relative_to(host.output_dir.resolve()).as_posix()

    def shown(self, line: str) -> str:
        """``line`` as the page shows it: server paths hidden, options named by the nodes' inputs."""
        return self.host.public(node_words(line))

    def log(self, line: str) -> None:
        """The run's log line, on the server's console in the nodes' words (``resume=true``, not
        ``--resume``)."""
        print(self.shown(line))

    def _send(self) -> None:
        lines = self.notes + ([self.status] if self.status else [])
        self.host.send("segckpt.notes", {"node": self.node, "lines": lines})

    def note(self, lines: list[str]) -> None:
        """Add lines to the notes drawn on the node (server paths hidden)."""
        self.notes.extend(self.shown(line) for line in lines)
        self._send()

    def on_preflight(self, done: int, total: int) -> None:
        """The pre-flight's progress: on the bar (its own total) and as the node's last line."""
        self.update(done, max(total, 1))
        self.status = (f"pre-flight: probe step {done}/{total} (one probe per batch shape)" if total
                       else "pre-flight: encoding the data")
        self._send()

    def on_verdict(self, verdict: api.Verdict) -> None:
        self.status = None
        self.note(verdict.render().splitlines())

    def on_step(self, record, total: int) -> None:
        """Progress, the step's switches and watchdog reports, its loss and previews."""
        self.update(record.step, total)
        self.note([f"step {s['step']}: out of memory under {s['from']}: switched to {s['to']}"
                   for s in record.schedule_switches] + [found["message"] for found in record.watchdog])
        self.host.send("segckpt.loss", {"node": self.node, "step": record.step, "total": total, "loss": record.loss})
        if record.previews:  # drawn on this node while it trains (web/train_loss_curve.js)
            self.host.send("segckpt.preview", {"node": self.node, "step": record.step, "images": [
                {"filename": Path(p).name, "subfolder": f"{self.folder}/{Path(p).parent.as_posix()}", "type": "output"}
                for p in record.previews]})
