// Canvas helpers shared by the pack's node extensions: reserve space under a node's widgets and
// draw into it. Works on the bundled ComfyUI frontend (1.27) and newer ones (1.58): it only uses
// LiteGraph's computeSize / onDrawForeground / setSize / setDirtyCanvas.

/**
 * Reserve `height(node)` pixels at the bottom of every node of `nodeType` and call
 * `draw(node, ctx, area)` there after the node is drawn.
 */
export function addBottomPanel(nodeType, height, draw) {
  const computeSize = nodeType.prototype.computeSize;
  nodeType.prototype.computeSize = function (out) {
    const size = computeSize.apply(this, arguments);
    size[1] += height(this);
    return size;
  };
  const onDrawForeground = nodeType.prototype.onDrawForeground;
  nodeType.prototype.onDrawForeground = function (ctx) {
    const result = onDrawForeground?.apply(this, arguments);
    if (!this.flags?.collapsed) {
      const h = height(this);
      draw(this, ctx, { x: 8, y: this.size[1] - h, w: this.size[0] - 16, h: h - 6 });
    }
    return result;
  };
}

/** Grow the node when its panel got taller (never shrink what the user sized). */
export function fitHeight(node) {
  const wanted = node.computeSize();
  if (node.size[1] < wanted[1]) node.setSize([Math.max(node.size[0], wanted[0]), wanted[1]]);
  node.setDirtyCanvas?.(true, true);
}

let measurer = null;

/** Width in pixels of `text` drawn in `font` (a canvas of its own: no node's context needed). */
export function textWidth(text, font) {
  measurer ??= document.createElement("canvas").getContext("2d");
  measurer.font = font;
  return measurer.measureText(text).width;
}

/** Draw `text` clipped to `width` pixels. */
export function fillText(ctx, text, x, y, width) {
  let shown = String(text);
  while (shown.length > 1 && ctx.measureText(shown).width > width) shown = shown.slice(0, -2) + "…";
  ctx.fillText(shown, x, y);
}
