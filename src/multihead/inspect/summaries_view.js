// multihead summaries page: every head's summaries as a grid, and the chosen head's pattern
// (block sums) and top-k rows. Reads the JSON in #mh-data (format: multihead/inspect/summaries_html.py);
// token text only ever goes through textContent. Makes no network request. D, $, el and bytes: page.js.
"use strict";
(() => {
  /* include: page.js */

  const T = D.T, NL = D.layers.length, NH = D.heads.length;
  const LABEL = {entropy: "entropy (nats)", mean_distance: "mean distance (tokens)", first_token_mass: "first-token mass",
    previous_token: "previous token", duplicate_token: "duplicate token", induction: "induction",
    beyond_1k: "mass beyond 1K back", beyond_4k: "mass beyond 4K back", normalized_entropy: "entropy / log n",
    current_token: "current token", first_token: "first token", delimiter: "delimiter", next_token: "next token"};

  function fmt(v) {
    if (v === null || v === undefined) return "-";
    return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(3);
  }
  function colour(t) { // 0..1 -> white .. dark blue
    const a = Math.max(0, Math.min(1, t));
    const r = Math.round(255 - a * 226), g = Math.round(255 - a * 178), b = Math.round(255 - a * 40);
    return `rgb(${r},${g},${b})`;
  }

  // --- header
  $("mh-summary").textContent = `${D.model}: ${T.toLocaleString()} tokens, ${NL} layers \u00d7 ${NH} heads`;
  for (const n of D.notes) $("mh-note").appendChild(el("li", null, n));

  // --- patterns
  const coarse = {g: D.coarse.g, data: bytes(D.coarse.data), index: new Map(D.coarse.heads.map((k, i) => [k, i]))};
  const detail = new Map();
  for (const key of D.detail.heads) {
    const idxBytes = bytes(D.detail.top_index[key] || "");
    detail.set(key, {
      pattern: bytes(D.detail.pattern[key] || ""),
      index: idxBytes.length ? (D.detail.index_bytes === 4 ? new Uint32Array(idxBytes.buffer) : new Uint16Array(idxBytes.buffer)) : null,
      weight: D.detail.top_weight[key] ? new Uint16Array(bytes(D.detail.top_weight[key]).buffer) : null,
    });
  }

  // --- the grid
  const fieldSel = $("mh-field");
  for (const f of D.fields) {
    const o = el("option", null, LABEL[f] || f);
    o.value = f;
    fieldSel.appendChild(o);
  }
  const grid = $("mh-grid");
  const cells = [];
  const head = el("tr");
  head.appendChild(el("th", null, "layer"));
  for (const h of D.heads) head.appendChild(el("th", null, String(h)));
  grid.appendChild(head);
  for (let li = 0; li < NL; li++) {
    const tr = el("tr");
    tr.appendChild(el("th", null, String(D.layers[li])));
    cells.push([]);
    for (let hi = 0; hi < NH; hi++) {
      const td = el("td");
      const key = `${D.layers[li]},${D.heads[hi]}`;
      if (detail.has(key) && detail.get(key).index) td.classList.add("mh-detail");
      td.addEventListener("click", () => choose(li, hi));
      tr.appendChild(td);
      cells[li].push(td);
    }
    grid.appendChild(tr);
  }
  function paintGrid() {
    const f = fieldSel.value, vals = D.values[f];
    let lo = Infinity, hi = -Infinity;
    for (const row of vals) for (const v of row) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    $("mh-range").textContent = isFinite(lo) ? `light ${fmt(lo)} \u2026 dark ${fmt(hi)}` : "not defined for this text";
    for (let li = 0; li < NL; li++) for (let hi2 = 0; hi2 < NH; hi2++) {
      const v = vals[li][hi2], td = cells[li][hi2];
      const key = `${D.layers[li]},${D.heads[hi2]}`, role = D.roles[key];
      td.style.background = v === null ? "" : colour(hi > lo ? (v - lo) / (hi - lo) : 0.5);
      td.classList.toggle("mh-na", v === null);
      td.title = `layer ${D.layers[li]} head ${D.heads[hi2]}: ${LABEL[f] || f} ${fmt(v)}` +
        (role ? `\nrole: ${role.role} ${role.score.toFixed(2)} (rank ${role.rank})` : "");
    }
  }
  fieldSel.addEventListener("change", paintGrid);

  // --- the chosen head
  const canvas = $("mh-pattern"), ctx = canvas.getContext("2d");
  let cur = null;
  function choose(li, hi) {
    if (cur) cells[cur.li][cur.hi].classList.remove("mh-sel");
    const key = `${D.layers[li]},${D.heads[hi]}`;
    cur = {li, hi, key, d: detail.get(key) || null};
    cells[li][hi].classList.add("mh-sel");
    const role = D.roles[key];
    $("mh-head-title").textContent = `Layer ${D.layers[li]}, head ${D.heads[hi]}` + (role ? ` \u2014 ${role.role}` : "");
    $("mh-head-scores").textContent = D.fields.map((f) => `${LABEL[f] || f} ${fmt(D.values[f][li][hi])}`).join(" \u00b7 ");
    drawPattern();
    showRow(Number($("mh-pos").value) || 0);
  }
  function drawPattern() {
    let g, q;
    if (cur.d && cur.d.pattern.length) { g = D.grid; q = cur.d.pattern; }
    else if (coarse.index.has(cur.key)) { g = coarse.g; const i = coarse.index.get(cur.key); q = coarse.data.subarray(i * g * g, (i + 1) * g * g); }
    if (!g) { ctx.clearRect(0, 0, canvas.width, canvas.height); return; }
    canvas.width = g; canvas.height = g;
    const img = ctx.createImageData(g, g);
    for (let i = 0; i < g * g; i++) {
      const a = q[i] / 255;
      img.data[4 * i] = Math.round(255 - a * 226);
      img.data[4 * i + 1] = Math.round(255 - a * 178);
      img.data[4 * i + 2] = Math.round(255 - a * 40);
      img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
  function showRow(pos) {
    pos = Math.max(0, Math.min(T - 1, Math.floor(pos)));
    $("mh-pos").value = String(pos);
    $("mh-row-title").textContent = `query ${pos}: ${JSON.stringify(D.tokens[pos])}`;
    const ctxBox = $("mh-context");
    ctxBox.textContent = "";
    const a = Math.max(0, pos - 12);
    ctxBox.appendChild(document.createTextNode((a > 0 ? "\u2026" : "") + D.tokens.slice(a, pos).join(" ") + " "));
    ctxBox.appendChild(el("mark", null, D.tokens[pos]));
    const top = $("mh-top");
    top.textContent = "";
    if (!cur || !cur.d || !cur.d.index) {
      top.appendChild(el("tr")).appendChild(el("td", null, "top-k rows are kept for the heads marked \u2022 only"));
      return;
    }
    const K = D.detail.k, hdr = el("tr");
    for (const t of ["key", "token", "back", "weight", ""]) hdr.appendChild(el("th", null, t));
    top.appendChild(hdr);
    for (let j = 0; j < K; j++) {
      const key = cur.d.index[pos * K + j];
      if (key === D.detail.none) break;
      const w = cur.d.weight[pos * K + j] / 65535;
      const tr = el("tr");
      tr.appendChild(el("td", null, String(key)));
      tr.appendChild(el("td", null, JSON.stringify(D.tokens[key])));
      tr.appendChild(el("td", null, String(pos - key)));
      tr.appendChild(el("td", null, w.toFixed(4)));
      const bar = el("span", "mh-bar");
      bar.style.width = `${Math.round(120 * w)}px`;
      tr.appendChild(el("td")).appendChild(bar);
      top.appendChild(tr);
    }
  }
  canvas.addEventListener("mousemove", (e) => {
    if (!cur) return;
    const r = canvas.getBoundingClientRect();
    showRow(((e.clientY - r.top) / r.height) * T);
  });
  $("mh-pos").addEventListener("change", (e) => showRow(Number(e.target.value) || 0));

  paintGrid();
  // open on the best-ranked head with details, else the first head
  let start = [0, 0];
  const ranked = Object.entries(D.roles).sort((x, y) => x[1].rank - y[1].rank);
  for (const [key] of ranked) {
    if (!detail.has(key)) continue;
    const [l, h] = key.split(",").map(Number);
    start = [D.layers.indexOf(l), D.heads.indexOf(h)];
    break;
  }
  choose(start[0], start[1]);
})();
