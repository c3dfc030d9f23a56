// multihead head view + model view. Reads the JSON in #mh-data (format: multihead/inspect/html.py,
// _encode) and draws everything with DOM/SVG/canvas APIs; token text only ever goes through
// textContent, never innerHTML. Makes no network request. D, $, el and bytes: page.js.
"use strict";
(() => {
  /* include: page.js */

  const T = D.tokens.length, K = D.k, NL = D.layers.length, NH = D.heads.length;
  const ROW = 20, SVG_W = 220;
  const IDLE_MIN = 0.05, IDLE_CAP = 3000; // lines drawn with no token hovered
  const SVG_NS = "http://www.w3.org/2000/svg";

  // --- weights: row r = (l * NH + h) * T + t holds K entries (q, idx), scale[r] = row max.
  const Q = bytes(D.q);
  const SCALE = new Float32Array(bytes(D.scale).buffer);
  let IDX = null;
  if (!D.dense) {
    const raw = bytes(D.idx);
    if (D.idx_bytes === 1) IDX = raw;
    else {
      IDX = new Uint16Array(raw.length / 2);
      for (let i = 0; i < IDX.length; i++) IDX[i] = raw[2 * i] | (raw[2 * i + 1] << 8);
    }
  }
  const rowOf = (l, h, t) => (l * NH + h) * T + t;
  const weight = (r, j) => (Q[r * K + j] * SCALE[r]) / 255;
  const keyOf = (r, j) => (IDX ? IDX[r * K + j] : j);

  const hue = (h) => (h * 137.508 + 210) % 360;
  const colour = (h, a = 1) => `hsla(${hue(h).toFixed(1)}, 70%, 45%, ${a})`;
  const show = (tok) => (tok === "" ? "\u2205" : tok);
  const roles = new Map(D.roles.map((r) => [`${r.layer}:${r.head}`, r]));
  const roleOf = (l, h) => roles.get(`${D.layers[l]}:${D.heads[h]}`);
  const roleLabel = (r) => `${r.role.replace(/_/g, " ")} ${r.score.toFixed(2)}`;
  const SHORT = {
    previous_token: "prev", current_token: "self", first_token: "first", delimiter: "delim",
    duplicate_token: "dup", induction: "induct",
  };
  const roleShort = (r) =>
    r.role === "broad" || r.role === "mixed" // no dominant role: the word says it, the score would not fit
      ? r.role
      : `${SHORT[r.role] || r.role.replace(/_/g, " ")} ${r.score.toFixed(2).replace(/^0/, "")}`;
  const roleTitle = (r) =>
    Object.entries(r.scores).map(([name, v]) => `${name}: ${Number(v).toFixed(3)}`).join("\n");

  // viridis at 9 stops, looked up by sqrt(weight) so that broad heads stay visible.
  const STOPS = [
    [68, 1, 84], [71, 45, 123], [59, 82, 139], [44, 114, 142], [33, 145, 140],
    [40, 174, 128], [94, 201, 98], [173, 220, 48], [253, 231, 37],
  ];
  const LUT = new Uint8Array(256 * 3);
  for (let i = 0; i < 256; i++) {
    const x = (i / 255) * (STOPS.length - 1), a = Math.min(Math.floor(x), STOPS.length - 2), f = x - a;
    for (let c = 0; c < 3; c++) LUT[3 * i + c] = Math.round(STOPS[a][c] * (1 - f) + STOPS[a + 1][c] * f);
  }
  const lut = (w) => 3 * Math.round(Math.sqrt(Math.min(1, Math.max(0, w))) * 255);

  // The page opens on the top-ranked head: its layer in the head view, its heatmap in focus.
  const START = D.start || { l: 0, h: 0 };
  const state = { layer: NL ? START.l : 0, sel: new Set(D.heads.map((_, h) => h)), hover: null, focus: null };

  // --- header: one line of summary (each metadata value cut to a line, the input text left
  // out), and the full title and metadata on demand.
  const META = D.meta || {}, META_SHORT = D.meta_short || META;
  $("mh-summary").textContent =
    `${D.model || "model"} \u00b7 ${T} tokens \u00b7 layers ${D.layers.join(", ")} of ${D.n_layers}` +
    ` \u00b7 heads ${D.heads.join(", ")} of ${D.n_heads}` +
    Object.keys(META).filter((k) => k !== "text").map((k) => ` \u00b7 ${k}: ${META_SHORT[k]}`).join("");
  const cut = (D.title_full && D.title_full !== D.title) || Object.keys(META).some((k) => META[k] !== META_SHORT[k]);
  if (cut || META.text) {
    const body = $("mh-full-body"), list = el("dl");
    if (D.title_full) {
      list.append(el("dt", "", "title"), el("dd", "", D.title_full));
    }
    for (const [k, v] of Object.entries(META)) list.append(el("dt", "", k), el("dd", "", v));
    body.append(list);
    const n = (META.text || D.title_full || "").length;
    $("mh-full-summary").textContent = `full text and metadata (${n.toLocaleString("en")} characters)`;
    $("mh-full").hidden = false;
  }
  for (const line of D.note) $("mh-note").append(el("li", "", line));

  // --- head view
  const layerSel = $("mh-layer");
  D.layers.forEach((layer, l) => {
    const o = el("option", "", String(layer));
    o.value = String(l);
    layerSel.append(o);
  });
  layerSel.value = String(state.layer);
  layerSel.addEventListener("change", () => {
    state.layer = Number(layerSel.value);
    buildHeads();
    draw();
  });

  function buildHeads() {
    const box = $("mh-heads");
    box.replaceChildren();
    D.heads.forEach((head, h) => {
      const b = el("button", "mh-head");
      b.type = "button";
      b.dataset.h = String(h);
      b.style.setProperty("--c", colour(h));
      b.append(el("span", "mh-head-name", `H${head}`));
      const r = roleOf(state.layer, h);
      if (r) {
        const badge = el("span", "mh-badge", roleLabel(r));
        b.title = roleTitle(r);
        b.append(badge);
      }
      b.addEventListener("click", () => {
        if (state.sel.has(h)) state.sel.delete(h);
        else state.sel.add(h);
        refreshHeads();
        draw();
      });
      box.append(b);
    });
    refreshHeads();
  }

  function refreshHeads() {
    for (const b of document.querySelectorAll("button.mh-head")) {
      const on = state.sel.has(Number(b.dataset.h));
      b.classList.toggle("mh-off", !on);
      b.setAttribute("aria-pressed", String(on));
    }
  }
  $("mh-all").addEventListener("click", () => {
    state.sel = new Set(D.heads.map((_, h) => h));
    refreshHeads();
    draw();
  });
  $("mh-none").addEventListener("click", () => {
    state.sel.clear();
    refreshHeads();
    draw();
  });

  const svg = $("mh-svg");
  svg.setAttribute("width", String(SVG_W));
  svg.setAttribute("height", String(T * ROW));
  const toks = { q: [], k: [] };
  for (const [col, side] of [[$("mh-left"), "q"], [$("mh-right"), "k"]]) {
    D.tokens.forEach((tok, i) => {
      const e = el("div", "mh-tok", show(tok));
      e.dataset.i = String(i);
      e.dataset.side = side;
      e.title = `${i}: ${tok} (id ${D.token_ids[i]})`;
      col.append(e);
      toks[side].push(e);
    });
    col.addEventListener("mouseover", (ev) => {
      const t = ev.target.closest(".mh-tok");
      if (t && (!state.hover || state.hover.t !== Number(t.dataset.i) || state.hover.side !== side)) {
        state.hover = { side, t: Number(t.dataset.i) };
        draw();
      }
    });
    col.addEventListener("mouseleave", () => {
      state.hover = null;
      draw();
    });
  }

  const yOf = (i) => i * ROW + ROW / 2;
  function line(frag, from, to, w, h, idle) {
    const e = document.createElementNS(SVG_NS, "line");
    e.setAttribute("x1", "0");
    e.setAttribute("y1", String(yOf(from)));
    e.setAttribute("x2", String(SVG_W));
    e.setAttribute("y2", String(yOf(to)));
    e.setAttribute("stroke", colour(h));
    e.setAttribute("stroke-width", (idle ? 0.4 + 2.5 * w : 0.6 + 6 * w).toFixed(2));
    e.setAttribute("stroke-opacity", (idle ? 0.15 + 0.5 * w : 0.35 + 0.65 * w).toFixed(2));
    e.dataset.h = String(h);
    e.dataset.w = w.toFixed(4);
    frag.append(e);
  }

  function draw() {
    const l = state.layer, frag = document.createDocumentFragment();
    for (const side of ["q", "k"]) {
      for (const e of toks[side]) {
        e.classList.remove("mh-hover");
        e.style.backgroundColor = "";
      }
    }
    let n = 0;
    if (state.hover) {
      const { side, t } = state.hover;
      const best = new Float32Array(T), bestHead = new Int32Array(T).fill(-1);
      const mark = (i, w, h) => {
        if (w > best[i]) {
          best[i] = w;
          bestHead[i] = h;
        }
      };
      for (const h of state.sel) {
        if (side === "q") {
          const r = rowOf(l, h, t);
          for (let j = 0; j < K; j++) {
            const w = weight(r, j);
            if (w <= 0) continue;
            line(frag, t, keyOf(r, j), w, h, false);
            mark(keyOf(r, j), w, h);
            n++;
          }
        } else {
          for (let q = 0; q < T; q++) {
            const r = rowOf(l, h, q);
            for (let j = 0; j < K; j++) {
              if (keyOf(r, j) !== t) continue;
              const w = weight(r, j);
              if (w > 0) {
                line(frag, q, t, w, h, false);
                mark(q, w, h);
                n++;
              }
              break;
            }
          }
        }
      }
      toks[side][t].classList.add("mh-hover");
      const other = toks[side === "q" ? "k" : "q"];
      for (let i = 0; i < T; i++) {
        if (bestHead[i] >= 0) other[i].style.backgroundColor = colour(bestHead[i], Math.min(0.85, 0.1 + best[i]));
      }
    } else {
      const cand = [];
      for (const h of state.sel) {
        for (let t = 0; t < T; t++) {
          const r = rowOf(l, h, t);
          for (let j = 0; j < K; j++) {
            const w = weight(r, j);
            if (w >= IDLE_MIN) cand.push([w, t, keyOf(r, j), h]);
          }
        }
      }
      if (cand.length > IDLE_CAP) {
        cand.sort((a, b) => b[0] - a[0]);
        cand.length = IDLE_CAP;
      }
      for (const [w, t, s, h] of cand) line(frag, t, s, w, h, true);
      n = cand.length;
    }
    svg.replaceChildren(frag);
    svg.dataset.lines = String(n);
    svg.dataset.mode = state.hover ? `${state.hover.side}:${state.hover.t}` : "idle";
    svg.dataset.layer = String(D.layers[l]);
  }

  // --- model view: heatmaps drawn from the sparse rows, max-pooled to at most S x S pixels.
  function heat(canvas, l, h, S) {
    canvas.width = S;
    canvas.height = S;
    const cell = new Float32Array(S * S);
    for (let t = 0; t < T; t++) {
      const r = rowOf(l, h, t), bt = Math.floor((t * S) / T);
      for (let j = 0; j < K; j++) {
        const w = weight(r, j);
        if (w <= 0) continue;
        const i = bt * S + Math.floor((keyOf(r, j) * S) / T);
        if (w > cell[i]) cell[i] = w;
      }
    }
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(S, S);
    for (let i = 0; i < S * S; i++) {
      const c = lut(cell[i]);
      img.data[4 * i] = LUT[c];
      img.data[4 * i + 1] = LUT[c + 1];
      img.data[4 * i + 2] = LUT[c + 2];
      img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  const grid = $("mh-grid");
  grid.style.setProperty("--cell", `${Math.max(24, Math.min(64, Math.floor(520 / Math.max(1, NH))))}px`);
  grid.style.gridTemplateColumns = `auto repeat(${NH}, calc(var(--cell) + 4px))`;
  grid.append(el("span", "mh-glabel", ""));
  for (const head of D.heads) grid.append(el("span", "mh-glabel", `H${head}`));
  const cells = [];
  const thumb = Math.max(1, Math.min(T, 96));
  D.layers.forEach((layer, l) => {
    grid.append(el("span", "mh-glabel", `L${layer}`));
    D.heads.forEach((head, h) => {
      const b = el("button", "mh-cell");
      b.type = "button";
      b.dataset.l = String(l);
      b.dataset.h = String(h);
      b.setAttribute("aria-label", `layer ${layer} head ${head}`);
      const c = el("canvas", "mh-thumb");
      if (T) heat(c, l, h, thumb);
      b.append(c);
      const r = roleOf(l, h);
      b.title = `layer ${layer} head ${head}` + (r ? `\n${roleTitle(r)}` : "");
      if (D.roles.length) b.append(el("span", "mh-cell-role", r ? roleShort(r) : ""));
      b.addEventListener("click", () => {
        state.layer = l;
        state.sel = new Set([h]);
        layerSel.value = String(l);
        buildHeads();
        draw();
        focus(l, h);
      });
      grid.append(b);
      cells.push(b);
    });
  });

  const focusCanvas = $("mh-focus");
  function focus(l, h) {
    state.focus = [l, h];
    for (const b of cells) b.classList.toggle("mh-focused", Number(b.dataset.l) === l && Number(b.dataset.h) === h);
    const r = roleOf(l, h);
    $("mh-focus-title").textContent = `Layer ${D.layers[l]} head ${D.heads[h]}` + (r ? ` \u00b7 ${roleLabel(r)}` : "");
    if (T) heat(focusCanvas, l, h, Math.min(T, 512));
  }

  // Token labels on the large heatmap's axes: queries down the left, keys along the top;
  // at most AXIS_MAX of each (every step-th token), placed at their row / column centre.
  const AXIS_MAX = 48, step = Math.max(1, Math.ceil(T / AXIS_MAX));
  for (const [box, axis] of [[$("mh-ylabels"), "top"], [$("mh-xlabels"), "left"]]) {
    for (let i = 0; i < T; i += step) {
      const e = el("span", "", show(D.tokens[i]));
      e.style[axis] = `${((i + 0.5) / T) * 100}%`;
      e.title = `${i}: ${D.tokens[i]}`;
      e.dataset.i = String(i);
      box.append(e);
    }
  }
  focusCanvas.addEventListener("mousemove", (ev) => {
    if (!state.focus || !T) return;
    const [l, h] = state.focus, box = focusCanvas.getBoundingClientRect();
    const t = Math.min(T - 1, Math.floor(((ev.clientY - box.top) / box.height) * T));
    const s = Math.min(T - 1, Math.floor(((ev.clientX - box.left) / box.width) * T));
    const r = rowOf(l, h, t);
    let w = 0;
    for (let j = 0; j < K; j++) {
      if (keyOf(r, j) === s) {
        w = weight(r, j);
        break;
      }
    }
    $("mh-readout").textContent = `${JSON.stringify(D.tokens[t])} (${t}) \u2192 ${JSON.stringify(D.tokens[s])} (${s}): ${w.toFixed(4)}`;
  });

  const bar = $("mh-scale-bar"), bctx = bar.getContext("2d"), bimg = bctx.createImageData(256, 1);
  for (let i = 0; i < 256; i++) {
    for (let c = 0; c < 3; c++) bimg.data[4 * i + c] = LUT[3 * i + c];
    bimg.data[4 * i + 3] = 255;
  }
  bctx.putImageData(bimg, 0, 0);

  buildHeads();
  draw();
  if (NL && NH) focus(START.l, START.h);
  document.documentElement.dataset.mhReady = "1";
  window.mhLoadMs = performance.now();
})();
