// Run Report, Schedule Planner, Save LoRA, Checkpointing Sweep: the text the node returned in
// `ui.text` is drawn on the node after it ran, whole: a widget after the node's own widgets (so an
// image the node shows, the sweep's plot, comes below it, not over it), each line wrapped to the
// node's width and the node as tall as the text: a results widget (segckpt_canvas.js).
import { app } from "../../scripts/app.js";
import { PAD, resultsWidget, textWidth } from "./segckpt_canvas.js";
import { TEXT_NODES, textLines, wrapLines } from "./segckpt_common.js";

const NAME = "segckpt_result_text";
const FONT = "11px monospace";
const LINE = 14;
const MIN_WIDTH = 420;  // a node narrower than this (Run Report's default, 140 px) is widened to it

const measure = (text) => textWidth(text, FONT);

/** The node's text as drawn: its lines wrapped to the node's width (cached per width). */
function wrapped(node) {
  const width = node.size[0] - 2 * PAD;
  if (node.segckptWrapped?.width !== width) {
    node.segckptWrapped = { width, lines: wrapLines(node.segckptText ?? [], width, measure) };
  }
  return node.segckptWrapped.lines;
}

const height = (node) => wrapped(node).length * LINE + PAD;

function draw(node, ctx, area) {
  const lines = wrapped(node);
  ctx.save();
  ctx.font = FONT;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillStyle = "#d4d4d8";
  lines.forEach((line, i) => ctx.fillText(line, area.x, area.y + PAD / 2 + i * LINE));
  ctx.restore();
  // what was drawn, in node coordinates (the browser test checks it fits the node)
  node.segckptDrawn = { lines, x: area.x, y: area.y + PAD / 2, line: LINE, font: FONT };
}

/** Show `lines` on the node: widen a narrow node, grow it to the text's height. */
function showText(node, lines) {
  node.segckptText = lines;
  node.segckptWrapped = null;
  const widget = resultsWidget(node, NAME, height, draw);
  const images = node.widgets.filter((w) => w !== widget && w.name?.includes("image-preview"));
  if (images.length) {  // the image (the sweep's plot) goes under the text
    node.widgets = [...node.widgets.filter((w) => !images.includes(w)), ...images];
  }
  const width = Math.max(node.size[0], MIN_WIDTH);
  node.size[0] = width;
  const wanted = node.computeSize([width, node.size[1]]);
  node.setSize([width, Math.max(node.size[1], wanted[1])]);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "segckpt.NodeText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      const result = onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, textLines(message.text));
      return result;
    };
  },
});
