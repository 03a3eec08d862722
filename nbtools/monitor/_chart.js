// Front end of the GPU pane: a plotly.js figure (3 panels, one line per GPU, then a
// row of steps per second per rank when ranks report progress, then a low row of
// the run's world size once it changed) that grows by
// Plotly.extendTraces from small per-poll messages, the run's events on the same
// time axis, a table of the current values and a list of the last events.
// The whole figure travels only in the `_figure` trait, which the kernel rebuilds
// when the set of GPUs changes or a view asks to resynchronise; its history comes
// as binary arrays. Without a kernel to send plotly.js (a saved notebook opened
// later), the chart shows the pane's last still picture (`_snapshot`, a PNG).

const PANELS = 3; // utilization, memory, temperature; trace index = panel * gpus + row
const CONFIG = { displaylogo: false, displayModeBar: false };
const MISSING = 65535;
const MAX_DRAWN = 400;
const LISTED = 8;
// How each category of event is drawn (see nbtools/monitor/timeline.py).
const STYLE = {
  save: { color: "#2563eb", symbol: "square", band: 0.22 },
  stall: { color: "#d97706", symbol: "diamond", band: 0.18 },
  failure: { color: "#dc2626", symbol: "x", line: "solid" },
  restart: { color: "#ea580c", symbol: "triangle-up", line: "dash" },
  restore: { color: "#16a34a", symbol: "triangle-right", band: 0.3 },
  phase: { color: "#334155", symbol: "diamond-tall", line: "longdash" },
  run: { color: "#6b7280", symbol: "circle-open", line: "dot" },
  world: { color: "#0f766e", symbol: "square-open", line: "dashdot" },
  hang: { color: "#b91c1c", symbol: "hexagram", band: 0.25 },
  straggler: { color: "#ca8a04", symbol: "star", band: 0.2 },
  mark: { color: "#7c3aed", symbol: "triangle-down" },
};
const FLAGS = new Set(["hang", "straggler"]);

// plotly.js, once per page: every chart on the page shares one copy, kept on globalThis.
// The kernel pushes it (gzip, a binary buffer of a custom message) when a chart is new, and
// answers a chart that asks ({k: "lib"}) when it is free; neither is part of the widget state.
const g = globalThis;
const shared = () => {
  if (!g.__nbtoolsPlotlyShared) {
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    const state = { promise, installing: null, ready: null };
    state.resolve = (plotly) => {
      state.ready = plotly;
      resolve(plotly);
    };
    g.__nbtoolsPlotlyShared = state;
    if (g.Plotly && typeof g.Plotly.extendTraces === "function") state.resolve(g.Plotly);
  }
  return g.__nbtoolsPlotlyShared;
};

async function install(buffer) {
  const state = shared();
  if (state.installing) return state.installing;
  state.installing = (async () => {
    const bytes = buffer instanceof DataView ? buffer : new DataView(buffer.buffer || buffer);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    const code = await new Response(stream).text();
    // plotly.min.js is a UMD bundle: hand it a CommonJS module object to fill,
    // so it neither needs a loader nor touches an AMD `define` on the page.
    const module = { exports: {} };
    new Function("module", "exports", code)(module, module.exports);
    state.resolve(module.exports);
    return module.exports;
  })();
  state.installing.catch(() => (state.installing = null));
  return state.installing;
}

function listen(model) {
  const state = shared();
  const onLibrary = (msg, buffers) => {
    if (!msg || msg.k !== "lib" || !buffers || !buffers.length) return;
    install(buffers[0]).then(() => model.send({ k: "have" }), (err) => console.error(err));
  };
  model.on("msg:custom", onLibrary);
  state.promise.then(() => model.off("msg:custom", onLibrary));
}

function initialize({ model }) {
  listen(model);  // a push may come before any view of this chart is drawn
}

// plotly draws numeric x values as UTC; shift epoch milliseconds to the browser's zone.
const local = (ms) => ms - new Date(ms).getTimezoneOffset() * 60000;
const clock = (ms) => new Date(ms).toLocaleTimeString([], { hour12: false });
const num = (v, digits) => (v === null || v === undefined ? "n/a" : v.toFixed(digits));

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function float64s(view) {
  const out = new Array(view.byteLength / 8);
  for (let i = 0; i < out.length; i++) out[i] = local(view.getFloat64(8 * i, true));
  return out;
}

function scaled(view, factor) {
  const out = new Array(view.byteLength / 2);
  for (let i = 0; i < out.length; i++) {
    const v = view.getUint16(2 * i, true);
    out[i] = v === MISSING ? null : v / factor;
  }
  return out;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

// An event row: [ms, kind, category, rank, step, start ms or null, text] (a flag's
// row has an eighth column: 1 when it ends the flag).
function describe(e) {
  if (FLAGS.has(e[2]) && e[6]) return e[6]; // says which rank, where, since when

  const who = [e[3] === null ? null : `rank ${e[3]}`, e[4] === null ? null : `step ${e[4]}`];
  return who.filter((p) => p).concat(e[6] ? [e[6]] : []).join(" · ");
}

// Ranks flagged now: rank -> "hang" or "straggler", from the newest flag event of each.
function flaggedRanks(rows) {
  const open = new Map();
  for (const e of rows) {
    if (!FLAGS.has(e[2]) || e[3] === null) continue;
    const key = `${e[2]} ${e[3]}`;
    if (e[7]) open.delete(key);
    else open.set(key, [e[3], e[2]]);
  }
  const out = new Map();
  for (const [rank, kind] of open.values()) if (!out.has(rank) || kind === "hang") out.set(rank, kind);
  return out;
}

// Every panel on one time axis. The layout is copied for each view (plotly writes ranges
// into the layout it draws, and views of one chart share the kernel's figure); every x
// axis is a date axis matching the bottom panel's. Returns the panels as [x ref, y ref].
function timeAxes(layout) {
  const number = (id) => Number(id.slice(5) || 1);
  const ref = (id) => (number(id) === 1 ? "x" : `x${number(id)}`);
  const ids = Object.keys(layout).filter((k) => /^xaxis\d*$/.test(k));
  ids.sort((a, b) => number(a) - number(b));
  const bottom = ids.length ? ref(ids[ids.length - 1]) : "x";
  return ids.map((id) => {
    const axis = layout[id];
    axis.type = "date";
    if (ref(id) === bottom) delete axis.matches;
    else axis.matches = bottom;
    const anchor = axis.anchor && axis.anchor !== "free" ? axis.anchor : ref(id).replace("x", "y");
    return [ref(id), anchor];
  });
}

// An event's line or band crosses every panel, drawn in that panel's own coordinates.
function eventLayer(rows, traceCount, axis, panels) {
  const shapes = [];
  const x = [];
  const text = [];
  const color = [];
  const symbol = [];
  const across = panels.length ? panels : [["x", "y"]];
  for (const e of rows) {
    const style = STYLE[e[2]] || STYLE.mark;
    const t = local(e[0]);
    for (const [xref, yref] of across) {
      const place = { xref, yref: `${yref} domain`, y0: 0, y1: 1 };
      if (style.band && e[5] !== null) {
        shapes.push({
          type: "rect", ...place, x0: local(e[5]), x1: t,
          fillcolor: style.color, opacity: style.band, layer: "below",
          line: { color: style.color, width: 1 },
        });
      } else if (style.line) {
        shapes.push({
          type: "line", ...place, x0: t, x1: t,
          line: { color: style.color, width: 1.5, dash: style.line },
        });
      }
    }
    x.push(t);
    text.push(`<b>${escapeHtml(e[1])}</b> ${clock(e[0])}<br>${escapeHtml(describe(e))}`);
    color.push(style.color);
    symbol.push(style.symbol);
  }
  const trace = {
    type: "scatter", mode: "markers", name: "events", showlegend: false, xaxis: "x", yaxis: axis[0],
    x, y: x.map(() => axis[1]), customdata: text, hovertemplate: "%{customdata}<extra></extra>",
    marker: { color, symbol, size: 9, line: { width: 1, color: "white" } }, cliponaxis: false,
  };
  return { shapes, trace, index: traceCount };
}

async function render({ model, el }) {
  const root = element("div", "nbtools-gpu");
  const head = element("div", "nbtools-gpu-head");
  const source = element("span", "nbtools-gpu-source");
  const last = element("span", "nbtools-gpu-last", "no sample yet");
  const table = element("table", "nbtools-gpu-glance");
  const plot = element("div", "nbtools-gpu-plot");
  const list = element("div", "nbtools-gpu-events");
  head.append(source, last);
  root.append(head, table, plot, list);
  el.append(root);
  // Polls that arrive while plotly.js loads are kept and applied once it is there.
  const early = [];
  const hold = (msg) => early.push(msg);
  model.on("msg:custom", hold);
  const still = element("img", "nbtools-gpu-still");
  still.alt = "GPU pane (still picture)";
  let Plotly = shared().ready;
  if (!Plotly) {
    last.textContent = "loading plotly.js from the kernel…";
    model.send({ k: "lib" });
    // No kernel answers (a saved notebook): show the last still picture meanwhile.
    const timer = setTimeout(() => {
      const png = model.get("_snapshot");
      if (png && png.byteLength) {
        still.src = URL.createObjectURL(new Blob([png], { type: "image/png" }));
        root.append(still);
      }
      last.textContent = "the live chart needs its kernel: run the cell again";
    }, 8000);
    Plotly = await shared().promise;
    clearTimeout(timer);
    still.remove();
    if (still.src) URL.revokeObjectURL(still.src);
  }
  model.off("msg:custom", hold);
  model.send({ k: "have" }); // the kernel pushes no more copies to this page

  let seq = -1;
  let gpus = [];
  let maxPoints = 720;
  let horizon = 0;
  let cells = [];
  let events = [];
  let keys = new Set();
  let counts = { d: 0, nd: 0 };
  let traceCount = 0;
  let ranks = []; // the step-rate row's ranks, their traces after the GPUs'
  let ratePoints = 1200;
  let eventAxis = ["y", 100];
  let panels = [];
  let flagged = new Map();
  let world = -1; // the world size's trace, or -1
  let worldLive = false; // the run goes on: each poll carries its line on

  function setLast(t) {
    last.dataset.time = t ? String(t) : "";
    last.textContent = t ? "last sample " + clock(t) : "no sample yet";
  }

  function buildTable() {
    table.replaceChildren();
    const header = element("tr");
    for (const h of ["GPU", "Util %", "Memory GiB", "Temp °C", "Power W", ""]) {
      header.append(element("th", "", h));
    }
    table.append(header);
    cells = gpus.map(([host, index, name, , , row_label]) => {
      const row = element("tr");
      const label = element("td", "nbtools-gpu-name", `${host} · ${row_label ?? index}`);
      label.title = name;
      const tds = [0, 1, 2, 3, 4].map(() => element("td"));
      row.append(label, ...tds);
      table.append(row);
      return tds;
    });
  }

  function fillRow(i, g) {
    const tds = cells[i];
    if (!tds || !g) return;
    const [, , , total, limit] = gpus[i];
    tds[0].textContent = num(g[0], 0);
    tds[1].textContent = `${num(g[1], 1)} / ${num(total, 0)}`;
    tds[2].textContent = num(g[2], 0);
    tds[3].textContent = limit ? `${num(g[3], 0)} / ${num(limit, 0)}` : num(g[3], 0);
    tds[4].textContent = g[4] || "";
    tds[4].className = g[4] ? "nbtools-gpu-warn" : "";
  }

  function keepEvents(rows) {
    for (const e of rows) {
      const key = JSON.stringify(e);
      if (keys.has(key)) continue;
      keys.add(key);
      events.push(e);
    }
    events.sort((a, b) => a[0] - b[0]);
    const newest = events.length ? events[events.length - 1][0] : 0;
    const old = events.length - MAX_DRAWN;
    events = events.filter((e, i) => i >= old && (!horizon || e[0] >= newest - horizon));
    keys = new Set(events.map((e) => JSON.stringify(e)));
  }

  function drawList() {
    list.replaceChildren();
    const title = element("div", "nbtools-gpu-events-head", events.length ? "Events" : "No events yet");
    if (counts.d > 0) {
      title.append(element("span", "nbtools-gpu-dropped",
        ` · ${counts.d} dropped (ranks emitted faster than the kernel read)`));
    }
    if (counts.nd > 0) {
      title.append(element("span", "nbtools-gpu-undrawn", ` · ${counts.nd} not drawn (see pane.events())`));
    }
    list.append(title);
    for (const e of events.slice(-LISTED).reverse()) {
      const style = STYLE[e[2]] || STYLE.mark;
      const row = element("div", "nbtools-gpu-event");
      row.dataset.kind = e[1];
      row.dataset.category = e[2];
      const kind = element("span", "nbtools-gpu-event-kind", e[1]);
      kind.style.color = style.color;
      row.append(element("span", "nbtools-gpu-event-time", clock(e[0])), kind,
        element("span", "nbtools-gpu-event-text", describe(e)));
      list.append(row);
    }
  }

  // A flagged rank's step rate is drawn bold, its name says why.
  function markFlagged() {
    const now = flaggedRanks(events);
    const same = now.size === flagged.size && [...now].every(([r, k]) => flagged.get(r) === k);
    flagged = now;
    if (same || !ranks.length || !plot.data) return;
    const first = PANELS * gpus.length;
    const indices = ranks.map((_, j) => first + j);
    Plotly.restyle(plot, {
      "line.width": ranks.map((r) => (flagged.has(r) ? 3.5 : 1.5)),
      name: ranks.map((r) => (flagged.has(r) ? `rank ${r} (${flagged.get(r)})` : `rank ${r}`)),
    }, indices);
  }

  function extendRates(points) {
    if (!points || !points.length || !plot.data) return;
    const first = PANELS * gpus.length;
    const byTrace = new Map();
    for (const [rank, ms, rate] of points) {
      const j = ranks.indexOf(rank);
      if (j < 0) continue;
      if (!byTrace.has(j)) byTrace.set(j, [[], []]);
      byTrace.get(j)[0].push(local(ms));
      byTrace.get(j)[1].push(rate);
    }
    if (!byTrace.size) return;
    const indices = [...byTrace.keys()];
    Plotly.extendTraces(plot, {
      x: indices.map((j) => byTrace.get(j)[0]), y: indices.map((j) => byTrace.get(j)[1]),
    }, indices.map((j) => first + j), ratePoints);
  }

  // The world size holds until something changes it: carry its line on to time x.
  function extendWorld(x) {
    if (world < 0 || !worldLive || !plot.data || !plot.data[world]) return;
    const trace = plot.data[world];
    const n = trace.y.length;
    if (!n || trace.x[n - 1] >= x) return;
    Plotly.extendTraces(plot, {
      x: [[x]], y: [[trace.y[n - 1]]], customdata: [[trace.customdata[n - 1]]],
    }, [world], maxPoints);
  }

  function drawEvents() {
    if (!plot.data || !traceCount) {
      drawList();
      return;
    }
    markFlagged();
    // The events' trace is replaced by Plotly.react, never restyled: restyling a trace's x
    // makes plotly guess its axis' type again (from the first trace: "linear"), which
    // unmatches the panels. react keeps every other trace (same objects) and the zoom.
    const layer = eventLayer(events, traceCount, eventAxis, panels);
    const data = plot.data.slice();
    const old = data[layer.index];
    data[layer.index] = { ...layer.trace, marker: { ...old.marker, ...layer.trace.marker } };
    Plotly.react(plot, data, { ...plot.layout, shapes: layer.shapes }, CONFIG);
    drawList();
  }

  function draw() {
    const fig = model.get("_figure");
    if (!fig || !fig.data) return;
    seq = fig.n;
    gpus = fig.gpus;
    maxPoints = fig.m;
    horizon = fig.h || 0;
    counts = { d: fig.d || 0, nd: fig.nd || 0 };
    traceCount = fig.data.length;
    ranks = fig.ranks || [];
    ratePoints = fig.rp || ratePoints;
    eventAxis = fig.ey || ["y", 100];
    world = fig.wi === undefined ? -1 : fig.wi;
    worldLive = Boolean(fig.wl);
    // Without any GPU read yet (unavailable), the status line says why; no empty axes.
    plot.style.display = fig.data.length ? "" : "none";
    table.style.display = gpus.length ? "" : "none";
    plot.style.minHeight = `${fig.layout.height || 560}px`;
    const xs = fig.x.map(float64s);
    const first = PANELS * gpus.length;
    events = [];
    keys = new Set();
    keepEvents(fig.ev || []);
    flagged = flaggedRanks(events);
    const data = fig.data.map((trace, i) => {
      if (i < first) {
        return {
          ...trace,
          x: xs[fig.xi[i % gpus.length]],
          y: scaled(fig.y[i], fig.f[Math.floor(i / gpus.length)]),
        };
      }
      if (i === world) {
        return { ...trace, x: fig.wx.map(local), y: fig.wy, customdata: fig.wt };
      }
      const rank = ranks[i - first];
      const bold = flagged.has(rank);
      return {
        ...trace, x: float64s(fig.rx[i - first]), y: fig.ry[i - first],
        name: bold ? `rank ${rank} (${flagged.get(rank)})` : trace.name,
        line: { ...trace.line, width: bold ? 3.5 : 1.5 },
      };
    });
    const layout = JSON.parse(JSON.stringify(fig.layout));
    panels = timeAxes(layout);
    const layer = eventLayer(events, data.length, eventAxis, panels);
    if (data.length) data.push(layer.trace);
    Plotly.react(plot, data, { ...layout, shapes: data.length ? layer.shapes : [] }, CONFIG);
    const simulated = fig.source === "simulated";
    const hosts = fig.hosts === 1 ? "1 host" : `${fig.hosts} hosts`;
    const label = fig.hosts ? `${fig.source} · ${hosts}` : fig.source;
    source.textContent = simulated ? "SIMULATED GPUs (made-up numbers)" : label;
    source.classList.toggle("nbtools-gpu-simulated", simulated);
    buildTable();
    fig.glance.forEach((g, i) => fillRow(i, g));
    setLast(fig.last);
    drawList();
  }

  function onMessage(msg) {
    if (!msg || (msg.k !== "s" && msg.k !== "e") || msg.n <= seq) return;
    if (msg.n !== seq + 1) {
      // A message was missed (e.g. the page was reloaded): ask for the whole figure.
      seq = msg.n;
      model.send({ k: "sync", n: -1 });
      return;
    }
    seq = msg.n;
    if (msg.k === "e") {
      // Events (and step rates) on their own: a pane with no GPU to poll.
      if (msg.d !== undefined) counts = { d: msg.d, nd: msg.nd };
      extendRates(msg.sr);
      extendWorld(local(Date.now()));
      if (msg.e) keepEvents(msg.e);
      drawEvents();
      return;
    }
    const x = local(msg.t);
    const indices = [];
    const xs = [];
    const ys = [];
    for (let p = 0; p < PANELS; p++) {
      msg.g.forEach((g, j) => {
        indices.push(p * gpus.length + msg.r + j);
        xs.push([x]);
        ys.push([g[p]]);
      });
    }
    Plotly.extendTraces(plot, { x: xs, y: ys }, indices, maxPoints);
    extendRates(msg.sr);
    extendWorld(x);
    msg.g.forEach((g, j) => fillRow(msg.r + j, g));
    setLast(msg.t);
    if (msg.d !== undefined) counts = { d: msg.d, nd: msg.nd };
    if (msg.e) keepEvents(msg.e);
    if (msg.e || msg.d !== undefined) drawEvents();
  }

  // The view is attached to the page after render() returns; follow its real width.
  const observer = new ResizeObserver(() => {
    if (plot.isConnected && plot.data) Plotly.Plots.resize(plot);
  });
  observer.observe(plot);
  model.on("change:_figure", draw);
  model.on("msg:custom", onMessage);
  draw();
  early.forEach(onMessage);
  model.send({ k: "sync", n: seq });
  return () => {
    observer.disconnect();
    model.off("change:_figure", draw);
    model.off("msg:custom", onMessage);
    Plotly.purge(plot);
  };
}

export default { initialize, render };
