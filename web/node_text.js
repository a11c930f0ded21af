// Run Report, Schedule Planner, Save LoRA, Checkpointing Sweep: the text the node returned in
// `ui.text` is drawn under its widgets after it ran, so the planner's choice, the report's summary
// and the saved file name are on the canvas.
import { app } from "../../scripts/app.js";
import { addBottomPanel, fillText, fitHeight } from "./segckpt_canvas.js";
import { TEXT_NODES, textLines } from "./segckpt_common.js";

const LINE = 14;

function draw(node, ctx, area) {
  const lines = node.segckptText ?? [];
  ctx.save();
  ctx.font = "11px monospace";
  ctx.textBaseline = "top";
  ctx.fillStyle = "#d4d4d8";
  lines.forEach((line, i) => fillText(ctx, line, area.x, area.y + i * LINE, area.w));
  ctx.restore();
}

app.registerExtension({
  name: "segckpt.NodeText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.includes(nodeData.name)) return;
    addBottomPanel(nodeType, (node) => (node.segckptText?.length ? node.segckptText.length * LINE + 8 : 0), draw);
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      const result = onExecuted?.apply(this, arguments);
      if (message?.text) {
        this.segckptText = textLines(message.text);
        fitHeight(this);
      }
      return result;
    };
  },
});
