"""``GET /dashboard``: one self-contained page (no build step, no CDN, nothing fetched but
``/cluster``) that draws the cluster behind this node -- its nodes, their roles, layer ranges
and links -- and live figures: tokens a second, time to first token, requests running and
waiting, each node's health. It polls ``/cluster`` every second; a node that goes down turns
red within one poll of the serving node noticing.

With ``--api-key`` the page itself is served without one (it holds no data) and sends the key
it finds after ``#key=`` in its address with every poll.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mlxcel cluster</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
  header { background: #1d2330; color: #fff; padding: 12px 20px; display: flex; gap: 24px;
           align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  #status { margin-left: auto; font-size: 13px; }
  .figures { display: flex; gap: 12px; padding: 16px 20px 0; flex-wrap: wrap; }
  .figure { background: #fff; border-radius: 8px; padding: 10px 16px; min-width: 110px;
            box-shadow: 0 1px 2px rgba(0,0,0,.08); }
  .figure b { display: block; font-size: 22px; }
  .figure span { color: #667; font-size: 12px; }
  #topology { margin: 16px 20px; background: #fff; border-radius: 8px; width: calc(100% - 40px);
              height: 260px; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
  table { margin: 0 20px 20px; border-collapse: collapse; background: #fff; min-width: 60%; }
  th, td { text-align: left; padding: 6px 12px; border-bottom: 1px solid #e6e8ec; }
  td.health-up { color: #16803c; font-weight: 600; }
  td.health-down { color: #c0262d; font-weight: 600; }
  .node rect { stroke-width: 2; rx: 8; }
  .node[data-up="true"] rect { fill: #e8f6ec; stroke: #16803c; }
  .node[data-up="false"] rect { fill: #fdecec; stroke: #c0262d; }
  .node text { font-size: 12px; text-anchor: middle; }
  .link { stroke: #9aa3b2; stroke-width: 1.5; marker-end: url(#arrow); }
</style>
</head>
<body>
<header><h1>mlxcel</h1><div id="model"></div><div id="mode"></div>
<div id="status">connecting...</div></header>
<div class="figures">
  <div class="figure"><b id="tps">-</b><span>tokens / s</span></div>
  <div class="figure"><b id="ttft">-</b><span>TTFT p50 (ms)</span></div>
  <div class="figure"><b id="running">-</b><span>running</span></div>
  <div class="figure"><b id="waiting">-</b><span>waiting</span></div>
  <div class="figure"><b id="requests">-</b><span>requests served</span></div>
  <div class="figure"><b id="nodes-up">-</b><span>nodes up</span></div>
</div>
<svg id="topology" role="img" aria-label="cluster topology">
  <defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7"
    markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#9aa3b2"/>
  </marker></defs>
  <g id="links"></g><g id="boxes"></g>
</svg>
<table><thead><tr><th>node</th><th>role</th><th>layers</th><th>health</th><th>in flight</th>
<th>sequences</th><th>KV tokens</th><th>last seen</th></tr></thead><tbody id="rows"></tbody>
</table>
<script>
"use strict";
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const headers = key ? {Authorization: "Bearer " + key} : {};
const SVG = "http://www.w3.org/2000/svg";
let previous = null;

function el(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function columns(nodes) {
  // Pipelines read left to right; a router's prefill and decode nodes get a column each.
  const order = ["router", "coordinator", "prefill", "stage", "decode"];
  const byRole = {};
  for (const n of nodes) {
    const col = n.role === "stage" ? "stage:" + n.id : n.role;
    (byRole[col] = byRole[col] || []).push(n);
  }
  return Object.keys(byRole).sort((a, b) => {
    const ra = order.indexOf(a.split(":")[0]), rb = order.indexOf(b.split(":")[0]);
    return ra !== rb ? ra - rb : a.localeCompare(b, undefined, {numeric: true});
  }).map(k => byRole[k]);
}

function draw(view) {
  const svg = document.getElementById("topology");
  const width = svg.clientWidth || 800, height = 260, w = 130, h = 64;
  const cols = columns(view.nodes), at = {};
  cols.forEach((col, i) => col.forEach((n, j) => {
    const x = (i + 0.5) * width / cols.length, y = (j + 0.5) * height / col.length;
    at[n.id] = {x, y};
  }));
  const links = document.getElementById("links"), boxes = document.getElementById("boxes");
  links.replaceChildren(); boxes.replaceChildren();
  for (const [a, b] of view.links) {
    if (!at[a] || !at[b]) continue;
    const dx = at[b].x - at[a].x, sx = Math.sign(dx) || 1;
    if (dx < 0) {  // a link back (results to the coordinator or router): a curve below
      const y = Math.max(at[a].y, at[b].y) + h / 2, mid = (at[a].x + at[b].x) / 2;
      links.append(el("path", {class: "link", fill: "none",
        d: `M${at[a].x},${at[a].y + h / 2} Q${mid},${y + 70} ${at[b].x},${at[b].y + h / 2}`}));
      continue;
    }
    links.append(el("line", {class: "link", x1: at[a].x + sx * w / 2, y1: at[a].y,
      x2: at[b].x - sx * w / 2, y2: at[b].y}));
  }
  for (const n of view.nodes) {
    const g = el("g", {class: "node", "data-id": n.id, "data-up": String(n.up),
      transform: `translate(${at[n.id].x - w / 2},${at[n.id].y - h / 2})`});
    g.append(el("rect", {width: w, height: h}));
    g.append(el("text", {x: w / 2, y: 20, "font-weight": "600"}, n.id));
    g.append(el("text", {x: w / 2, y: 38}, n.role + (n.layers ? " · layers " + n.layers : "")));
    g.append(el("text", {x: w / 2, y: 55}, n.up ? "up" : "DOWN"));
    boxes.append(g);
  }
}

function count(v) {  // 39492874 -> "39.5M", as `mlxcel status` prints it
  for (const [unit, size] of [["G", 1e9], ["M", 1e6], ["k", 1e3]])
    if (v >= size) return (v / size).toFixed(1) + unit;
  return String(v);
}

function row(n) {
  const tr = document.createElement("tr");
  tr.dataset.node = n.id; tr.dataset.up = String(n.up);
  const cells = [n.id, n.role, n.layers || "", n.up ? "up" : "down",
    n.in_flight ?? "", n.sequences ?? "",
    n.kv_tokens == null ? "" : count(n.kv_tokens) + (n.kv_capacity ? " / " + count(n.kv_capacity) : ""),
    n.last_seen_s == null ? "" : n.last_seen_s.toFixed(1) + " s ago"];
  cells.forEach((c, i) => {
    const td = document.createElement("td"); td.textContent = c;
    if (i === 3) td.className = n.up ? "health-up" : "health-down";
    if (i === 3 && n.error) td.title = n.error;
    tr.append(td);
  });
  return tr;
}

function figures(view) {
  const t = view.totals;
  if (previous && view.time > previous.time) {
    const rate = (t.generated_tokens - previous.totals.generated_tokens) / (view.time - previous.time);
    document.getElementById("tps").textContent = rate.toFixed(1);
  }
  document.getElementById("ttft").textContent = t.ttft_ms_p50 == null ? "-" : t.ttft_ms_p50;
  document.getElementById("running").textContent = t.running;
  document.getElementById("waiting").textContent = t.waiting;
  document.getElementById("requests").textContent = t.requests;
  const up = view.nodes.filter(n => n.up).length;
  document.getElementById("nodes-up").textContent = up + " / " + view.nodes.length;
}

async function poll() {
  try {
    const r = await fetch("/cluster", {headers, cache: "no-store"});
    if (r.status === 401) {
      // Reached, but the server has --api-key: say how to give it, not "unreachable".
      document.getElementById("status").textContent = key
        ? "the key after #key= in this address is not this server's --api-key"
        : "this server needs its API key: open this page as /dashboard#key=YOUR_KEY";
      return;
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const view = await r.json();
    document.getElementById("model").textContent = view.model;
    document.getElementById("mode").textContent = view.mode;
    draw(view);
    document.getElementById("rows").replaceChildren(...view.nodes.map(row));
    figures(view);
    previous = view;
    const down = view.nodes.filter(n => !n.up).map(n => n.id);
    document.getElementById("status").textContent =
      (down.length ? "down: " + down.join(", ") : "all nodes up") +
      " · " + new Date().toLocaleTimeString();
    document.body.dataset.polled = String(view.time);
  } catch (e) {
    document.getElementById("status").textContent = "server unreachable (" + e.message + ")";
  }
}
poll();
setInterval(poll, 1000);
</script>
</body>
</html>
"""
