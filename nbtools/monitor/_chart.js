// Front end of the GPU pane: a plotly.js figure (3 panels, one line per GPU) that
// grows by Plotly.extendTraces from small per-poll messages, plus a table of the
// current values. The whole figure travels only in the `_figure` trait, which the
// kernel rebuilds when the set of GPUs changes or a view asks to resynchronise.

const PANELS = 3; // utilization, memory, temperature; trace index = panel * gpus + row
const CONFIG = { displaylogo: false, displayModeBar: false };

function plotlyFrom(model) {
  const g = globalThis;
  if (!g.__nbtoolsPlotly) {
    if (g.Plotly && typeof g.Plotly.extendTraces === "function") {
      g.__nbtoolsPlotly = g.Plotly;
    } else {
      // plotly.min.js is a UMD bundle: hand it a CommonJS module object to fill,
      // so it neither needs a loader nor touches an AMD `define` on the page.
      const module = { exports: {} };
      new Function("module", "exports", model.get("_plotly_js"))(module, module.exports);
      g.__nbtoolsPlotly = module.exports;
    }
  }
  return g.__nbtoolsPlotly;
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

function render({ model, el }) {
  const Plotly = plotlyFrom(model);
  const root = element("div", "nbtools-gpu");
  const head = element("div", "nbtools-gpu-head");
  const source = element("span", "nbtools-gpu-source");
  const last = element("span", "nbtools-gpu-last", "no sample yet");
  const table = element("table", "nbtools-gpu-glance");
  const plot = element("div", "nbtools-gpu-plot");
  head.append(source, last);
  root.append(head, table, plot);
  el.append(root);

  let seq = -1;
  let gpus = [];
  let maxPoints = 720;
  let cells = [];

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
    cells = gpus.map(([host, index, name]) => {
      const row = element("tr");
      const label = element("td", "nbtools-gpu-name", `${host} · ${index}`);
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

  function draw() {
    const fig = model.get("_figure");
    if (!fig || !fig.data) return;
    seq = fig.n;
    gpus = fig.gpus;
    maxPoints = fig.m;
    // Without any GPU read yet (unavailable), the status line says why; no empty axes.
    plot.style.display = table.style.display = fig.data.length ? "" : "none";
    const data = fig.data.map((trace) => ({ ...trace, x: trace.x.map(local) }));
    Plotly.react(plot, data, fig.layout, CONFIG);
    const simulated = fig.source === "simulated";
    const hosts = fig.hosts === 1 ? "1 host" : `${fig.hosts} hosts`;
    const label = fig.hosts ? `${fig.source} · ${hosts}` : fig.source;
    source.textContent = simulated ? "SIMULATED GPUs (made-up numbers)" : label;
    source.classList.toggle("nbtools-gpu-simulated", simulated);
    buildTable();
    fig.glance.forEach((g, i) => fillRow(i, g));
    setLast(fig.last);
  }

  function onMessage(msg) {
    if (!msg || msg.k !== "s" || msg.n <= seq) return;
    if (msg.n !== seq + 1) {
      // A message was missed (e.g. the page was reloaded): ask for the whole figure.
      seq = msg.n;
      model.send({ k: "sync", n: -1 });
      return;
    }
    seq = msg.n;
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
    msg.g.forEach((g, j) => fillRow(msg.r + j, g));
    setLast(msg.t);
  }

  // The view is attached to the page after render() returns; follow its real width.
  const observer = new ResizeObserver(() => {
    if (plot.isConnected && plot.data) Plotly.Plots.resize(plot);
  });
  observer.observe(plot);
  model.on("change:_figure", draw);
  model.on("msg:custom", onMessage);
  draw();
  model.send({ k: "sync", n: seq });
  return () => {
    observer.disconnect();
    model.off("change:_figure", draw);
    model.off("msg:custom", onMessage);
    Plotly.purge(plot);
  };
}

export default { render };
