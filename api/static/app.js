// hpservice web page: job list, live job view (SSE), charts drawn on <canvas>. No dependencies.
"use strict";

(() => {
  const TERMINAL = new Set(); // filled from GET /v1/job-states before anything is shown
  const TOKEN_KEY = "hpservice.token";
  const REFRESH_MS = 3000;
  const MAX_LOG_LINES = 200;
  const MAX_RETRY_MS = 30000;

  const $ = (id) => document.getElementById(id);
  const el = (tag, props = {}, text) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    if (text !== undefined) node.textContent = text;
    return node;
  };

  // ---------------------------------------------------------------- formatting

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function fmtNum(v, digits = 4) {
    if (!isNum(v)) return "—";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toPrecision(digits)));
  }

  function fmtRate(v) {
    if (!isNum(v)) return "—";
    const a = Math.abs(v);
    if (a >= 1e9) return `${(v / 1e9).toFixed(2)}G`;
    if (a >= 1e6) return `${(v / 1e6).toFixed(2)}M`;
    if (a >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
    return fmtNum(v, 3);
  }

  function fmtLr(v) {
    if (!isNum(v)) return "—";
    return v !== 0 && Math.abs(v) < 1e-2 ? v.toExponential(2) : fmtNum(v);
  }

  function fmtTime(t) {
    if (!isNum(t)) return "—";
    const d = new Date(t * 1000);
    const opts = { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" };
    if (d.getFullYear() !== new Date().getFullYear()) opts.year = "numeric";
    return d.toLocaleString(undefined, opts);
  }

  function fmtClock(t) {
    if (!isNum(t)) return "";
    return new Date(t * 1000).toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  function stepText(step, total) {
    const s = isNum(step) ? step : 0;
    return isNum(total) && total > 0 ? `${s} / ${total}` : String(s);
  }

  function setBadge(node, state) {
    const s = state || "UNKNOWN";
    node.textContent = s;
    node.className = `badge badge-${s.toLowerCase()}`;
    node.dataset.state = s;
  }

  // ---------------------------------------------------------------- auth + fetch

  function loadToken() {
    try {
      return localStorage.getItem(TOKEN_KEY) || "";
    } catch {
      return "";
    }
  }

  let token = loadToken();
  let authNeeded = false;

  function saveToken(value) {
    token = value;
    try {
      if (value) localStorage.setItem(TOKEN_KEY, value);
      else localStorage.removeItem(TOKEN_KEY);
    } catch {
      // storage unavailable (private mode): the token lives for this page only
    }
    $("forget-token").hidden = !token;
  }

  class AuthError extends Error {}

  function showAuth(message) {
    authNeeded = true;
    const box = $("auth");
    $("auth-msg").textContent = message;
    if (box.hidden) {
      box.hidden = false;
      $("token-input").focus();
    }
  }

  function hideAuth() {
    authNeeded = false;
    $("auth").hidden = true;
  }

  async function apiSend(method, path) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    const res = await fetch(path, { method, headers, cache: "no-store" });
    if (res.status === 401) {
      showAuth(token ? "The saved token was rejected. Enter another one." : "This server needs an API token.");
      throw new AuthError("unauthorized");
    }
    if (!res.ok) {
      let message = `${res.status} ${res.statusText}`;
      try {
        const body = await res.json();
        if (body && body.error && body.error.message) message = body.error.message;
      } catch {
        // not JSON
      }
      const err = new Error(message);
      err.status = res.status;
      throw err;
    }
    return res.status === 204 ? null : res.json();
  }

  async function api(path) {
    return apiSend("GET", path);
  }


  function setConn(text, bad = false) {
    const node = $("conn");
    node.textContent = text;
    node.classList.toggle("conn-bad", bad);
  }

  // ---------------------------------------------------------------- chart

  function niceStep(range, count) {
    const raw = range / Math.max(count, 1);
    const mag = 10 ** Math.floor(Math.log10(raw));
    const norm = raw / mag;
    const nice = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
    return nice * mag;
  }

  function ticks(lo, hi, count, integer = false) {
    let step = niceStep(hi - lo, count);
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    }
    return out;
  }

  function cssVar(node, name, fallback) {
    const v = getComputedStyle(node).getPropertyValue(name).trim();
    return v || fallback;
  }

  // Index of the point whose x is nearest to x (xs ascending).
  function nearest(xs, x) {
    let lo = 0;
    let hi = xs.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0 && Math.abs(xs[lo - 1] - x) <= Math.abs(xs[lo] - x)) lo -= 1;
    return lo;
  }

  class LineChart {
    constructor(canvas, { label, yTitle, colorVar, fmt, readout }) {
      this.canvas = canvas;
      this.label = label;
      this.yTitle = yTitle; // the y axis's title, drawn along it; the x axis is always "step"
      this.overlays = []; // other runs drawn under this one: [{ label, color, xs, ys }]
      this.colorVar = colorVar;
      this.fmt = fmt;
      this.readout = readout;
      this.xs = [];
      this.ys = [];
      this.hover = null;
      this.geom = null;
      this.emptyText = "Waiting for metrics…";
      if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
      canvas.addEventListener("pointermove", (e) => this.onPointer(e));
      canvas.addEventListener("pointerleave", () => {
        this.hover = null;
        this.draw();
      });
    }

    setData(xs, ys) {
      this.xs = xs;
      this.ys = ys;
      this.canvas.dataset.points = String(xs.length);
      const n = xs.length;
      const axes = `x: step, y: ${this.yTitle}`;
      const others = this.overlays.length ? `; compared with ${this.overlays.map((o) => o.label).join(", ")}` : "";
      this.canvas.setAttribute(
        "aria-label",
        n ? `${this.label} chart (${axes}): ${n} points, latest ${this.fmt(ys[n - 1])} at step ${xs[n - 1]}${others}`
          : `${this.label} chart (${axes}): no data yet${others}`,
      );
      if (this.hover !== null && this.hover >= n) this.hover = null;
    }

    setOverlays(overlays) {
      this.overlays = overlays;
      this.canvas.dataset.overlays = String(overlays.length);
      this.setData(this.xs, this.ys);
    }

    onPointer(e) {
      if (!this.geom || !this.xs.length) return;
      const rect = this.canvas.getBoundingClientRect();
      const { x0, x1, xmin, xmax } = this.geom;
      const px = Math.min(Math.max(e.clientX - rect.left, x0), x1);
      this.hover = nearest(this.xs, xmin + ((px - x0) / (x1 - x0 || 1)) * (xmax - xmin));
      this.draw();
    }

    draw() {
      const c = this.canvas;
      const rect = c.getBoundingClientRect();
      if (rect.width < 10 || rect.height < 10) return;
      const dpr = window.devicePixelRatio || 1;
      const w = Math.round(rect.width * dpr);
      const h = Math.round(rect.height * dpr);
      if (c.width !== w || c.height !== h) {
        c.width = w;
        c.height = h;
      }
      const ctx = c.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      const W = rect.width;
      const H = rect.height;
      ctx.clearRect(0, 0, W, H);

      const text = cssVar(c, "--chart-text", "#555");
      const grid = cssVar(c, "--chart-grid", "#ddd");
      const line = cssVar(c, this.colorVar, "#1f6feb");
      ctx.font = "12px system-ui, sans-serif";
      ctx.textBaseline = "middle";

      const { xs, ys } = this;
      const n = xs.length;
      if (!n) {
        this.geom = null;
        ctx.fillStyle = text;
        ctx.textAlign = "center";
        ctx.fillText(this.emptyText, W / 2, H / 2);
        if (this.readout) this.readout.textContent = "";
        return;
      }

      let ymin = Infinity;
      let ymax = -Infinity;
      for (const series of [ys, ...this.overlays.map((o) => o.ys)]) {
        for (const y of series) {
          if (y < ymin) ymin = y;
          if (y > ymax) ymax = y;
        }
      }
      if (ymin === ymax) {
        const d = Math.abs(ymin) * 0.1 || 1;
        ymin -= d;
        ymax += d;
      } else {
        const pad = (ymax - ymin) * 0.06;
        ymin -= pad;
        ymax += pad;
      }
      let xmin = xs[0];
      let xmax = xs[n - 1];
      for (const o of this.overlays) {
        if (o.xs.length && o.xs[0] < xmin) xmin = o.xs[0];
        if (o.xs.length && o.xs[o.xs.length - 1] > xmax) xmax = o.xs[o.xs.length - 1];
      }
      if (xmin === xmax) {
        xmin -= 1;
        xmax += 1;
      }

      const yt = ticks(ymin, ymax, Math.max(2, Math.floor(H / 38)));
      const ylabels = yt.map((v) => this.fmt(v));
      let labelW = 0;
      for (const s of ylabels) labelW = Math.max(labelW, ctx.measureText(s).width);
      const x0 = Math.ceil(labelW) + 12 + 16; // tick labels, and the y axis title left of them
      const x1 = W - 12;
      const y0 = 8;
      const y1 = H - 36; // tick labels, then the axis title below them
      const sx = (x) => x0 + ((x - xmin) / (xmax - xmin)) * (x1 - x0);
      const sy = (y) => y1 - ((y - ymin) / (ymax - ymin)) * (y1 - y0);
      this.geom = { x0, x1, xmin, xmax };

      // grid + axis labels
      ctx.lineWidth = 1;
      ctx.strokeStyle = grid;
      ctx.fillStyle = text;
      ctx.textAlign = "right";
      yt.forEach((v, i) => {
        const y = Math.round(sy(v)) + 0.5;
        ctx.beginPath();
        ctx.moveTo(x0, y);
        ctx.lineTo(x1, y);
        ctx.stroke();
        ctx.fillText(ylabels[i], x0 - 6, y);
      });
      ctx.textAlign = "center";
      ctx.textBaseline = "top";
      for (const v of ticks(xmin, xmax, Math.max(2, Math.floor((x1 - x0) / 70)), true)) {
        const x = Math.round(sx(v)) + 0.5;
        ctx.beginPath();
        ctx.moveTo(x, y1);
        ctx.lineTo(x, y1 + 4);
        ctx.stroke();
        const label = String(v);
        const half = ctx.measureText(label).width / 2;
        ctx.fillText(label, Math.min(Math.max(x, half + 2), W - half - 2), y1 + 6);
      }
      ctx.beginPath();
      ctx.moveTo(x0, y1 + 0.5);
      ctx.lineTo(x1, y1 + 0.5);
      ctx.stroke();
      ctx.fillText("step", (x0 + x1) / 2, y1 + 20); // x axis title
      ctx.save();
      ctx.translate(8, (y0 + y1) / 2);
      ctx.rotate(-Math.PI / 2);
      ctx.textBaseline = "middle";
      ctx.fillText(this.yTitle, 0, 0); // y axis title
      ctx.restore();

      // the series; many points per pixel column are drawn as that column's min/max
      ctx.save();
      ctx.beginPath();
      ctx.rect(x0, y0 - 4, x1 - x0 + 4, y1 - y0 + 8);
      ctx.clip();
      ctx.lineWidth = 1.5;
      for (const o of this.overlays) {
        ctx.strokeStyle = o.color;
        ctx.beginPath();
        o.xs.forEach((x, i) => (i === 0 ? ctx.moveTo(sx(x), sy(o.ys[i])) : ctx.lineTo(sx(x), sy(o.ys[i]))));
        ctx.stroke();
      }
      ctx.strokeStyle = line;
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      ctx.beginPath();
      if (n > (x1 - x0) * 2) {
        let col = -1;
        let lo = 0;
        let hi = 0;
        let first = true;
        const flush = () => {
          if (col < 0) return;
          if (first) ctx.moveTo(col, sy(lo));
          else ctx.lineTo(col, sy(lo));
          ctx.lineTo(col, sy(hi));
          first = false;
        };
        for (let i = 0; i < n; i++) {
          const px = Math.round(sx(xs[i]));
          if (px !== col) {
            flush();
            col = px;
            lo = hi = ys[i];
          } else {
            if (ys[i] < lo) lo = ys[i];
            if (ys[i] > hi) hi = ys[i];
          }
        }
        flush();
      } else {
        for (let i = 0; i < n; i++) {
          if (i === 0) ctx.moveTo(sx(xs[i]), sy(ys[i]));
          else ctx.lineTo(sx(xs[i]), sy(ys[i]));
        }
      }
      ctx.stroke();
      ctx.restore();

      // latest point, or the hovered one with a guide line
      const i = this.hover ?? n - 1;
      const px = sx(xs[i]);
      const py = sy(ys[i]);
      if (this.hover !== null) {
        ctx.strokeStyle = text;
        ctx.lineWidth = 1;
        ctx.setLineDash([3, 3]);
        ctx.beginPath();
        ctx.moveTo(Math.round(px) + 0.5, y0);
        ctx.lineTo(Math.round(px) + 0.5, y1);
        ctx.stroke();
        ctx.setLineDash([]);
      }
      ctx.fillStyle = line;
      ctx.beginPath();
      ctx.arc(px, py, 3.5, 0, Math.PI * 2);
      ctx.fill();
      if (this.readout) {
        this.readout.textContent = `${this.hover !== null ? "" : "latest "}step ${xs[i]}: ${this.fmt(ys[i])}`;
      }
    }
  }

  const charts = {
    loss: new LineChart($("loss-chart"), { label: "Loss", yTitle: "loss", colorVar: "--chart-loss", fmt: fmtNum, readout: $("loss-readout") }),
    lr: new LineChart($("lr-chart"), { label: "Learning rate", yTitle: "lr", colorVar: "--chart-lr", fmt: fmtLr, readout: $("lr-readout") }),
    tps: new LineChart($("tps-chart"), { label: "Tokens per second", yTitle: "tokens/s", colorVar: "--chart-tps", fmt: fmtRate, readout: $("tps-readout") }),
    val: new LineChart($("val-chart"), { label: "Validation loss", yTitle: "val loss", colorVar: "--chart-val", fmt: fmtNum, readout: $("val-readout") }),
  };

  // ---------------------------------------------------------------- comparing runs
  // Other runs' losses overlaid on the loss chart (as in TensorBoard or W&B): picked from the jobs
  // list, fetched once (an ended run's metrics do not change; a live one's are as of the pick).
  const OVERLAY_COLORS = ["#cf222e", "#8250df", "#1a7f37", "#bc4c00", "#6e7781", "#0a7ea4"];
  const compared = new Map(); // job id -> { label, color, xs, ys }
  let knownJobs = new Map(); // job id -> the jobs list's entry

  function renderCompare() {
    const select = $("compare-select");
    const choices = [...knownJobs.values()].filter((j) => (!cur || j.id !== cur.id) && !compared.has(j.id));
    select.replaceChildren(
      el("option", { value: "" }, choices.length ? "another run…" : "no other runs"),
      ...choices.map((j) => el("option", { value: j.id }, `${j.name} (${j.id})`)),
    );
    select.disabled = choices.length === 0;
    $("compare-legend").replaceChildren(
      ...[...compared].map(([id, o]) => {
        const remove = el("button", { type: "button", class: "link-button", "aria-label": `Stop comparing with ${o.label}` }, "×");
        remove.addEventListener("click", () => {
          compared.delete(id);
          applyOverlays();
        });
        const swatch = el("span", { class: "swatch", "aria-hidden": "true" });
        swatch.style.background = o.color; // CSSOM, which the page's CSP allows (a style attribute it would not)
        const li = el("li");
        li.append(swatch, ` ${o.label} `, remove);
        return li;
      }),
    );
  }

  function applyOverlays() {
    charts.loss.setOverlays([...compared].filter(([id]) => !cur || id !== cur.id).map(([, o]) => o));
    renderCompare();
    scheduleDraw();
  }

  async function compareWith(id) {
    const job = knownJobs.get(id);
    if (!job || compared.has(id)) return;
    const xs = [];
    const ys = [];
    let since = 0;
    try {
      for (;;) {
        const page = await api(`/v1/jobs/${encodeURIComponent(id)}/metrics?since_step=${since}`);
        for (const r of page.records || []) {
          if (isNum(r.step) && isNum(r.loss)) {
            xs.push(r.step);
            ys.push(r.loss);
          }
        }
        if (!page.records || !page.records.length || page.next_since_step <= since) break;
        since = page.next_since_step;
      }
    } catch (err) {
      if (!(err instanceof AuthError)) setConn(`Cannot load the metrics of ${id}: ${err.message}`, true);
      return;
    }
    const color = OVERLAY_COLORS[compared.size % OVERLAY_COLORS.length];
    compared.set(id, { label: `${job.name} (${id})`, color, xs, ys });
    applyOverlays();
  }

  // ---------------------------------------------------------------- job list

  const rows = new Map(); // job id -> <tr>
  let listSeq = 0;

  function hashJob() {
    const m = location.hash.match(/^#job=(.+)$/);
    if (!m) return null;
    try {
      return decodeURIComponent(m[1]);
    } catch {
      return null;
    }
  }

  function jobHref(id) {
    return `#job=${encodeURIComponent(id)}`;
  }

  function makeRow(id) {
    const tr = el("tr", { "data-testid": "job-row", "data-job-id": id, class: "job-row" });
    const idCell = el("td", { class: "mono cell-id" });
    idCell.append(el("a", { href: jobHref(id) }, id));
    tr.append(
      idCell,
      el("td", { class: "cell-name" }),
      el("td", { class: "cell-owner" }),
      el("td", { class: "cell-state" }, ""),
      el("td", { class: "num cell-step" }),
      el("td", { class: "num cell-restarts" }),
    );
    tr.cells[3].append(el("span", { class: "badge" }));
    tr.addEventListener("click", (e) => {
      if (e.target.closest("a")) return; // the link changes the hash itself
      location.hash = jobHref(id);
    });
    return tr;
  }

  function updateRow(tr, job) {
    tr.cells[1].textContent = job.name || "";
    tr.cells[2].textContent = job.owner || "";
    setBadge(tr.cells[3].firstChild, job.state);
    tr.cells[4].textContent = stepText(job.step, job.total_steps);
    tr.cells[5].textContent = String(job.restarts ?? 0);
    tr.title = job.message || "";
  }

  function markSelectedRow() {
    for (const [id, tr] of rows) {
      if (cur && id === cur.id) tr.setAttribute("aria-current", "true");
      else tr.removeAttribute("aria-current");
    }
  }

  function renderJobs(items) {
    knownJobs = new Map(items.map((j) => [j.id, j]));
    renderCompare();
    const body = $("job-rows");
    const seen = new Set();
    items.forEach((job) => {
      seen.add(job.id);
      let tr = rows.get(job.id);
      if (!tr) {
        tr = makeRow(job.id);
        rows.set(job.id, tr);
      }
      // the selected job's live state beats the (slightly older) polled one
      updateRow(tr, job);
    });
    for (const [id, tr] of rows) {
      if (!seen.has(id)) {
        tr.remove();
        rows.delete(id);
      }
    }
    // reorder only when needed, so a focused link keeps its focus
    const order = items.map((j) => rows.get(j.id));
    const same = order.length === body.children.length && order.every((tr, i) => body.children[i] === tr);
    if (!same) order.forEach((tr) => body.append(tr));
    $("jobs-empty").hidden = items.length > 0;
    markSelectedRow();
    // the selected job's row shows its live state (the stream is ahead of the poll)
    if (cur && rows.has(cur.id) && cur.liveJob) {
      renderState();
      renderStep();
    }
  }

  async function refreshJobs() {
    const seq = ++listSeq;
    try {
      const data = await api("/v1/jobs?limit=50");
      if (seq !== listSeq) return;
      hideAuth();
      renderJobs(data.items || []);
      $("jobs-updated").textContent = `updated ${fmtClock(Date.now() / 1000)}`;
      setConn("");
    } catch (err) {
      if (err instanceof AuthError) return;
      setConn(`Cannot list jobs: ${err.message}`, true);
    }
  }

  // ---------------------------------------------------------------- job view

  let cur = null; // the selected job and its live data
  let drawQueued = false;

  function newCurrent(id) {
    return {
      id,
      job: null,
      liveJob: null, // fields updated by the stream: state, message, restarts, step
      es: null,
      terminal: false,
      lastEventId: 0,
      prevIdStr: "",
      retryMs: 1000,
      retryTimer: null,
      metrics: new Map(), // step -> record (a restart's replayed steps replace the old ones)
      sorted: [], // the records by step; rebuilt only when a step arrives out of order
      sortedOk: true,
      lossCount: 0,
      checkpoints: new Map(),
      logs: [],
      history: [],
      fetchSeq: 0,
    };
  }

  function scheduleDraw() {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(() => {
      drawQueued = false;
      renderLive();
    });
  }

  function seriesOf(recs, key) {
    const xs = [];
    const ys = [];
    for (const r of recs) {
      if (isNum(r[key])) {
        xs.push(r.step);
        ys.push(r[key]);
      }
    }
    return [xs, ys];
  }

  function renderLive() {
    if (!cur) return;
    if (!cur.sortedOk) {
      cur.sorted = [...cur.metrics.values()].sort((a, b) => a.step - b.step);
      cur.sortedOk = true;
    }
    const recs = cur.sorted;
    charts.loss.setData(...seriesOf(recs, "loss"));
    charts.lr.setData(...seriesOf(recs, "lr"));
    charts.tps.setData(...seriesOf(recs, "tokens_per_s"));
    charts.val.setData(...seriesOf(recs, "val_loss")); // eval: every eval.interval steps
    for (const c of Object.values(charts)) c.draw();
    const last = recs[recs.length - 1];
    $("f-loss").textContent = last ? fmtNum(last.loss) : "—";
    $("f-lr").textContent = last ? fmtLr(last.lr) : "—";
    $("f-tps").textContent = last ? fmtRate(last.tokens_per_s) : "—";
    renderStep();
    renderLogs();
  }

  function renderStep() {
    const job = cur.job || {};
    const live = cur.liveJob || {};
    // the stream's latest step (it goes back after a restart from a checkpoint), else the polled one
    const step = isNum(live.step) ? live.step : job.step || 0;
    const total = job.total_steps;
    $("f-step").textContent = stepText(step, total);
    const prog = $("f-progress");
    if (isNum(total) && total > 0) {
      prog.max = total;
      prog.value = Math.min(step, total);
      prog.hidden = false;
    } else {
      prog.hidden = true;
    }
    const tr = rows.get(cur.id);
    if (tr) tr.cells[4].textContent = stepText(step, total);
  }

  function renderState() {
    const job = cur.job || {};
    const live = cur.liveJob || {};
    // the stream is authoritative while it runs; the polled job otherwise (or once it ended)
    const useLive = live.state && (cur.es || !job.state || !TERMINAL.has(job.state));
    const state = useLive ? live.state : job.state;
    const message = useLive && live.message !== undefined ? live.message : job.message;
    setBadge($("job-state"), state);
    $("job-message").textContent = message || "";
    const ended = TERMINAL.has(state);
    for (const chart of Object.values(charts)) {
      chart.emptyText = ended ? "No metrics: the job ended before reporting any." : "Waiting for metrics…";
    }
    $("job-cancel").hidden = ended || !state;
    $("job-delete").hidden = !ended;
    $("job-resubmit").hidden = !ended;
    const tr = rows.get(cur.id);
    if (tr) setBadge(tr.cells[3].firstChild, state);

    const restarts = Math.max(job.restarts || 0, live.restarts || 0);
    $("restart-count").textContent = restarts === 1 ? "1 restart." : `${restarts} restarts.`;
    if (tr) tr.cells[5].textContent = String(restarts);
    const list = $("restart-reasons");
    list.replaceChildren(...(job.restart_reasons || []).map((r) => el("li", {}, typeof r === "string" ? r : JSON.stringify(r))));
    list.hidden = list.children.length === 0;
    renderPlacement(job.placement || []);
  }

  // rank -> node of the current attempt, one line per node: "node 3026f34c (10.0.0.2): ranks 0, 1"
  function renderPlacement(placement) {
    const byNode = new Map();
    for (const p of placement) {
      if (!byNode.has(p.node)) byNode.set(p.node, []);
      byNode.get(p.node).push(p.rank);
    }
    $("placement-summary").textContent = placement.length
      ? `${placement.length} ranks on ${byNode.size} node${byNode.size === 1 ? "" : "s"}.`
      : "Not placed yet.";
    $("placement").replaceChildren(
      ...[...byNode].map(([node, ranks]) => el("li", {}, `${node}: rank${ranks.length === 1 ? "" : "s"} ${ranks.join(", ")}`)),
    );
  }

  function renderCheckpoints() {
    const ckpts = [...cur.checkpoints.values()].sort((a, b) => a.step - b.step);
    const body = $("ckpt-rows");
    body.replaceChildren(
      ...ckpts.map((c) => {
        const tr = el("tr");
        const loss = c.metrics && isNum(c.metrics.loss) ? fmtNum(c.metrics.loss) : "—";
        tr.append(
          el("td", { class: "num" }, String(c.step)),
          el("td", { class: "num mono" }, loss),
          el("td", { class: "nowrap cell-time" }, fmtTime(c.time)),
          // LRM: the path reads left to right where a narrow screen lays the cell out right to left
          el("td", { class: "mono path", title: c.path || "" }, `\u200E${c.path || ""}`),
        );
        const action = el("td");
        action.append(exportButton(c));
        tr.append(action);
        return tr;
      }),
    );
    $("ckpt-empty").hidden = ckpts.length > 0;
  }

  function exportButton(c) {
    // the checkpoint as a Hugging Face directory in the job's exports/ (POST .../export)
    const button = el("button", { type: "button", class: "small", "data-testid": "export" }, "Export");
    const job = cur;
    button.addEventListener("click", async () => {
      button.disabled = true;
      button.textContent = "Exporting…";
      try {
        const body = await apiSend("POST", `/v1/jobs/${encodeURIComponent(job.id)}/checkpoints/${c.step}/export`);
        button.replaceWith(el("span", { class: "mono path", title: body.path, "data-testid": "exported" }, body.path));
      } catch (e) {
        button.disabled = false;
        button.textContent = "Export";
        setConn(`Cannot export step ${c.step}: ${e.message}`, true);
      }
    });
    return button;
  }

  function fmtBytes(n) {
    if (!isNum(n)) return "";
    if (n < 1024) return `${n} B`;
    if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`;
    return `${(n / (1 << 20)).toFixed(1)} MiB`;
  }

  async function downloadArtifact(a) {
    // a plain link cannot send the bearer token: fetch it, then save the blob
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const res = await fetch(a.url, { headers, cache: "no-store" });
    if (!res.ok) {
      setConn(`Cannot download ${a.name}: ${res.status} ${res.statusText}`, true);
      return;
    }
    const href = URL.createObjectURL(await res.blob());
    const link = el("a", { href, download: a.name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(href), 10000);
  }

  function renderArtifacts(found) {
    $("artifacts").replaceChildren(
      ...found.map((a) => {
        const link = el("a", { href: a.url, class: "mono" }, a.name);
        link.addEventListener("click", (ev) => {
          ev.preventDefault();
          downloadArtifact(a);
        });
        const li = el("li");
        li.append(link, ` ${fmtBytes(a.size)}`);
        return li;
      }),
    );
    $("artifacts-empty").hidden = found.length > 0;
  }

  async function loadArtifacts(c) {
    try {
      const found = (await api(`/v1/jobs/${encodeURIComponent(c.id)}/artifacts`)).artifacts || [];
      if (c === cur) renderArtifacts(found);
    } catch {
      // a server without the route, or the job is gone: leave the list as it is
    }
  }

  function renderLogs() {
    const pre = $("logs");
    if (pre.dataset.count === String(cur.logs.length) && pre.dataset.last === String(cur.logSeq || 0)) return;
    const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
    pre.textContent = cur.logs.length
      ? cur.logs
          .map((l) => {
            const where = [isNum(l.rank) ? `r${l.rank}` : "", isNum(l.step) ? `s${l.step}` : ""].filter(Boolean).join(" ");
            return where ? `[${where}] ${l.line ?? ""}` : String(l.line ?? "");
          })
          .join("\n")
      : "No log lines yet.";
    pre.dataset.count = String(cur.logs.length);
    pre.dataset.last = String(cur.logSeq || 0);
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  // ---------------------------------------------------------------- full log (paged) and download

  const LOG_PAGE = 1000;
  const logLine = (l) => {
    const where = [isNum(l.rank) ? `r${l.rank}` : "", isNum(l.step) ? `s${l.step}` : ""].filter(Boolean).join(" ");
    return where ? `[${where}] ${l.line ?? ""}` : String(l.line ?? "");
  };

  async function logPage(job, since, limit) {
    return api(`/v1/jobs/${encodeURIComponent(job.id)}/logs?since=${since}&limit=${limit}`);
  }

  async function loadMoreLog() {
    const job = cur;
    if (!job) return;
    const box = $("full-log");
    const page = await logPage(job, job.fullLogSince || 0, LOG_PAGE);
    if (job !== cur) return;
    job.fullLogSince = page.next_since;
    const text = page.lines.map(logLine).join("\n");
    if (text) box.textContent += (box.textContent ? "\n" : "") + text;
    else if (!box.textContent) box.textContent = "No log lines yet.";
    box.dataset.lines = String(Number(box.dataset.lines || 0) + page.lines.length);
    $("log-more").disabled = page.lines.length < LOG_PAGE; // the end, for now
  }

  async function downloadLog() {
    const job = cur;
    if (!job) return;
    const parts = [];
    for (let since = 0; ; ) {
      const page = await logPage(job, since, 5000);
      parts.push(...page.lines.map(logLine));
      if (page.lines.length < 5000) break;
      since = page.next_since;
    }
    const url = URL.createObjectURL(new Blob([parts.join("\n") + "\n"], { type: "text/plain" }));
    const a = el("a", { href: url, download: `${job.id}.log` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  function resetFullLog() {
    $("full-log").textContent = "";
    $("full-log").dataset.lines = "0";
    $("log-more").disabled = false;
    $("full-log-box").open = false;
  }

  function renderHistory() {
    const job = cur.job || {};
    const items = (job.history || []).map((h) => ({ ...h }));
    // add streamed states newer than the polled history
    const lastTime = items.length ? items[items.length - 1].time || 0 : 0;
    for (const h of cur.history) if (!isNum(h.time) || h.time > lastTime) items.push(h);
    $("history").replaceChildren(
      ...items.map((h) => {
        const li = el("li");
        const badge = el("span");
        setBadge(badge, h.state);
        li.append(el("time", {}, fmtTime(h.time)), " ", badge, h.message ? ` ${h.message}` : "");
        return li;
      }),
    );
  }

  function renderJob() {
    const job = cur.job;
    if (!job) return;
    $("job-title").textContent = job.name || job.id;
    $("f-id").textContent = job.id;
    $("f-owner").textContent = job.owner || "—";
    $("f-created").textContent = fmtTime(job.created_at);
    const link = $("ray-link");
    let url = null;
    try {
      const u = job.ray_dashboard_url ? new URL(job.ray_dashboard_url, location.href) : null;
      if (u && (u.protocol === "http:" || u.protocol === "https:")) url = u.href;
    } catch {
      url = null;
    }
    link.hidden = !url;
    $("ray-none").hidden = !!url;
    $("ray-hint").hidden = !url;
    if (url) link.href = url;
    else link.removeAttribute("href");
    // the job's list is the committed checkpoints still on storage: pruned ones leave the table
    cur.checkpoints = new Map((job.checkpoints || []).map((c) => [`${c.step}|${c.path}`, c]));
    renderState();
    renderCheckpoints();
    renderHistory();
    renderStep();
  }

  async function loadJob() {
    const c = cur;
    if (!c) return;
    const seq = ++c.fetchSeq;
    try {
      const job = await api(`/v1/jobs/${encodeURIComponent(c.id)}`);
      if (c !== cur || seq !== c.fetchSeq) return;
      c.job = job;
      renderJob();
      loadArtifacts(c);
    } catch (err) {
      if (c !== cur || err instanceof AuthError) return;
      if (err.status === 404) {
        closeStream(c);
        c.terminal = true;
        $("job-title").textContent = c.id;
        setBadge($("job-state"), "UNKNOWN");
        $("job-message").textContent = "This job does not exist (or it belongs to another owner).";
        setStreamStatus("");
      } else {
        setConn(`Cannot load job: ${err.message}`, true);
      }
    }
  }

  function setStreamStatus(text, kind = "") {
    const node = $("stream-status");
    node.textContent = text;
    node.dataset.kind = kind;
  }

  function closeStream(c) {
    if (!c) return;
    if (c.es) {
      c.es.close();
      c.es = null;
    }
    clearTimeout(c.retryTimer);
    c.retryTimer = null;
  }

  // Ignore events already seen (a fresh EventSource replays the history from the start).
  function accept(c, e) {
    if (c !== cur) return false;
    const idStr = e.lastEventId || "";
    if (idStr && idStr !== c.prevIdStr) {
      const id = Number.parseInt(idStr, 10);
      c.prevIdStr = idStr;
      if (Number.isFinite(id)) {
        if (id <= c.lastEventId) return false;
        c.lastEventId = id;
      }
    }
    return true;
  }

  function parse(e) {
    try {
      return JSON.parse(e.data);
    } catch {
      return null;
    }
  }

  const handlers = {
    metrics(c, rec) {
      if (!isNum(rec.step)) return;
      const old = c.metrics.get(rec.step);
      if (isNum(rec.loss) && !(old && isNum(old.loss))) c.lossCount += 1;
      else if (!isNum(rec.loss) && old && isNum(old.loss)) c.lossCount -= 1;
      c.metrics.set(rec.step, rec);
      const last = c.sorted[c.sorted.length - 1];
      if (c.sortedOk && !old && (!last || rec.step > last.step)) c.sorted.push(rec);
      else c.sortedOk = false;
      c.liveJob = { ...c.liveJob, step: rec.step };
      // the hook for tests is kept current even when frames are not being drawn
      $("loss-chart").dataset.points = String(c.lossCount);
      scheduleDraw();
    },
    state(c, d) {
      c.liveJob = { ...c.liveJob, state: d.state, message: d.message, restarts: d.restarts };
      c.history.push(d);
      if (TERMINAL.has(d.state)) {
        c.terminal = true;
        closeStream(c);
        setStreamStatus("stream ended", "ended");
      }
      renderState();
      renderHistory();
      // fetch what the stream does not carry (restart reasons, final step, checkpoint times)
      if (TERMINAL.has(d.state) || d.state === "RESTARTING") loadJob();
      if (TERMINAL.has(d.state)) setTimeout(() => c === cur && loadJob(), 2000); // late writes
    },
    checkpoint(c, d) {
      if (!isNum(d.step)) return;
      const key = `${d.step}|${d.path}`;
      const { kept, ...ckpt } = d;
      c.checkpoints.set(key, { ...c.checkpoints.get(key), ...ckpt });
      if (Array.isArray(kept)) {
        // checkpoint.keep pruned the older ones: show only what is on storage
        for (const [k, v] of c.checkpoints) if (!kept.includes(v.step)) c.checkpoints.delete(k);
      }
      renderCheckpoints();
    },
    log(c, d) {
      c.logs.push(d);
      if (c.logs.length > MAX_LOG_LINES) c.logs.splice(0, c.logs.length - MAX_LOG_LINES);
      c.logSeq = (c.logSeq || 0) + 1;
      scheduleDraw();
    },
  };

  function openStream() {
    const c = cur;
    if (!c || c.terminal || c.es) return;
    let url = `/v1/jobs/${encodeURIComponent(c.id)}/events`;
    if (token) url += `?token=${encodeURIComponent(token)}`;
    const es = new EventSource(url);
    c.es = es;
    setStreamStatus("connecting…", "wait");
    es.onopen = () => {
      if (c !== cur) return;
      c.retryMs = 1000;
      setStreamStatus("live", "live");
    };
    for (const [kind, fn] of Object.entries(handlers)) {
      es.addEventListener(kind, (e) => {
        if (!accept(c, e)) return;
        const data = parse(e);
        if (data && typeof data === "object") fn(c, data);
      });
    }
    es.onerror = () => {
      if (c !== cur || c.terminal || c.es !== es) return;
      if (es.readyState !== EventSource.CLOSED) {
        setStreamStatus("reconnecting…", "wait"); // the browser retries with Last-Event-ID
        return;
      }
      // the server refused the stream (401, 404, 5xx): find out why, then retry with back-off
      es.close();
      c.es = null;
      setStreamStatus("disconnected", "bad");
      loadJob().then(() => {
        if (c !== cur || c.terminal || authNeeded) return;
        c.retryTimer = setTimeout(openStream, c.retryMs);
        c.retryMs = Math.min(c.retryMs * 2, MAX_RETRY_MS);
      });
    };
  }

  function selectJob(id, { focus = false } = {}) {
    if (cur && cur.id === id) return;
    closeStream(cur);
    cur = id ? newCurrent(id) : null;
    $("job-placeholder").hidden = !!cur;
    $("job-detail").hidden = !cur;
    markSelectedRow();
    if (!cur) {
      document.title = "hpservice";
      return;
    }
    document.title = `${id} · hpservice`;
    for (const node of ["job-title", "f-id"]) $(node).textContent = id;
    for (const node of ["job-message", "f-owner", "f-created", "f-step"]) $(node).textContent = "";
    setBadge($("job-state"), "…");
    $("loss-chart").dataset.points = "0";
    $("ray-link").hidden = true;
    resetFullLog();
    renderCheckpoints();
    renderState();
    renderHistory();
    renderLive();
    applyOverlays(); // the compared runs stay; the job itself is never compared with itself
    if (focus) {
      // move focus to the job; scroll only where it sits below the list (one-column layout)
      const view = $("job-view");
      const top = view.getBoundingClientRect().top;
      view.focus({ preventScroll: true });
      if (top < 0 || top > window.innerHeight * 0.6) view.scrollIntoView({ block: "start" });
    }
    loadJob();
    openStream();
  }

  function onHash(focus) {
    selectJob(hashJob(), { focus });
  }

  // ---------------------------------------------------------------- wiring

  $("compare-select").addEventListener("change", (e) => {
    const id = e.target.value;
    e.target.value = "";
    if (id) compareWith(id);
  });

  $("auth-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    saveToken(value);
    $("token-input").value = "";
    hideAuth();
    refreshJobs();
    // reconnect the selected job with the new token
    const id = cur && cur.id;
    closeStream(cur);
    cur = null;
    if (id) selectJob(id);
  });

  $("full-log-box").addEventListener("toggle", () => {
    if ($("full-log-box").open && $("full-log").dataset.lines === "0") loadMoreLog().catch((e) => setConn(`Cannot read the log: ${e.message}`, true));
  });
  $("log-more").addEventListener("click", () => loadMoreLog().catch((e) => setConn(`Cannot read the log: ${e.message}`, true)));
  $("log-download").addEventListener("click", () => downloadLog().catch((e) => setConn(`Cannot download the log: ${e.message}`, true)));

  $("forget-token").addEventListener("click", () => {
    saveToken("");
    closeStream(cur);
    refreshJobs();
  });

  window.addEventListener("hashchange", () => onHash(true));
  const dark = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  if (dark && dark.addEventListener) dark.addEventListener("change", () => Object.values(charts).forEach((c) => c.draw()));

  setInterval(() => {
    if (document.hidden) return;
    refreshJobs();
    if (cur && !cur.terminal) loadJob();
  }, REFRESH_MS);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refreshJobs();
  });

  $("job-cancel").addEventListener("click", async () => {
    if (!cur) return;
    try {
      await apiSend("POST", `/v1/jobs/${encodeURIComponent(cur.id)}/cancel`);
      setConn(`Cancel requested for ${cur.id}: it finishes its step and checkpoints.`);
      loadJob();
    } catch (err) {
      if (!(err instanceof AuthError)) setConn(`Cannot cancel: ${err.message}`, true);
    }
  });
  $("job-resubmit").addEventListener("click", async () => {
    if (!cur) return;
    try {
      const job = await apiSend("POST", `/v1/jobs/${encodeURIComponent(cur.id)}/resubmit`);
      setConn(`Submitted ${job.id} from ${cur.id}'s spec.`);
      location.hash = `job=${encodeURIComponent(job.id)}`;
      refreshJobs();
    } catch (err) {
      if (!(err instanceof AuthError)) setConn(`Cannot resubmit: ${err.message}`, true);
    }
  });
  $("job-delete").addEventListener("click", async () => {
    if (!cur || !window.confirm(`Delete job ${cur.id} and its stored metrics and events?`)) return;
    const id = cur.id;
    try {
      await apiSend("DELETE", `/v1/jobs/${encodeURIComponent(id)}`);
      setConn(`Deleted ${id}.`);
      location.hash = "";
      refreshJobs();
    } catch (err) {
      if (!(err instanceof AuthError)) setConn(`Cannot delete: ${err.message}`, true);
    }
  });

  async function loadJobStates() {
    const res = await fetch("/v1/job-states", { headers: { Accept: "application/json" }, cache: "no-store" });
    if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
    for (const s of (await res.json()).terminal || []) TERMINAL.add(s);
  }

  saveToken(token);
  loadJobStates()
    .catch((err) => setConn(`Cannot load the job states: ${err.message}`, true))
    .finally(() => {
      onHash(false);
      refreshJobs();
    });
})();
