// Pure parts of web/ (run: node --test tests/js/).
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  FALLBACK_COLOR, frameAt, linkedTrainInput, lossPoints, markStyle, OFFLOAD_KEYS, planQuery, recordLoss, SCHEDULE_KEYS, stripLayout, widgetValue,
} from "../../web/segckpt_common.js";

test("planQuery sends every key and turns interval/stride 0 into unset", () => {
  const values = {
    family: "flux", gradient_checkpointing: true, gradient_checkpointing_backend: "torch",
    gradient_checkpointing_interval: 2, gradient_checkpointing_segment_stride: 0,
    gradient_checkpointing_offload_attention: false, gradient_checkpointing_offload_pin_memory_max_buckets: 12,
    gradient_checkpointing_save_attention: false,
  };
  const q = new URLSearchParams(planQuery(values, "tiny"));
  assert.equal(q.get("family"), "flux");
  assert.equal(q.get("size"), "tiny");
  assert.equal(q.get("gradient_checkpointing_interval"), "2");
  assert.equal(q.get("gradient_checkpointing_segment_stride"), "");
  assert.equal(q.get("gradient_checkpointing"), "true");
  assert.deepEqual([...q.keys()], ["family", "size", ...SCHEDULE_KEYS]);
});

// The marks as the plan serves them (engine/core/plan.py to_dict); test colours, not the engine's.
const MARKS = { C: { color: "#000001", label: "c" }, O: { color: "#000002", label: "o" }, ".": { color: "#000003", label: "p" } };

test("stripLayout gives one row per list and one cell per block, inside the width", () => {
  const plan = { block_map: { double: "CC..CC..", single: "OOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO." }, marks: MARKS };
  const { rows, legend, height } = stripLayout(plan, 300, { label: 60, row: 10, gap: 2 });
  assert.deepEqual(rows.map((r) => r.name), ["double", "single"]);
  assert.equal(rows[0].cells.length, 8);
  assert.equal(rows[1].cells.length, 38);
  assert.equal(rows[1].y, 12);
  assert.equal(height, 24);
  assert.deepEqual(rows[0].cells.map((c) => c.mark).join(""), "CC..CC..");
  for (const row of rows) {
    assert.equal(row.cells[0].x, 60);
    const last = row.cells[row.cells.length - 1];
    assert.ok(last.x + last.w <= 300);
    for (let i = 1; i < row.cells.length; i++) assert.ok(row.cells[i].x >= row.cells[i - 1].x + row.cells[i - 1].w);
  }
  assert.deepEqual(legend, ["C", "O", "."].map((mark) => ({ mark, stream: false })));
});

test("stripLayout orders the legend as the plan's marks, marks it lacks last", () => {
  const marks = { ".": MARKS["."], O: MARKS.O, C: MARKS.C };
  const { legend } = stripLayout({ block_map: { a: "C.?O" }, marks }, 200);
  assert.deepEqual(legend.map((e) => e.mark), [".", "O", "C", "?"]);
});

test("markStyle reads the plan's marks and falls back to a neutral colour for an unknown mark", () => {
  const plan = { marks: MARKS, stream_marks: { S: { color: "#000004", label: "s", base: "#000003" } } };
  assert.equal(markStyle(plan, "O"), MARKS.O);
  assert.equal(markStyle(plan, "S", true).color, "#000004");
  assert.deepEqual(markStyle(plan, "S"), { color: FALLBACK_COLOR, label: "S" }, "a stream mark is not a block mark");
  assert.deepEqual(markStyle(plan, "?"), { color: FALLBACK_COLOR, label: "?" });
  assert.deepEqual(markStyle({}, "C"), { color: FALLBACK_COLOR, label: "C" }, "a plan without marks");
  assert.deepEqual(markStyle(plan, "toString"), { color: FALLBACK_COLOR, label: "toString" }, "own keys only");
});

test("stripLayout of an empty plan is empty", () => {
  assert.deepEqual(stripLayout({}, 200), { rows: [], legend: [], height: 0 });
});

test("recordLoss appends in order and restarts on a new run", () => {
  let h = [];
  h = recordLoss(h, { step: 1, loss: 0.9 });
  h = recordLoss(h, { step: 2, loss: 0.7 });
  assert.deepEqual(h, [{ step: 1, loss: 0.9 }, { step: 2, loss: 0.7 }]);
  const again = recordLoss(h, { step: 1, loss: 0.8 });
  assert.deepEqual(again, [{ step: 1, loss: 0.8 }]);
  assert.equal(h.length, 2, "input not changed");
});

test("lossPoints maps the first step to the left edge and the max loss to the top", () => {
  const box = { x: 10, y: 20, w: 100, h: 50 };
  const { points, min, max } = lossPoints([{ step: 1, loss: 2 }, { step: 2, loss: NaN }, { step: 3, loss: 1 }], box, 5);
  assert.equal(min, 1);
  assert.equal(max, 2);
  assert.deepEqual(points[0], [10, 20]);
  assert.deepEqual(points[1], [60, 70]);
  assert.equal(lossPoints([], box).points.length, 0);
  const flat = lossPoints([{ step: 1, loss: 3 }], box);
  assert.deepEqual(flat.points, [[10, 70]]);
});

test("linkedTrainInput follows schedule -> train.<input> -> node", () => {
  const loader = { widgets: [{ name: "source", value: "(tiny preset)" }, { name: "family", value: "wan" }] };
  const offload = { widgets: [] };
  const train = {
    inputs: [{ name: "model" }, { name: "dataset" }, { name: "offload" }],
    getInputNode: (slot) => ({ 0: loader, 2: offload })[slot] ?? null,
  };
  const schedule = { getOutputNodes: (slot) => (slot === 0 ? [train] : null) };
  assert.equal(linkedTrainInput(schedule, "model"), loader);
  assert.equal(linkedTrainInput(schedule, "offload"), offload);
  assert.equal(linkedTrainInput(schedule, "lora_config"), null);
  assert.equal(widgetValue(loader, "family"), "wan");
  assert.equal(linkedTrainInput({ getOutputNodes: () => null }, "model"), null);
  assert.equal(linkedTrainInput({}, "model"), null);
  assert.deepEqual(OFFLOAD_KEYS, ["gradient_checkpointing_backend", "gradient_checkpointing_offload_attention",
    "gradient_checkpointing_offload_pin_memory_max_buckets"]);
  assert.equal(widgetValue(null, "x"), undefined);
});

test("textLines keeps every line", async () => {
  const { textLines, TEXT_NODES } = await import("../../web/segckpt_common.js");
  assert.deepEqual(textLines(["a\nb", "c"]), ["a", "b", "c"]);
  const many = Array.from({ length: 40 }, (_, i) => `line ${i} ${"x".repeat(150)}`);
  assert.deepEqual(textLines(many.join("\n")), many);
  assert.ok(TEXT_NODES.includes("SegCkptSaveLoRA") && TEXT_NODES.includes("SegCkptSchedulePlanner"));
});

test("wrapLines breaks at spaces and inside file names, indents the rest, loses nothing", async () => {
  const { wrapLines } = await import("../../web/segckpt_common.js");
  const chars = (text) => text.length;  // one unit per character, as a monospace font
  const saved = "saved models/loras/segckpt_segmented_lora_00001.safetensors (3 steps, rank 16, alpha 16)";
  assert.deepEqual(wrapLines([saved], 40, chars), [
    "saved models/loras/segckpt_segmented_", "  lora_00001.safetensors (3 steps, rank", "  16, alpha 16)"]);
  assert.deepEqual(wrapLines(["  legend: C = checkpointed block (recomputed)"], 24, chars),
                   ["  legend: C =", "    checkpointed block", "    (recomputed)"]);
  assert.deepEqual(wrapLines(["x".repeat(25)], 10, chars), ["xxxxxxxxxx", "  xxxxxxxx", "  xxxxxxx"]);
  assert.deepEqual(wrapLines(["short", ""], 10, chars), ["short", ""]);
  const text = "peak train 1x16x8x8: 0.548 MiB; gradient_checkpointing_interval=2: saves 0.205 MiB, costs 6%";
  for (const width of [12, 20, 33, 50]) {
    const lines = wrapLines([text], width, chars);
    assert.ok(lines.every((line) => line.length <= width), `${width}: ${lines}`);
    assert.equal(lines.map((l) => l.trim()).join("").replace(/ /g, ""), text.replace(/ /g, ""));
  }
});

test("previewUrl names the output file for ComfyUI's /view route", async () => {
  const { previewUrl } = await import("../../web/segckpt_common.js");
  const url = previewUrl({ filename: "step_00004_prompt0.png", subfolder: "segckpt/run_00001/previews", type: "output" });
  assert.equal(url, "/view?filename=step_00004_prompt0.png&subfolder=segckpt%2Frun_00001%2Fpreviews&type=output");
});

test("frameAt loops over the frames by their durations", () => {
  const durations = [125, 125, 250];
  assert.equal(frameAt(durations, 0), 0);
  assert.equal(frameAt(durations, 124), 0);
  assert.equal(frameAt(durations, 125), 1);
  assert.equal(frameAt(durations, 260), 2);
  assert.equal(frameAt(durations, 500), 0);  // looped
  assert.equal(frameAt([], 40), 0);
});
