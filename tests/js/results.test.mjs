// Train LoRA's results layout (run: node --test tests/js/).
import assert from "node:assert/strict";
import { test } from "node:test";

import { TRAIN_PANEL, trainPanelLayout } from "../../web/segckpt_common.js";

const overlap = (a, b) => a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
const parts = (layout) => [layout.label, layout.curve, ...layout.notes, layout.previewLabel, ...layout.images].filter(Boolean);

test("trainPanelLayout stacks label, curve, notes and previews, each inside the reserved height", () => {
  const layout = trainPanelLayout(300, 2, 4);
  assert.deepEqual(layout.label, { x: 0, y: 0, w: 300, h: 16 });
  assert.deepEqual(layout.curve, { x: 0, y: 16, w: 300, h: 72 });
  assert.deepEqual(layout.notes, [{ x: 0, y: 94, w: 300, h: 14 }, { x: 0, y: 108, w: 300, h: 14 }]);
  assert.deepEqual(layout.previewLabel, { x: 0, y: 122, w: 300, h: 16 });
  // 92 px squares, 4 px apart: three fit in 300 px, the fourth starts a second row
  assert.deepEqual(layout.images.map((b) => [b.x, b.y, b.w]), [[0, 138, 92], [96, 138, 92], [192, 138, 92], [0, 234, 92]]);
  assert.equal(layout.height, 234 + 92 + 6);
  const all = parts(layout);
  for (const box of all) assert.ok(box.x >= 0 && box.y >= 0 && box.x + box.w <= 300 && box.y + box.h <= layout.height, box);
  all.forEach((a, i) => all.slice(i + 1).forEach((b) => assert.ok(!overlap(a, b), `${JSON.stringify(a)} ${JSON.stringify(b)}`)));
});

test("trainPanelLayout before a run: the label and the empty curve only", () => {
  const layout = trainPanelLayout(250, 0, 0);
  assert.deepEqual(layout.notes, []);
  assert.equal(layout.previewLabel, null);
  assert.deepEqual(layout.images, []);
  assert.equal(layout.height, TRAIN_PANEL.label + TRAIN_PANEL.curve + TRAIN_PANEL.gap);
});

test("trainPanelLayout in a node narrower than one preview: the preview shrinks to the width", () => {
  const layout = trainPanelLayout(60, 0, 2);
  assert.deepEqual(layout.images.map((b) => [b.x, b.y, b.w, b.h]), [[0, 110, 60, 60], [0, 174, 60, 60]]);
  assert.equal(layout.height, 174 + 60 + 6);
});
