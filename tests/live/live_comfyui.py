"""A real ComfyUI server with this pack, for the live tests (``COMFYUI_PATH`` = its checkout).

Environment: ``COMFYUI_PATH`` (required; tests skip without it), ``COMFYUI_PYTHON`` (the
interpreter with ComfyUI's requirements; default: this one), ``COMFYUI_FRONT_END_ROOT`` (a
frontend's ``static`` folder, passed as ``--front-end-root``). The server runs on a free port with
``--base-directory`` in a temporary folder whose ``custom_nodes/`` links to this checkout, so
nothing is written into the ComfyUI checkout.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACK_FOLDER = "comfyui-segmented-checkpointing"
NODE_TYPES = ("SegCkptLoadDiffusionModel", "SegCkptImageCaptionDataset", "SegCkptSchedule", "SegCkptOffloadOptions",
              "SegCkptLoRAConfig", "SegCkptTrainLoRA", "SegCkptSaveLoRA", "SegCkptLossGraph", "SegCkptRunReport",
              "SegCkptSweep", "SegCkptSchedulePlanner", "SegCkptFitGuardrails", "SegCkptWeightOffload")


def comfyui_path() -> Path:
    """The ComfyUI checkout, or skip the calling test."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        pytest.skip("COMFYUI_PATH is not set (path of a ComfyUI checkout)")
    return Path(path)


def pack_tracebacks(log: str) -> list[str]:
    """The tracebacks in a server's ``log`` that pass through the pack (its folder or its package).
    ComfyUI's own optional nodes may fail to import for a package the machine lacks (torchaudio for
    its audio nodes): their tracebacks are not the pack's."""
    blocks = [block.split("\n\n")[0] for block in log.split("Traceback (most recent call last):")[1:]]
    return [block for block in blocks if PACK_FOLDER in block or "segmented_checkpointing" in block]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ComfyUI process; ``url``, ``base`` (its base directory) and ``log()``."""

    def __init__(self, checkout: Path, base: Path):
        self.base, self.port = base, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (base / "custom_nodes").mkdir(parents=True)
        (base / "custom_nodes" / PACK_FOLDER).symlink_to(ROOT, target_is_directory=True)
        command = [os.environ.get("COMFYUI_PYTHON", sys.executable), "main.py", "--cpu", "--listen", "127.0.0.1",
                   "--port", str(self.port), "--base-directory", str(base)]
        if os.environ.get("COMFYUI_FRONT_END_ROOT"):
            command += ["--front-end-root", os.environ["COMFYUI_FRONT_END_ROOT"]]
        self.log_path = base / "comfyui.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, cwd=checkout, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited:\n{self.log()[-3000:]}")
            try:
                self.get("/object_info/SegCkptSchedule")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        raise RuntimeError(f"ComfyUI did not start in 180 s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                text = response.read().decode()
                return response.status, json.loads(text) if text else {}
        except urllib.error.HTTPError as exc:
            text = exc.read().decode()
            try:
                return exc.code, json.loads(text)
            except json.JSONDecodeError:
                return exc.code, {"text": text}

    def get(self, path: str) -> dict:
        status, body = self.request(path)
        if status != 200:
            raise urllib.error.URLError(f"{path}: HTTP {status}")
        return body

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


class Socket:
    """The server's websocket for one client id; messages (JSON ones) are collected in a thread."""

    def __init__(self, server: Server):
        import aiohttp

        self.client_id, self.messages = uuid.uuid4().hex, []
        self._ready, self._stop = threading.Event(), None
        url = f"ws://127.0.0.1:{server.port}/ws?clientId={self.client_id}"

        async def listen():
            self._stop = asyncio.Event()
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        message = await ws.receive(timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    if message.type == aiohttp.WSMsgType.TEXT:
                        self.messages.append(json.loads(message.data))
                    elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        return

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(listen(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "websocket did not connect"

    def wait_for(self, predicate, timeout: float = 600) -> dict:
        """The first message (in order) for which ``predicate(message)`` holds; waits for it."""
        deadline, seen = time.time() + timeout, 0
        while time.time() < deadline:
            while seen < len(self.messages):
                message = self.messages[seen]
                seen += 1
                if predicate(message):
                    return message
            time.sleep(0.1)
        raise TimeoutError(f"no such message in {timeout} s; last: {self.messages[-5:]}")

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def api_workflow(name: str) -> dict:
    return json.loads((ROOT / "workflows" / "api" / name).read_text())


def node_id_of(graph: dict, class_type: str) -> str:
    return next(k for k, v in graph.items() if v["class_type"] == class_type)


def queue(server: Server, socket_: Socket, graph: dict) -> tuple[int, dict]:
    return server.request("/prompt", {"prompt": graph, "client_id": socket_.client_id})


def finished(prompt_id: str):
    """Predicate: the prompt ended (success, error or interrupted)."""
    def check(message: dict) -> bool:
        data = message.get("data", {})
        return data.get("prompt_id") == prompt_id and (
            message["type"] in ("execution_success", "execution_error", "execution_interrupted")
            or message["type"] == "executing" and data.get("node") is None)
    return check
