// The selected job's live event stream (Server-Sent Events): metrics, states, checkpoints and log
// lines as they happen, replayed from the start on reconnect (events already seen are skipped by
// their id), retried with back-off when the server refuses it. ``view`` is the page's side:
// isCurrent(c) (whether ``c`` is still the selected job), scheduleDraw, renderState,
// renderHistory, renderCheckpoints, loadJob.

import { TERMINAL, authNeeded, token } from "./api.js";
import { $, isNum } from "./format.js";

const MAX_LOG_LINES = 200; // live log lines kept (the full log is paged from the API)
const MAX_RETRY_MS = 30000;

export function setStreamStatus(text, kind = "") {
  const node = $("stream-status");
  node.textContent = text;
  node.dataset.kind = kind;
}

export function closeStream(c) {
  if (!c) return;
  if (c.es) {
    c.es.close();
    c.es = null;
  }
  clearTimeout(c.retryTimer);
  c.retryTimer = null;
}

// Ignore events already seen (a fresh EventSource replays the history from the start).
function accept(c, e, view) {
  if (!view.isCurrent(c)) return false;
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

// What each kind of event does to the job's live data ``c``; ``view`` redraws the page.
const handlers = {
  metrics(c, rec, view) {
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
    view.scheduleDraw();
  },
  state(c, d, view) {
    c.liveJob = { ...c.liveJob, state: d.state, message: d.message, restarts: d.restarts };
    c.history.push(d);
    if (TERMINAL.has(d.state)) {
      c.terminal = true;
      closeStream(c);
      setStreamStatus("stream ended", "ended");
    }
    view.renderState();
    view.renderHistory();
    // fetch what the stream does not carry (restart reasons, final step, checkpoint times)
    if (TERMINAL.has(d.state) || d.state === "RESTARTING") view.loadJob();
    if (TERMINAL.has(d.state)) setTimeout(() => view.isCurrent(c) && view.loadJob(), 2000); // late writes
  },
  checkpoint(c, d, view) {
    if (!isNum(d.step)) return;
    const key = `${d.step}|${d.path}`;
    const { kept, ...ckpt } = d;
    c.checkpoints.set(key, { ...c.checkpoints.get(key), ...ckpt });
    if (Array.isArray(kept)) {
      // checkpoint.keep pruned the older ones: show only what is on storage
      for (const [k, v] of c.checkpoints) if (!kept.includes(v.step)) c.checkpoints.delete(k);
    }
    view.renderCheckpoints();
  },
  log(c, d, view) {
    c.logs.push(d);
    if (c.logs.length > MAX_LOG_LINES) c.logs.splice(0, c.logs.length - MAX_LOG_LINES);
    c.logSeq = (c.logSeq || 0) + 1;
    view.scheduleDraw();
  },
};

export function openStream(c, view) {
  if (!c || !view.isCurrent(c) || c.terminal || c.es) return;
  let url = `/v1/jobs/${encodeURIComponent(c.id)}/events`;
  if (token) url += `?token=${encodeURIComponent(token)}`;
  const es = new EventSource(url);
  c.es = es;
  setStreamStatus("connecting…", "wait");
  es.onopen = () => {
    if (!view.isCurrent(c)) return;
    c.retryMs = 1000;
    setStreamStatus("live", "live");
  };
  for (const [kind, fn] of Object.entries(handlers)) {
    es.addEventListener(kind, (e) => {
      if (!accept(c, e, view)) return;
      const data = parse(e);
      if (data && typeof data === "object") fn(c, data, view);
    });
  }
  es.onerror = () => {
    if (!view.isCurrent(c) || c.terminal || c.es !== es) return;
    if (es.readyState !== EventSource.CLOSED) {
      setStreamStatus("reconnecting…", "wait"); // the browser retries with Last-Event-ID
      return;
    }
    // the server refused the stream (401, 404, 5xx): find out why, then retry with back-off
    es.close();
    c.es = null;
    setStreamStatus("disconnected", "bad");
    view.loadJob().then(() => {
      if (!view.isCurrent(c) || c.terminal || authNeeded) return;
      c.retryTimer = setTimeout(() => openStream(c, view), c.retryMs);
      c.retryMs = Math.min(c.retryMs * 2, MAX_RETRY_MS);
    });
  };
}
