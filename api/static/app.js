// hpservice web page: job list, live job view (SSE), charts drawn on <canvas>. No dependencies and
// no build step: ES modules the browser loads as they are.
//   format.js  numbers, times, bytes, DOM helpers      api.js     token, requests, job states
//   chart.js   the <canvas> line chart                  stream.js  the selected job's live events
//   heatmap.js a MoE job's expert loads per step
//   app.js     (this file) the jobs list, the job view, comparing runs, the full log, actions

import {
  AuthError,
  METRIC_REGISTRY,
  TERMINAL,
  api,
  apiSend,
  hideAuth,
  loadJobStates,
  loadMetricRegistry,
  saveToken,
  setConn,
  token,
} from "./api.js";
import { LineChart } from "./chart.js";
import { ExpertHeatmap } from "./heatmap.js";
import { $, el, fmtBytes, fmtClock, fmtLr, fmtNum, fmtRate, fmtTime, isNum, setBadge, stepText } from "./format.js";
import { closeStream, openStream, setStreamStatus } from "./stream.js";

const REFRESH_MS = 3000;

const charts = {
  loss: new LineChart($("loss-chart"), { label: "Loss", yTitle: "loss", colorVar: "--chart-loss", fmt: fmtNum, readout: $("loss-readout") }),
  lr: new LineChart($("lr-chart"), { label: "Learning rate", yTitle: "lr", colorVar: "--chart-lr", fmt: fmtLr, readout: $("lr-readout") }),
  tps: new LineChart($("tps-chart"), { label: "Tokens per second", yTitle: "tokens/s", colorVar: "--chart-tps", fmt: fmtRate, readout: $("tps-readout") }),
  val: new LineChart($("val-chart"), { label: "Validation loss", yTitle: "val loss", colorVar: "--chart-val", fmt: fmtNum, readout: $("val-readout") }),
};

const experts = new ExpertHeatmap($("experts-figure"), $("experts-chart"), $("experts-layer"), $("experts-readout"));

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
    exports: new Map(), // "step|path|format" -> its export's path, as the table re-renders on each poll
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
  experts.setData(recs);
  experts.draw();
  const last = recs[recs.length - 1];
  $("f-loss").textContent = last ? fmtNum(last.loss) : "—";
  $("f-lr").textContent = last ? fmtLr(last.lr) : "—";
  $("f-tps").textContent = last ? fmtRate(last.tokens_per_s) : "—";
  renderStepMetrics(recs);
  renderMemory(recs);
  renderStep();
  renderLogs();
}

// Every metric of the registry the job has reported, at its latest value (a metric such as
// val_loss is measured on some steps only: its last value, with its step).
function renderStepMetrics(recs) {
  const body = $("metric-rows");
  const shown = [];
  for (const m of METRIC_REGISTRY) {
    let at = null;
    for (let i = recs.length - 1; i >= 0; i--) {
      if (recs[i][m.name] !== undefined && recs[i][m.name] !== null) {
        at = recs[i];
        break;
      }
    }
    if (!at) continue;
    const v = at[m.name];
    const text = m.kind === "table" ? `${Object.keys(v).length} rows` : isNum(v) ? fmtNum(v) : String(v);
    const when = at === recs[recs.length - 1] ? "" : ` (step ${at.step})`;
    const row = el("tr", { "data-metric": m.name });
    row.append(
      el("td", { class: "mono" }, m.name),
      el("td", { class: "num mono" }, text + when),
      el("td", {}, m.unit),
      el("td", { class: "small" }, m.description),
    );
    shown.push(row);
  }
  body.replaceChildren(...shown);
}

// the estimate made when the job was handed over (its spec's memory_estimate) beside each rank's
// measured peak of the last step (peak_memory_per_rank_gib: {rank: [measured, estimated]})
function renderMemory(recs) {
  const job = cur.job || {};
  const est = job.spec && job.spec.memory_estimate;
  let measured = null;
  for (let i = (recs || []).length - 1; i >= 0 && !measured; i--) measured = recs[i].peak_memory_per_rank_gib || null;
  const gib = (v) => (isNum(v) ? `${v.toFixed(3)} GiB` : "—");
  if (!est && !measured) {
    $("memory-summary").textContent = "No estimate: the job was not planned (its model was not readable where it was submitted).";
    $("memory-ranks").replaceChildren();
    return;
  }
  const parts = [];
  if (est) {
    parts.push(`Estimated peak ${gib(est.peak_gib)} per rank on ${est.device}, micro-batch ${est.micro_batch}`);
    if (isNum(est.device_memory_gib)) parts.push(`of ${gib(est.device_memory_gib)} per device`);
    if (est.auto) parts.push(`— layout chosen by auto: ${est.auto.chosen}`);
  }
  $("memory-summary").textContent = parts.join(" ") + ".";
  const lines = [];
  if (measured) {
    for (const [rank, [peak, estimate]] of Object.entries(measured)) {
      lines.push(el("li", {}, `rank ${rank}: measured ${gib(peak)}, estimated ${gib(estimate)}`));
    }
  } else if (est) {
    for (const r of est.ranks) lines.push(el("li", {}, `${r.ranks}: estimated ${gib(r.peak_gib)} (${r.phase})`));
  }
  $("memory-ranks").replaceChildren(...lines);
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
      for (const format of exportFormats(cur.job)) {
        const exported = cur.exports.get(`${c.step}|${c.path}|${format}`);
        action.append(exported ? exportedPath(exported, format) : exportButton(c, format));
      }
      tr.append(action);
      return tr;
    }),
  );
  $("ckpt-empty").hidden = ckpts.length > 0;
}

// hf: a Hugging Face directory (a LoRA run's adapters merged in); peft: a LoRA run's adapter
function exportFormats(job) {
  const model = job && job.spec && job.spec.model;
  return model && model.lora ? ["hf", "peft"] : ["hf"];
}

const EXPORT_LABELS = { hf: "Export", peft: "Export adapter" };

function exportTestId(what, format) {
  return format === "hf" ? what : `${what}-${format}`;
}

function exportedPath(path, format) {
  return el("span", { class: "mono path", title: path, "data-testid": exportTestId("exported", format) }, path);
}

function exportButton(c, format) {
  // the checkpoint exported into the job's exports/ (POST .../export?format=)
  const label = EXPORT_LABELS[format];
  const button = el("button", { type: "button", class: "small", "data-testid": exportTestId("export", format) }, label);
  const job = cur;
  button.addEventListener("click", async () => {
    button.disabled = true;
    button.textContent = "Exporting…";
    try {
      const url = `/v1/jobs/${encodeURIComponent(job.id)}/checkpoints/${c.step}/export?format=${format}`;
      const body = await apiSend("POST", url);
      job.exports.set(`${c.step}|${c.path}|${format}`, body.path);
      button.replaceWith(exportedPath(body.path, format));
    } catch (e) {
      button.disabled = false;
      button.textContent = label;
      setConn(`Cannot export step ${c.step}: ${e.message}`, true);
    }
  });
  return button;
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
  renderMemory(cur.sorted || []);
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

// What the stream needs of the page (stream.js): whether its job is still the selected one, and
// the redraws its events call for.
const streamView = {
  isCurrent: (c) => c === cur,
  scheduleDraw,
  renderState,
  renderHistory,
  renderCheckpoints,
  loadJob,
};

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
  openStream(cur, streamView);
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

saveToken(token);
Promise.all([loadJobStates(), loadMetricRegistry()])
  .catch((err) => setConn(`Cannot load the job states or the metric registry: ${err.message}`, true))
  .finally(() => {
    onHash(false);
    refreshJobs();
  });
