// Weight streaming on the block strip (run: node --test tests/js/).
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  linkedTrainInput, markStyle, planQuery, SCHEDULE_KEYS, STREAM_KEYS, stripLayout,
} from "../../web/segckpt_common.js";

// The marks as the plan serves them (engine/core/plan.py to_dict); test colours, not the engine's.
const MARKS = { C: { color: "#000001", label: "c" }, O: { color: "#000002", label: "o" }, ".": { color: "#000003", label: "p" } };
const STREAM_MARKS = { S: { color: "#000004", label: "streamed", base: "#000003" } };

test("stripLayout marks exactly the streamed cells and adds the stream legend entry last", () => {
  const plan = {
    block_map: { double: "CC..CC..", single: "OOOO" },
    stream_map: { double: "..S.S..S", single: "S..." },
    streamed_blocks: 4, marks: MARKS, stream_marks: STREAM_MARKS,
  };
  const { rows, legend } = stripLayout(plan, 300);
  for (const row of rows) {
    const marks = row.cells.map((c) => c.stream ?? ".").join("");
    assert.equal(marks, plan.stream_map[row.name], row.name);
  }
  assert.equal(rows[0].cells.map((c) => c.mark).join(""), "CC..CC..", "block marks unchanged");
  assert.deepEqual(legend, [...["C", "O", "."].map((mark) => ({ mark, stream: false })), { mark: "S", stream: true }]);
  assert.equal(markStyle(plan, "S", true), STREAM_MARKS.S);
  assert.equal(markStyle(plan, "C"), MARKS.C);
});

test("stripLayout without streaming marks no cell and adds no stream entry", () => {
  for (const plan of [{ block_map: { blocks: "CC.." } }, { block_map: { blocks: "CC.." }, stream_map: {} },
    { block_map: { blocks: "CC.." }, stream_map: { blocks: "...." }, stream_marks: STREAM_MARKS }]) {
    const { rows, legend } = stripLayout({ marks: MARKS, ...plan }, 200);
    assert.ok(rows[0].cells.every((c) => c.stream === null));
    assert.ok(legend.every((e) => !e.stream));
  }
  // a list missing from the stream map streams nothing
  const { rows } = stripLayout({ block_map: { a: "..", b: ".." }, stream_map: { a: "SS" }, stream_marks: STREAM_MARKS }, 200);
  assert.deepEqual(rows.map((r) => r.cells.map((c) => c.stream)), [["S", "S"], [null, null]]);
  // a stream map of a plan that serves no stream marks draws no band
  assert.ok(stripLayout({ block_map: { a: ".." }, stream_map: { a: "SS" } }, 200).rows[0].cells.every((c) => !c.stream));
});

test("planQuery sends the stream keys after the schedule's, blocks 0 as all", () => {
  const values = {
    family: "flux", gradient_checkpointing: true, gradient_checkpointing_interval: 0,
    weight_offload: "stream", weight_offload_blocks: 0, weight_offload_prefetch: 2,
  };
  const q = new URLSearchParams(planQuery(values, "tiny"));
  assert.deepEqual([...q.keys()], ["family", "size", "gradient_checkpointing", "gradient_checkpointing_interval",
    ...STREAM_KEYS]);
  assert.equal(q.get("weight_offload"), "stream");
  assert.equal(q.get("weight_offload_blocks"), "all");
  assert.equal(q.get("weight_offload_prefetch"), "2");
  const eight = new URLSearchParams(planQuery({ ...values, weight_offload_blocks: 8 }));
  assert.equal(eight.get("weight_offload_blocks"), "8");
  // without a Weight Offload Options node, no stream key is sent (the engine's default: none)
  const plain = new URLSearchParams(planQuery({ family: "flux", gradient_checkpointing: true }));
  assert.ok(STREAM_KEYS.every((key) => !plain.has(key)));
  assert.deepEqual(STREAM_KEYS, ["weight_offload", "weight_offload_blocks", "weight_offload_prefetch"]);
  assert.ok(STREAM_KEYS.every((key) => !SCHEDULE_KEYS.includes(key)));
});

test("linkedTrainInput finds the Weight Offload Options node on train.weight_offload", () => {
  const weights = { widgets: [{ name: "weight_offload", value: "stream" }] };
  const train = { inputs: [{ name: "model" }, { name: "weight_offload" }], getInputNode: (slot) => (slot === 1 ? weights : null) };
  const schedule = { getOutputNodes: () => [train] };
  assert.equal(linkedTrainInput(schedule, "weight_offload"), weights);
  assert.equal(linkedTrainInput(schedule, "offload"), null);
});
