"""What the canvas shows, as rectangles, for the browser test (``test_comfyui_browser.py``).

Two checks a user's eye makes and the frontends do not:

- no node box (title bar included) overlaps another: a node under its neighbour hides widgets;
- nothing the pack draws on its nodes (text, images, rectangles: the loss curve, its step label,
  notes, previews, the block strip, result text) lies on a widget's row, nor outside its node.

The drawn rectangles are recorded from the canvas calls themselves (``fillText``, ``drawImage``,
``fillRect``, ``strokeRect``) while the pack's code draws (a node's ``onDrawForeground`` and the
pack's own widgets, type ``segckpt_*``), not from what that code says it drew; each is mapped to
node coordinates through the context's transform. Widget rows are the frontend's own layout:
``widget.y`` and ``widget.computedHeight``, which both frontends (1.27, 1.58) compute in
``LGraphNode.arrange``.
"""

from __future__ import annotations

NODE_BOXES = """() => {
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  return window.app.graph._nodes.map(n => ({ id: n.id, type: n.type, title: n.title,
    box: [n.pos[0], n.pos[1] - title, n.pos[0] + n.size[0], n.pos[1] + n.size[1]] }));
}"""
"""Every node's box in graph coordinates, its title bar included: ``[x0, y0, x1, y1]``."""

DRAWN = """async ([id, shrink]) => {
  const app = window.app, node = app.graph.getNodeById(id);
  const frames = async (n) => { for (let i = 0; i < n; i++) await new Promise(r => requestAnimationFrame(r)); };
  const capture = (source, ctx, run) => {
    const base = ctx.getTransform().inverse();  // the node's own coordinates when the pack's code starts
    const record = (kind, x0, y0, x1, y1, text) => {
      if (!node.__drawn) return;  // not while the view moves back
      const m = base.multiply(ctx.getTransform());
      const a = m.transformPoint(new DOMPoint(x0, y0)), b = m.transformPoint(new DOMPoint(x1, y1));
      node.__drawn.push({ source, kind, text, x0: Math.min(a.x, b.x), y0: Math.min(a.y, b.y),
                          x1: Math.max(a.x, b.x), y1: Math.max(a.y, b.y) });
    };
    const proto = Object.getPrototypeOf(ctx);
    const hooks = {
      fillText(text, x, y, maxWidth) {
        const m = proto.measureText.call(ctx, text);
        if (m.width > 0) {
          const left = x - m.actualBoundingBoxLeft, right = x + Math.min(m.actualBoundingBoxRight, maxWidth ?? Infinity);
          record("text", left, y - m.actualBoundingBoxAscent, right, y + m.actualBoundingBoxDescent, String(text));
        }
        return proto.fillText.apply(ctx, arguments);
      },
      drawImage(image, ...a) {
        const [x, y, w, h] = a.length >= 8 ? a.slice(4) : a.length >= 4 ? a
          : [a[0], a[1], image.width ?? image.naturalWidth, image.height ?? image.naturalHeight];
        record("image", x, y, x + w, y + h);
        return proto.drawImage.call(ctx, image, ...a);
      },
      fillRect(x, y, w, h) { record("rect", x, y, x + w, y + h); return proto.fillRect.apply(ctx, arguments); },
      strokeRect(x, y, w, h) { record("rect", x, y, x + w, y + h); return proto.strokeRect.apply(ctx, arguments); },
    };
    Object.assign(ctx, hooks);
    try { return run(); } finally { for (const key of Object.keys(hooks)) delete ctx[key]; }
  };
  if (!node.__hooked) {
    node.__hooked = true;
    const foreground = node.onDrawForeground;
    node.onDrawForeground = function (ctx) { return capture("foreground", ctx, () => foreground?.apply(this, arguments)); };
  }
  for (const widget of node.widgets ?? []) {  // the pack's own widgets (results drawn in them)
    if (!String(widget.type).startsWith("segckpt") || widget.__hooked || typeof widget.draw !== "function") continue;
    widget.__hooked = true;
    const draw = widget.draw;
    widget.draw = function (ctx) { return capture(`widget ${widget.name}`, ctx, () => draw.apply(this, arguments)); };
  }
  const size = [...node.size];
  if (shrink) node.setSize(node.computeSize());  // as small as the resize handle allows
  const ds = app.canvas.ds, view = { scale: ds.scale, offset: [...ds.offset] };
  ds.scale = 1;  // the node at full size in the view: drawn whole, widgets included
  ds.offset = [-node.pos[0] + 80, -node.pos[1] + 60];
  await frames(3);
  node.__drawn = [];
  app.canvas.setDirty(true, true);
  await frames(3);
  const visible = (w) => (node.isWidgetRowVisible?.(w) ?? node.isWidgetVisible?.(w) ?? true) && !w.hidden;
  const result = {
    id: node.id, type: node.type, size: [...node.size], drawn: node.__drawn,
    widgets: (node.widgets ?? []).filter(visible).map(w => ({ name: w.name, type: w.type, y0: w.y,
                                                            y1: w.y + (w.computedHeight ?? 0) })),
  };
  node.__drawn = null;
  ds.scale = view.scale;
  ds.offset = view.offset;
  if (shrink) node.setSize(size);
  app.canvas.setDirty(true, true);
  await frames(2);
  return result;
}"""
"""For one node (``[id, shrink]``): its size, its visible widgets' rows ``y0..y1`` and every
rectangle the pack drew on it during one redraw at scale 1, in node coordinates; with ``shrink``
the node is first resized to the smallest size the frontend's resize handle allows (and back after)."""


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def overlapping_nodes(page) -> list[tuple]:
    """Pairs of nodes whose boxes overlap: ``((id, type, box), (id, type, box))``."""
    boxes = page.evaluate(NODE_BOXES)
    return [((a["id"], a["type"], a["box"]), (b["id"], b["type"], b["box"]))
            for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a["box"], b["box"])]


def drawn_over_widgets(page, shrink: bool = False) -> tuple[list[dict], list[str]]:
    """Every pack node's drawing, and what is wrong with it: a rectangle on another widget's row
    or outside the node.

    Returns:
        ``(nodes, problems)``: ``nodes`` as :data:`DRAWN` returns them; one line per rectangle
        that lies on a widget row other than its own widget's, or outside ``0..width x 0..height``.
    """
    ids = page.evaluate("() => window.app.graph._nodes.filter(n => n.type.startsWith('SegCkpt')).map(n => n.id)")
    nodes, problems = [], []
    for node_id in ids:
        node = page.evaluate(DRAWN, [node_id, shrink])
        nodes.append(node)
        width, height = node["size"]
        for box in node["drawn"]:
            what = f"node {node['id']} ({node['type']}, {width:.0f}x{height:.0f}): {box['kind']} {box.get('text') or ''!r} " \
                   f"from {box['source']} at y {box['y0']:.1f}..{box['y1']:.1f}, x {box['x0']:.1f}..{box['x1']:.1f}"
            for widget in node["widgets"]:
                if box["source"] != f"widget {widget['name']}" and box["y0"] < widget["y1"] and widget["y0"] < box["y1"]:
                    problems.append(f"{what} lies on widget {widget['name']} (y {widget['y0']:.0f}..{widget['y1']:.0f})")
            if box["x0"] < -0.5 or box["y0"] < -0.5 or box["x1"] > width + 0.5 or box["y1"] > height + 0.5:
                problems.append(f"{what} lies outside the node")
    return nodes, list(dict.fromkeys(problems))  # a rectangle drawn in several frames: said once


MIN_SIZES = """() => {
  const sizes = {};
  for (const node of window.app.graph._nodes) {
    const [w, h] = node.computeSize(), size = (sizes[node.type] ??= [0, 0]);
    sizes[node.type] = [Math.max(size[0], Math.ceil(w)), Math.max(size[1], Math.ceil(h))];
  }
  return sizes;
}"""
"""Each node type's smallest size on this frontend (``computeSize``: what its resize handle allows
and what it grows a smaller node to), the largest over the graph's nodes of that type."""


def measured_sizes(page) -> dict[str, list[int]]:
    """The graph's node types' smallest sizes, ``{type: [width, height]}`` in pixels (see :data:`MIN_SIZES`)."""
    return page.evaluate(MIN_SIZES)
