"""A long-lived ComfyUI server stays healthy with the pack (issue 34; skipped unless ``COMFYUI_PATH`` is set).

Each test starts its own server: a fresh process is what the first-import race needs.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading
import uuid

import live_comfyui
import pytest
from helpers import comparable_object_info, object_info_as_v1, recorded_object_info
from live_comfyui import PACK_FOLDER, ROOT, Server, Socket, api_workflow, comfyui_path, finished, queue

FAMILIES = ("wan", "qwenimage", "hunyuanvideo", "sd3")
"""Four families whose diffusers classes share one import cycle (diffusers -> loaders.peft -> accelerate)."""


@pytest.fixture
def fresh_server(tmp_path):
    running = Server(comfyui_path(), tmp_path / "base")
    yield running
    running.stop()


def test_the_v3_nodes_list_the_object_info_recorded_from_the_classic_ones(fresh_server):
    """Issue 37: ComfyUI loads the pack through its V3 entry point, with no warning, and lists every
    node as it listed the classic nodes (``tests/nodes/fixtures/object_info.json``, recorded from
    the pack before the change on this server layout: an empty base folder), apart from what V3
    adds (``helpers.object_info_as_v1`` names it), so saved workflows load as before."""
    recorded = json.loads((ROOT / "tests" / "nodes" / "fixtures" / "object_info.json").read_text())
    ours = {kind: entry for kind, entry in fresh_server.get("/object_info").items() if kind.startswith("SegCkpt")}
    assert sorted(ours) == sorted(recorded)
    assert all("output_tooltips" in entry for entry in ours.values())  # V3's rendering (V1 lists it only when set)
    for kind, entry in ours.items():
        assert comparable_object_info(kind, object_info_as_v1(entry)) == recorded_object_info(kind), kind
    lines = [line for line in fresh_server.log().splitlines() if PACK_FOLDER in line or "comfy_entrypoint" in line]
    assert len(lines) == 1 and "seconds:" in lines[0] and "IMPORT FAILED" not in lines[0], lines
    assert not live_comfyui.pack_tracebacks(fresh_server.log())


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
    assert not live_comfyui.pack_tracebacks(fresh_server.log())


SOAK_FAMILIES = ("flux", "sd3", "wan", "pixart", "qwenimage", "zimage")
"""Tiny presets trained in turn by the soak test (image and video families, MMDiT and DiT); PixArt has
no ComfyUI layout, so its LoRA is saved in diffusers' names."""
CANCELLED, REFUSED = 8, 13
"""The soak's runs (1-based) that are cancelled while training and that carry a bad input."""


def _status(pid: int) -> dict[str, int]:
    """The server process's resident memory (bytes) and thread count, from ``/proc``."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"])}


def _training(family: str, steps: int) -> dict:
    """The shipped train_segmented_lora graph on ``family``'s tiny preset, small and short."""
    graph = copy.deepcopy(api_workflow("train_segmented_lora.api.json"))
    for node in graph.values():
        inputs = node["inputs"]
        if node["class_type"] in ("SegCkptLoadDiffusionModel", "SegCkptSchedule"):
            inputs["family"] = family
        if node["class_type"] == "SegCkptImageCaptionDataset":
            inputs["resolution"] = 64
        if node["class_type"] == "SegCkptTrainLoRA":
            inputs.update(steps=steps, run_name=f"soak_{family}_{uuid.uuid4().hex[:8]}")
        if node["class_type"] == "SegCkptSaveLoRA" and family == "pixart":
            inputs["lora_format"] = "diffusers"
    return graph


class _Planner(threading.Thread):
    """Asks the plan route for one family after another until stopped; keeps every status."""

    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server, self.statuses, self.stop = server, [], threading.Event()

    def run(self) -> None:
        families = list(SOAK_FAMILIES) + ["hunyuanvideo", "qwenimage", "ltxvideo", "lumina2"]
        k = 0
        while not self.stop.wait(0.3):
            family = families[k % len(families)]
            self.statuses.append(self.server.request(f"/segckpt/plan?family={family}&size=tiny"
                                                     f"&gradient_checkpointing_interval={1 + k % 3}")[0])
            k += 1


def test_a_long_lived_server_stays_healthy_through_20_trainings_and_concurrent_plans(fresh_server):
    """Issue 34: 20 queued tiny trainings of mixed families (one cancelled, one with a bad input) while
    plan requests arrive: no HTTP 500, every run succeeds or fails with one line, the server's memory
    after run 20 within 10% of after run 5, and its thread count bounded."""
    server, ws = fresh_server, Socket(fresh_server)
    planner, outcomes, seen = _Planner(server), [], {}
    planner.start()
    try:
        for run in range(1, 21):
            graph = _training(SOAK_FAMILIES[run % len(SOAK_FAMILIES)], 40 if run == CANCELLED else 2)
            if run == REFUSED:
                node_id_of_train = next(k for k, v in graph.items() if v["class_type"] == "SegCkptTrainLoRA")
                graph[node_id_of_train]["inputs"]["learning_rate"] = -1.0
            status, body = queue(server, ws, graph)
            if status != 200:  # refused at /prompt: one error, one line
                errors = [e for n in body["node_errors"].values() for e in n["errors"]]
                outcomes.append(("refused", [e["details"] for e in errors]))
                continue
            if run == CANCELLED:
                ws.wait_for(lambda m, p=body["prompt_id"]: m["type"] == "progress" and m["data"].get("prompt_id") == p
                            and m["data"]["value"] >= 2)
                assert server.request("/interrupt", {})[0] == 200
            end = ws.wait_for(finished(body["prompt_id"]))
            outcomes.append((end["type"], end["data"].get("exception_message")))
            if run in (5, 20):
                seen[run] = _status(server.process.pid)
    finally:
        planner.stop.set()
        planner.join()
        ws.close()
    failed = [message for kind, message in outcomes if kind == "execution_error"]
    assert all("\n" not in message.strip() for message in failed), failed  # one line each
    kinds = [kind for kind, _ in outcomes]
    assert kinds.count("execution_success") == 18 and kinds[CANCELLED - 1] == "execution_interrupted", outcomes
    refused = outcomes[REFUSED - 1]
    assert refused[0] == "refused" and len(refused[1]) == 1 and "\n" not in refused[1][0], refused
    assert "learning_rate=-1" in refused[1][0]
    assert planner.statuses and set(planner.statuses) == {200}, sorted(set(planner.statuses))
    growth = seen[20]["rss"] / seen[5]["rss"]
    print(f"soak: {len(planner.statuses)} plan requests; RSS after run 5 {seen[5]['rss'] / 2**30:.2f} GiB, after run 20 "
          f"{seen[20]['rss'] / 2**30:.2f} GiB ({growth:.3f}x); threads {seen[5]['threads']} -> {seen[20]['threads']}")
    assert growth <= 1.10
    assert seen[20]["threads"] <= seen[5]["threads"] + 2
    assert not live_comfyui.pack_tracebacks(server.log())
