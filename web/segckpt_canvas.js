// Canvas helpers shared by the pack's node extensions: a results widget that reserves space below
// a node's widgets and draws into it. A widget, not a drawing over the node's bottom edge: the
// frontend lays widgets out one under the other (LGraphNode.arrange sets each widget's y; a
// multiline text box takes whatever height is left), so only a widget of its own keeps the
// results off the other widgets' rows, at any node size. Works on the bundled ComfyUI frontend
// (1.27) and newer ones (1.58): a LiteGraph custom widget (draw, computeSize) and setSize only.

/** The results' left and right margin inside the node (pixels). */
export const PAD = 8;

/**
 * The results widget `name` of `node`, added after its widgets when it has none yet: `height(node)`
 * pixels tall, drawn by `draw(node, ctx, area)` with `area` = {x, y, w, h} in node coordinates.
 * Not a prompt input and not saved in the workflow (serialize false).
 */
export function resultsWidget(node, name, height, draw) {
  const found = node.widgets?.find((w) => w.name === name);
  if (found) return found;
  const widget = {
    name,
    type: "segckpt_results",
    value: "",
    serialize: false,
    options: { serialize: false },
    computeSize(width) {
      return [width ?? node.size[0], height(node)];
    },
    draw(ctx, _node, width, y) {
      draw(node, ctx, { x: PAD, y, w: (width ?? node.size[0]) - 2 * PAD, h: height(node) });
    },
  };
  if (node.addCustomWidget) node.addCustomWidget(widget);
  else (node.widgets ??= []).push(widget);
  return node.widgets.find((w) => w.name === name) ?? widget;  // 1.58 keeps a wrapped copy
}

/** Give every new node of `nodeType` the results widget (see resultsWidget) at its creation. */
export function addResultsWidget(nodeType, name, height, draw) {
  const onNodeCreated = nodeType.prototype.onNodeCreated;
  nodeType.prototype.onNodeCreated = function () {
    const result = onNodeCreated?.apply(this, arguments);
    resultsWidget(this, name, height, draw);
    fitHeight(this);
    return result;
  };
}

/** Grow the node when its results got taller (never shrink what the user sized). */
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
