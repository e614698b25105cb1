// attnkit attention viewer: head view, matrix view, model view, differences.
// All text from the data (tokens, sentences, model names) is inserted with
// textContent, never as markup. Weights arrive as 8-bit codes (q = round(255 *
// sqrt(w))), gzipped and base64-encoded; they stay 8-bit in memory and are
// decoded through a 256-entry table when drawn.
// "Hide special tokens" drops the rows and columns the data lists in `hide`
// (special tokens; a causal model's first token) and renormalises every row of
// every head, as AttentionMaps.hide_special does in Python. "Log colour scale"
// colours log10(w / max) over the 3 decades below the largest weight.
// A payload's `kind` says which map it holds: "attention" (the weights), or a map derived
// from them ("rollout" and "flow": one map per layer, the heads averaged; "value-weighted").
"use strict";
(function () {
  const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  const DECODE = new Float32Array(256);
  for (let q = 0; q < 256; q++) DECODE[q] = (q / 255) * (q / 255);
  const PATTERN_CODE = { previous: "P", first: "F", self: "S", broad: "B", mixed: "" };
  const MAX_DEFAULT_LINES = 4000;
  const LOG_DECADES = 3;
  const MAX_LABELS = 200;  // the matrix gets token labels up to this many tokens

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const state = { layer: 0, head: 0, docs: [], config: null, payload: null, hideSpecial: false, logScale: false,
    kind: "attention" };
  window.attnkit = state;

  function viridis(x) {
    const t = Math.min(1, Math.max(0, x)) * (VIRIDIS.length - 1);
    const lo = Math.min(VIRIDIS.length - 2, Math.floor(t));
    const f = t - lo;
    const a = VIRIDIS[lo], b = VIRIDIS[lo + 1];
    return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
  }

  async function decodeWeights(b64) {
    const raw = atob(b64);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  // One head as a Float32Array of T*T over the tokens shown (doc.keep): rows and columns
  // of hidden tokens dropped, each row renormalised to sum to 1 (a row left empty stays 0).
  function oneHead(doc, layer, head, out) {
    const F = doc.fullT, T = doc.T, keep = doc.keep, codes = doc.codes;
    const base = (layer * doc.heads + head) * F * F;
    const m = out || new Float32Array(T * T);
    for (let a = 0; a < T; a++) {
      const row = base + keep[a] * F;
      let sum = 0;
      for (let b = 0; b < T; b++) { const w = DECODE[codes[row + keep[b]]]; m[a * T + b] = w; sum += w; }
      if (doc.reduced && sum > 0) for (let b = 0; b < T; b++) m[a * T + b] /= sum;
    }
    return m;
  }

  // One head, or the mean of a layer's heads (head < 0), each head renormalised first.
  function headMatrix(doc, layer, head) {
    if (head >= 0) return oneHead(doc, layer, head);
    const n = doc.T * doc.T, out = new Float32Array(n), tmp = new Float32Array(n);
    for (let h = 0; h < doc.heads; h++) {
      oneHead(doc, layer, h, tmp);
      for (let k = 0; k < n; k++) out[k] += tmp[k];
    }
    for (let k = 0; k < n; k++) out[k] /= doc.heads;
    return out;
  }

  // Where a weight sits on the colour scale, in [0, 1]: w / max, or its log over 3 decades.
  function position(w, max) {
    if (!(max > 0)) return 0;
    if (!state.logScale) return Math.min(1, w / max);
    if (w <= 0) return 0;
    return Math.min(1, Math.max(0, 1 + Math.log10(w / max) / LOG_DECADES));
  }

  const LUT = [];
  for (let q = 0; q <= 255; q++) LUT.push(viridis(q / 255));

  function paintMatrix(canvas, m, T) {
    canvas.width = T; canvas.height = T;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(T, T);
    let max = 0;
    for (let k = 0; k < m.length; k++) if (m[k] > max) max = m[k];
    for (let k = 0; k < m.length; k++) {
      const c = LUT[Math.round(position(m[k], max) * 255)];
      img.data[4 * k] = c[0]; img.data[4 * k + 1] = c[1]; img.data[4 * k + 2] = c[2]; img.data[4 * k + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return max;
  }

  // The colour bar beside a matrix: the gradient, and the weights at its ends and middle.
  function paintScale(scale, max) {
    const bar = scale.querySelector("canvas"), labels = scale.querySelectorAll(".tick");
    bar.width = 1; bar.height = 128;
    const ctx = bar.getContext("2d"), img = ctx.createImageData(1, 128);
    for (let y = 0; y < 128; y++) {
      const c = LUT[Math.round(((127 - y) / 127) * 255)];
      img.data.set([c[0], c[1], c[2], 255], 4 * y);
    }
    ctx.putImageData(img, 0, 0);
    const at = (x) => state.logScale ? max * Math.pow(10, -LOG_DECADES * (1 - x)) : max * x;
    const text = (w) => (w >= 0.01 || w === 0 ? w.toFixed(2) : w.toExponential(0));
    labels[0].textContent = text(at(1)) + " (max)";
    labels[1].textContent = text(at(0.5));
    labels[2].textContent = state.logScale ? "\u2264 " + text(at(0)) : "0";
    scale.dataset.max = String(max);
    scale.dataset.log = state.logScale ? "1" : "0";
  }

  function fmt(w) { return w.toFixed(3); }
  // How a token is displayed: control whitespace made visible, never interpreted.
  function shown(t) {
    if (t === "") return "\u2205";
    return t.replace(/\n/g, "\u23ce").replace(/\r/g, "\u240d").replace(/\t/g, "\u21e5");
  }
  function quoted(s) { return "\u201c" + shown(s) + "\u201d"; }
  // Rollout and flow hold one map per layer (the heads averaged): no head to choose.
  function averaged() { return state.kind === "rollout" || state.kind === "flow"; }
  function headLabel(head) { return averaged() ? ", heads averaged" : head < 0 ? ", mean of heads" : ", head " + head; }
  // What the rows and columns of the drawn map are, and what hovering a token tells.
  const READING = {
    attention: ["rows: query (attending) \u00b7 columns: key (attended to)", "attends most to", "is attended most by"],
    rollout: ["rows: token after the layer \u00b7 columns: input token", "after this layer is made most of",
      "goes most into"],
    flow: ["rows: token after the layer \u00b7 columns: input token", "after this layer draws most flow from",
      "sends most flow to"],
    "value-weighted": ["rows: query \u00b7 columns: key (share of what it adds)", "is changed most by", "changes most"],
  };
  function reading() { return READING[state.kind] || READING.attention; }

  // ---- one panel per document ------------------------------------------------
  function buildDoc(doc, index) {
    const panel = el("div", "doc");
    panel.dataset.index = String(index);
    panel.appendChild(el("h2", "doc-title", doc.text));
    const meta = [doc.model, doc.T + " tokens",
      averaged() ? doc.layers + " layers, heads averaged" : doc.layers + " layers x " + doc.heads + " heads",
      doc.causal ? "causal" : "bidirectional"];
    if (doc.truncated_from) meta.push("truncated from " + doc.truncated_from + " tokens");
    if (doc.reduced) meta.push((doc.fullT - doc.T) + " hidden (special" + (doc.causal ? " or first" : "") + "), rows renormalised");
    panel.appendChild(el("div", "doc-meta", meta.join(" \u00b7 ")));
    const views = el("div", "views");
    const headView = el("div", "head-view");
    const left = el("div", "col left"), right = el("div", "col right");
    const lines = el("canvas", "lines");
    const rowH = doc.T > 128 ? 12 : 18;
    doc.rowH = rowH;
    doc.leftEls = []; doc.rightEls = [];
    doc.tokens.forEach((t, i) => {
      const a = el("span", "tok", shown(t)), b = el("span", "tok", shown(t));
      a.style.height = b.style.height = a.style.lineHeight = b.style.lineHeight = rowH + "px";
      if (rowH < 18) a.style.fontSize = b.style.fontSize = "10px";
      a.dataset.i = b.dataset.i = String(i);
      a.title = b.title = i + ": " + t;
      a.addEventListener("mouseenter", () => hover(doc, "query", i));
      b.addEventListener("mouseenter", () => hover(doc, "key", i));
      left.appendChild(a); right.appendChild(b);
      doc.leftEls.push(a); doc.rightEls.push(b);
    });
    headView.addEventListener("mouseleave", () => hover(doc, null, -1));
    lines.width = 200; lines.height = doc.T * rowH;
    lines.style.width = "200px"; lines.style.height = doc.T * rowH + "px";
    headView.append(left, lines, right);
    const matrixView = el("div", "matrix-view");
    const matrix = el("canvas", "matrix");
    const side = Math.max(240, Math.min(state.docs.length > 1 ? 480 : 720, doc.T * 14));
    matrix.style.width = matrix.style.height = side + "px";
    matrix.addEventListener("mousemove", (ev) => matrixHover(doc, ev));
    matrix.addEventListener("mouseleave", () => { doc.status.textContent = ""; });
    const framed = el("div", "matrix-frame");
    const xlabels = el("div", "xlabels"), ylabels = el("div", "ylabels");
    xlabels.style.width = ylabels.style.height = side + "px";
    axisLabels(doc, xlabels, ylabels, side);
    const scale = el("div", "scale");
    scale.style.height = side + "px";
    scale.append(el("canvas"), el("span", "tick top"), el("span", "tick mid"), el("span", "tick low"));
    framed.append(el("div", "corner"), xlabels, el("div", "corner"), ylabels, matrix, scale);
    matrixView.append(el("div", "muted", reading()[0]), framed);
    views.append(headView, matrixView);
    panel.appendChild(views);
    doc.status = el("div", "status");
    doc.status.setAttribute("role", "status");
    panel.appendChild(doc.status);
    Object.assign(doc, { panel, lines, matrix, headView, scale });
    return panel;
  }

  // Token labels along the matrix: every token up to MAX_LABELS (every k-th one when the
  // cells are too small for each to have its own line), rows on the left, columns on top.
  function axisLabels(doc, xlabels, ylabels, side) {
    if (doc.T > MAX_LABELS) { xlabels.classList.add("none"); ylabels.classList.add("none"); return; }
    const cell = side / doc.T, every = Math.max(1, Math.ceil(9 / cell));
    const font = Math.max(8, Math.min(12, cell * 0.8)) + "px";
    for (let i = 0; i < doc.T; i += every) {
      const text = shown(doc.tokens[i]);
      const y = el("span", "ylabel", text), x = el("span", "xlabel", text);
      y.style.top = (i * cell) + "px"; y.style.height = y.style.lineHeight = Math.max(cell, 9) + "px";
      x.style.left = (i * cell) + "px"; x.style.width = x.style.lineHeight = Math.max(cell, 9) + "px";
      y.style.fontSize = x.style.fontSize = font;
      y.title = x.title = i + ": " + doc.tokens[i];
      ylabels.appendChild(y); xlabels.appendChild(x);
    }
  }

  function drawDoc(doc) {
    doc.current = headMatrix(doc, state.layer, state.head);
    doc.max = paintMatrix(doc.matrix, doc.current, doc.T);
    paintScale(doc.scale, doc.max);
    doc.panel.dataset.layer = String(state.layer);
    doc.panel.dataset.head = String(state.head);
    drawLines(doc, null, -1);
  }

  function lineColour(alpha) {
    const hue = state.head < 0 ? 215 : (state.head * 47) % 360;
    return "hsla(" + hue + ", 70%, 42%, " + alpha.toFixed(3) + ")";
  }

  // Lines between the two token columns: all (faint) strongest ones when nothing
  // is hovered; one query's row or one key's column when a token is hovered.
  function drawLines(doc, mode, index) {
    const ctx = doc.lines.getContext("2d"), T = doc.T, m = doc.current, rowH = doc.rowH;
    const W = doc.lines.width;
    ctx.clearRect(0, 0, W, doc.lines.height);
    const y = (i) => i * rowH + rowH / 2;
    let drawn = 0;
    ctx.lineWidth = 1.5;
    if (mode === null) {
      let threshold = 0.0;
      if (T * T > MAX_DEFAULT_LINES) {  // keep the strongest lines only
        const sorted = Float32Array.from(m).sort();
        threshold = sorted[sorted.length - MAX_DEFAULT_LINES];
      }
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
        const w = m[i * T + j];
        if (w <= 0.01 || w < threshold) continue;
        ctx.strokeStyle = lineColour(Math.min(1, w) * 0.6);
        ctx.beginPath(); ctx.moveTo(0, y(i)); ctx.lineTo(W, y(j)); ctx.stroke();
        drawn++;
      }
    } else {
      ctx.lineWidth = 2;
      for (let k = 0; k < T; k++) {
        const w = mode === "query" ? m[index * T + k] : m[k * T + index];
        if (w <= 0.002) continue;
        ctx.strokeStyle = lineColour(Math.min(1, w / Math.max(doc.max, 1e-9)));
        ctx.beginPath();
        if (mode === "query") { ctx.moveTo(0, y(index)); ctx.lineTo(W, y(k)); }
        else { ctx.moveTo(0, y(k)); ctx.lineTo(W, y(index)); }
        ctx.stroke();
        drawn++;
      }
    }
    doc.lines.dataset.lines = String(drawn);
    doc.lines.dataset.mode = mode || "all";
  }

  function hover(doc, mode, index) {
    for (const e of doc.leftEls) { e.style.background = ""; e.classList.remove("active"); }
    for (const e of doc.rightEls) { e.style.background = ""; e.classList.remove("active"); }
    drawLines(doc, mode, index);
    if (mode === null) { doc.status.textContent = ""; return; }
    const T = doc.T, m = doc.current;
    const weights = [];
    for (let k = 0; k < T; k++) weights.push([mode === "query" ? m[index * T + k] : m[k * T + index], k]);
    const others = mode === "query" ? doc.rightEls : doc.leftEls;
    (mode === "query" ? doc.leftEls : doc.rightEls)[index].classList.add("active");
    for (const [w, k] of weights) {
      if (w > 0.002) others[k].style.background = "rgba(59, 91, 219, " + Math.min(0.85, w / Math.max(doc.max, 1e-9)).toFixed(3) + ")";
    }
    weights.sort((a, b) => b[0] - a[0]);
    const top = weights.slice(0, 5).map(([w, k]) => quoted(doc.tokens[k]) + " " + fmt(w)).join(", ");
    doc.status.textContent = quoted(doc.tokens[index]) + " (token " + index + ") " +
      reading()[mode === "query" ? 1 : 2] + ": " + top;
  }

  function matrixHover(doc, ev) {
    const r = doc.matrix.getBoundingClientRect();
    const j = Math.floor(((ev.clientX - r.left) / r.width) * doc.T);
    const i = Math.floor(((ev.clientY - r.top) / r.height) * doc.T);
    if (i < 0 || j < 0 || i >= doc.T || j >= doc.T) return;
    doc.status.textContent = "query " + i + " " + quoted(doc.tokens[i]) + " \u2192 key " + j + " " +
      quoted(doc.tokens[j]) + ": " + fmt(doc.current[i * doc.T + j]);
  }

  // ---- model view: every head as a thumbnail -----------------------------------
  function thumbnail(doc, layer, head, size) {
    const T = doc.T, m = oneHead(doc, layer, head);
    const out = new Float32Array(size * size), count = new Float32Array(size * size);
    if (T >= size) {
      for (let i = 0; i < T; i++) {
        const r = Math.floor((i * size) / T);
        for (let j = 0; j < T; j++) {
          const c = Math.floor((j * size) / T);
          out[r * size + c] += m[i * T + j];
          count[r * size + c] += 1;
        }
      }
    } else {
      for (let r = 0; r < size; r++) for (let c = 0; c < size; c++) {
        out[r * size + c] = m[Math.floor((r * T) / size) * T + Math.floor((c * T) / size)];
        count[r * size + c] = 1;
      }
    }
    for (let k = 0; k < out.length; k++) out[k] /= count[k] || 1;
    return out;
  }

  function buildModelView(doc, index, container) {
    const section = el("div", "model-view");
    section.appendChild(el("h3", null, "Model view" + (state.docs.length > 1 ? " \u2014 sentence " + (index + 1) : "") +
      (averaged() ? ": every layer (heads averaged); click a layer to enlarge it"
        : ": all heads (layers down, heads across); click a head to enlarge it")));
    const wrap = el("div", "grid-wrap");
    const grid = el("div", "grid");
    grid.style.gridTemplateColumns = "2.5em repeat(" + doc.heads + ", 68px)";
    grid.appendChild(el("span", "lbl", ""));
    for (let h = 0; h < doc.heads; h++) grid.appendChild(el("span", "lbl", averaged() ? "mean" : "h" + h));
    doc.thumbs = [];
    const size = Math.min(64, doc.T);
    const pending = [];
    for (let l = 0; l < doc.layers; l++) {
      grid.appendChild(el("span", "lbl", "L" + l));
      for (let h = 0; h < doc.heads; h++) {
        const cell = el("div", "cell");
        const c = el("canvas");
        c.width = c.height = size;
        c.title = "layer " + l + headLabel(h);
        c.dataset.layer = String(l); c.dataset.head = String(h);
        c.addEventListener("click", () => { select(l, h); enlarge(doc); });
        cell.appendChild(c);
        const letters = doc.summary && !doc.reduced && state.kind === "attention";  // patterns of attention weights
        const code = letters ? PATTERN_CODE[doc.summary.pattern[l][h]] : "";
        if (code) cell.appendChild(el("span", "code", code));
        grid.appendChild(cell);
        doc.thumbs.push(c);
        pending.push([c, l, h]);
      }
    }
    wrap.appendChild(grid);
    section.appendChild(wrap);
    section.appendChild(el("div", "muted", state.kind !== "attention"
      ? "Each thumbnail is scaled to its own largest value."
      : doc.reduced
      ? "Special tokens hidden, rows renormalised (pattern letters describe all tokens, so they are left out). Each thumbnail is scaled to its own largest weight."
      : "Letters: P previous token, F first token, S itself, B broad (near uniform); none: mixed. Each thumbnail is scaled to its own largest weight."));
    container.appendChild(section);
    // Paint a few thumbnails per frame so that long inputs never freeze the page.
    return new Promise((resolve) => {
      const step = () => {
        const t0 = performance.now();
        while (pending.length && performance.now() - t0 < 30) {
          const [c, l, h] = pending.shift();
          paintMatrix(c, thumbnail(doc, l, h, size), size);
        }
        if (pending.length) requestAnimationFrame(step); else resolve();
      };
      requestAnimationFrame(step);
    });
  }

  // The enlarged head: the matrix with token labels on both axes (up to 120 tokens).
  function enlarge(doc) {
    const overlay = $("overlay");
    const canvas = overlay.querySelector("canvas");
    const T = doc.T, size = 1000, labels = T <= 120;
    const margin = labels ? 150 : 0, cellPx = (size - margin) / T;
    const small = document.createElement("canvas");
    paintMatrix(small, doc.current, T);
    canvas.width = canvas.height = size;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, size, size);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(small, margin, margin, T * cellPx, T * cellPx);
    if (labels) {
      const font = Math.max(7, Math.min(16, cellPx * 0.75));
      ctx.font = font + "px ui-monospace, monospace";
      ctx.fillStyle = "#222"; ctx.textBaseline = "middle";
      const cut = (t) => { const s = shown(t); return s.length > 16 ? s.slice(0, 15) + "\u2026" : s; };
      ctx.textAlign = "right";
      doc.tokens.forEach((t, i) => ctx.fillText(cut(t), margin - 6, margin + (i + 0.5) * cellPx));
      doc.tokens.forEach((t, j) => {
        ctx.save();
        ctx.translate(margin + (j + 0.5) * cellPx, margin - 6);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(cut(t), 0, 0);
        ctx.restore();
      });
    }
    overlay.querySelector(".caption").textContent = doc.model + ": " + layerLabel(doc, state.layer) +
      headLabel(state.head) + " \u2014 " + doc.text;
    overlay.hidden = false;
  }

  // ---- differences between two sentences --------------------------------------
  function buildDifference(diff) {
    const section = $("difference");
    section.replaceChildren();
    if (!diff) { section.hidden = true; return; }
    section.hidden = false;
    section.appendChild(el("h3", null, "Where the patterns differ (layers x heads)"));
    section.appendChild(el("div", "muted", diff.method === "rows"
      ? "Mean total variation distance between matching rows (0 = same weights, 1 = disjoint). Click a cell to show that head."
      : "The sentences have different lengths, so rows cannot be matched: the largest difference of the previous/first/self scores and normalised entropy. Click a cell to show that head."));
    const table = el("table");
    const head = el("tr");
    head.appendChild(el("th", null, ""));
    diff.values[0].forEach((_, h) => head.appendChild(el("th", null, "h" + h)));
    table.appendChild(head);
    let max = 0;
    diff.values.forEach((row) => row.forEach((v) => { if (v > max) max = v; }));
    diff.values.forEach((row, l) => {
      const tr = el("tr");
      tr.appendChild(el("th", null, "L" + l));
      row.forEach((v, h) => {
        const td = el("td", null, v.toFixed(2));
        const c = viridis(max > 0 ? v / max : 0);
        td.style.background = "rgb(" + c.map(Math.round).join(",") + ")";
        td.style.color = v / (max || 1) > 0.6 ? "#000" : "#fff";
        td.addEventListener("click", () => select(l, h));
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
    section.appendChild(table);
  }

  // ---- controls --------------------------------------------------------------
  // "layer 3", or "layer 3 (decoder 0 cross attention)" where the layers have names.
  function layerLabel(doc, l) {
    return "layer " + l + (doc.layer_names ? " (" + doc.layer_names[l] + ")" : "");
  }

  function fillControls() {
    const first = state.docs[0];
    const layer = $("layer"), head = $("head");
    layer.replaceChildren(); head.replaceChildren();
    for (let l = 0; l < first.layers; l++) layer.appendChild(new Option(first.layer_names ? l + " " + first.layer_names[l] : String(l), String(l)));
    for (let h = 0; h < first.heads; h++) head.appendChild(new Option(String(h), String(h)));
    head.appendChild(new Option("mean of heads", "-1"));
    state.layer = Math.min(state.layer, first.layers - 1);
    state.head = Math.min(state.head, first.heads - 1);
    layer.value = String(state.layer); head.value = String(state.head);
    head.parentElement.hidden = averaged();  // one map per layer: nothing to choose
    $("controls").hidden = false;
  }

  function select(layer, head) {
    state.layer = layer; state.head = head;
    $("layer").value = String(layer); $("head").value = String(head);
    redraw();
  }

  function redraw() {
    for (const doc of state.docs) {
      drawDoc(doc);
      if (doc.thumbs) doc.thumbs.forEach((c) => c.classList.toggle("selected",
        Number(c.dataset.layer) === state.layer && (state.head < 0 || Number(c.dataset.head) === state.head)));
    }
    $("picked").textContent = layerLabel(state.docs[0], state.layer) + headLabel(state.head);
  }

  // Draw a payload; `current` (optional) says whether it is still wanted once decoded.
  async function show(payload, current) {
    document.body.dataset.ready = "0";
    const docs = [];
    for (const d of payload.docs) {
      const doc = Object.assign({}, d);
      doc.fullT = d.tokens.length;
      doc.allTokens = d.tokens;
      doc.codes = await decodeWeights(d.weights);
      if (doc.codes.length !== doc.layers * doc.heads * doc.fullT * doc.fullT) throw new Error("weights have the wrong size");
      docs.push(doc);
    }
    if (current && !current()) return;
    state.docs = docs;
    state.payload = payload;
    state.kind = payload.kind || (payload.docs[0] && payload.docs[0].kind) || "attention";
    if (payload.layer !== undefined) state.layer = payload.layer;
    if (payload.head !== undefined) state.head = payload.head;
    await render();
  }

  // (Re)build every panel for the current options; the decoded weights are kept.
  let renderCount = 0;
  async function render() {
    const mine = ++renderCount;
    document.body.dataset.ready = "0";
    document.body.dataset.thumbnails = "0";
    $("docs").replaceChildren();
    $("model-grids").replaceChildren();
    const docs = state.docs;
    for (const doc of docs) {
      const hidden = new Set(state.hideSpecial ? doc.hide || [] : []);
      doc.keep = [...Array(doc.fullT).keys()].filter((i) => !hidden.has(i));
      doc.reduced = doc.keep.length !== doc.fullT;
      doc.T = doc.keep.length;
      doc.tokens = doc.keep.map((i) => doc.allTokens[i]);
      doc.thumbs = null;
    }
    docs.forEach((doc, i) => $("docs").appendChild(buildDoc(doc, i)));
    fillControls();
    buildDifference(state.payload.difference || null);
    redraw();
    const grids = docs.map((doc, i) => buildModelView(doc, i, $("model-grids")));
    redraw();
    document.body.dataset.ready = "1";
    await Promise.all(grids);
    if (mine === renderCount) document.body.dataset.thumbnails = "1";
  }

  function message(text, kind) {
    const box = el("div", kind || "", text);
    $("messages").appendChild(box);
  }

  // ---- the served page: a form that asks the local server ------------------------
  function setupForm(config) {
    const form = $("input-form");
    form.hidden = false;
    const model = $("model");
    for (const m of config.models) {
      const o = new Option(m.name + (m.available ? "" : " (not installed)"), m.name);
      o.disabled = !m.available;
      o.title = m.available ? m.description : m.description + " \u2014 " + m.reason;
      model.appendChild(o);
    }
    const firstAvailable = config.models.find((m) => m.available);
    if (firstAvailable) model.value = firstAvailable.name;
    const text = $("text");
    text.placeholder = "Type a sentence (at most " + config.max_chars + " characters); Enter shows its attention, " +
      "Shift+Enter starts a new line";
    // The header states the limits of the model chosen: a model reads at most its own number of
    // tokens (MiniLM: 256), the server at most max_chars characters.
    const limits = () => {
      const m = config.models.find((x) => x.name === model.value);
      const tokens = m && m.max_tokens ? "; " + m.name + " reads at most " + m.max_tokens +
        " tokens (a longer text is cut, with a warning)" : "";
      $("subtitle").textContent = (config.subtitle ? config.subtitle + " " : "") + "At most " +
        config.max_chars + " characters" + tokens + ".";
    };
    model.addEventListener("change", limits);
    limits();
    // Which map to draw: the attention weights, or rollout, flow or value-weighted maps. The
    // line below the form says what the drawn map is (the server's description of it).
    const map = el("select");
    map.id = "map";
    map.name = "kind";
    map.setAttribute("aria-label", "map");
    for (const k of config.kinds || [{ name: "attention", description: "" }]) {
      const o = new Option(k.name, k.name);
      o.title = k.description;
      map.appendChild(o);
    }
    model.after(map);
    const described = el("div", "muted");
    described.id = "map-description";
    form.after(described);
    // A text over max_chars is never cut silently: the page says so and does not send it.
    const tooLong = el("span", "error");
    tooLong.id = "too-long";
    tooLong.setAttribute("role", "alert");
    form.appendChild(tooLong);
    const overLimit = () => {
      const length = [...text.value].length;  // characters, as the server counts them
      const over = length > config.max_chars;
      tooLong.textContent = over ? "The text has " + length + " characters; this page takes at most " +
        config.max_chars + ". Shorten it to see its attention." : "";
      $("submit").disabled = over;
      return over;
    };
    text.addEventListener("input", overLimit);
    // Only the answer to the latest request is drawn (the example may still be computing
    // when a sentence is submitted). The answer keeps the layer and head shown (a layer of
    // -1: the last one, the whole model).
    let latest = 0;
    const submit = async (layer) => {
      const mine = ++latest;
      $("messages").replaceChildren();
      $("form-status").textContent = "computing\u2026";
      document.body.dataset.ready = "0";  // until the answer is drawn (or fails)
      try {
        const response = await fetch("api/attention", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ text: $("text").value, model: model.value, kind: map.value,
            layer: layer === undefined ? state.layer : layer, head: Math.max(state.head, 0) }),
        });
        const body = await response.json();
        if (mine !== latest) return;
        if (!response.ok) {
          const detail = Array.isArray(body.detail) ? body.detail.map((d) => d.msg).join("; ") : body.detail;
          message(detail || ("error " + response.status), "error");
          $("form-status").textContent = "";
          document.body.dataset.ready = "1";
          return;
        }
        for (const w of body.warnings || []) message(w);
        described.textContent = body.description ? "Showing " + body.description + "." : "";
        await show(body, () => mine === latest);
        if (mine !== latest) return;
        $("form-status").textContent = "";
      } catch (err) {
        if (mine !== latest) return;
        message(String(err), "error");
        $("form-status").textContent = "";
        document.body.dataset.ready = "1";
      }
    };
    const send = (layer) => { if (!overLimit()) submit(layer); };
    // A new map redraws the text at once; rollout and flow open on the last layer (the whole model).
    map.addEventListener("change", () => {
      if (text.value.trim()) send(map.value === "rollout" || map.value === "flow" ? -1 : undefined);
    });
    form.addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
    // Enter and Ctrl+Enter (Cmd+Enter) send the text; Shift+Enter is a new line.
    text.addEventListener("keydown", (ev) => {
      if (ev.key !== "Enter" || ev.isComposing || (ev.shiftKey && !ev.ctrlKey && !ev.metaKey)) return;
      ev.preventDefault();
      send();
    });
    // The page opens on an example, already drawn with the first model that is installed.
    if (config.example && firstAvailable) {
      text.value = config.example;
      submit();
    } else {
      document.body.dataset.ready = "1";
    }
  }

  function init() {
    const config = JSON.parse($("attnkit-data").textContent);
    state.config = config;
    document.title = config.title;
    if (config.view && config.view !== "all") document.body.classList.add("view-" + config.view);
    $("title").textContent = config.title;
    $("subtitle").textContent = config.subtitle || "";
    $("layer").addEventListener("change", () => select(Number($("layer").value), state.head));
    $("head").addEventListener("change", () => select(state.layer, Number($("head").value)));
    const options = config.options || {};
    state.hideSpecial = $("hide-special").checked = Boolean(options.hide_special);
    state.logScale = $("log-scale").checked = Boolean(options.log_scale);
    $("hide-special").addEventListener("change", () => {
      state.hideSpecial = $("hide-special").checked;
      if (state.docs.length) render().catch((err) => message(String(err), "error"));
    });
    $("log-scale").addEventListener("change", () => {
      state.logScale = $("log-scale").checked;
      if (!state.docs.length) return;
      redraw();
      for (const doc of state.docs) if (doc.thumbs) doc.thumbs.forEach((c) =>
        paintMatrix(c, thumbnail(doc, Number(c.dataset.layer), Number(c.dataset.head), c.width), c.width));
    });
    $("overlay").addEventListener("click", () => { $("overlay").hidden = true; });
    document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") $("overlay").hidden = true; });
    for (const w of config.warnings || []) message(w);
    if (config.mode === "server") setupForm(config);
    else if (config.docs && config.docs.length) show(config).catch((err) => message(String(err), "error"));
    else document.body.dataset.ready = "1";
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
