"""A long-lived ComfyUI server stays healthy with the pack (issue 34; skipped unless ``COMFYUI_PATH`` is set).

Each test starts its own server: a fresh process is what the first-import race needs.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from live_comfyui import Server, comfyui_path

FAMILIES = ("wan", "qwenimage", "hunyuanvideo", "sd3")
"""Four families whose diffusers classes share one import cycle (diffusers -> loaders.peft -> accelerate)."""


@pytest.fixture
def fresh_server(tmp_path):
    running = Server(comfyui_path(), tmp_path / "base")
    yield running
    running.stop()


def _plans_at_once(server: Server, families: tuple[str, ...]) -> dict[str, tuple[int, dict]]:
    start = threading.Barrier(len(families))

    def ask(family: str) -> tuple[int, dict]:
        start.wait()
        return server.request(f"/segckpt/plan?family={family}&gradient_checkpointing_interval=2")

    with concurrent.futures.ThreadPoolExecutor(len(families)) as pool:
        return dict(zip(families, pool.map(ask, families)))


def test_concurrent_first_plan_requests_on_a_fresh_server_all_answer_and_so_do_later_ones(fresh_server):
    """The canvas of a workflow with several Schedule nodes asks for several families' plans at once
    when it opens: each must answer 200, and so must every later request and a training."""
    first = _plans_at_once(fresh_server, FAMILIES)
    assert {f: status for f, (status, _) in first.items()} == dict.fromkeys(FAMILIES, 200), first
    assert all(body["family"] == f and body["lists"] for f, (_, body) in first.items())
    for family in FAMILIES:
        status, body = fresh_server.request(f"/segckpt/plan?family={family}")
        assert status == 200, body
    assert "Traceback" not in fresh_server.log()
