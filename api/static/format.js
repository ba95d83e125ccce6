// Formatting and DOM helpers of the web page: numbers, rates, times, bytes, a state badge.

export const $ = (id) => document.getElementById(id);
export const el = (tag, props = {}, text) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  if (text !== undefined) node.textContent = text;
  return node;
};

export const isNum = (v) => typeof v === "number" && Number.isFinite(v);

export function fmtNum(v, digits = 4) {
  if (!isNum(v)) return "—";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(digits)));
}

export function fmtRate(v) {
  if (!isNum(v)) return "—";
  const a = Math.abs(v);
  if (a >= 1e9) return `${(v / 1e9).toFixed(2)}G`;
  if (a >= 1e6) return `${(v / 1e6).toFixed(2)}M`;
  if (a >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
  return fmtNum(v, 3);
}

export function fmtLr(v) {
  if (!isNum(v)) return "—";
  return v !== 0 && Math.abs(v) < 1e-2 ? v.toExponential(2) : fmtNum(v);
}

export function fmtTime(t) {
  if (!isNum(t)) return "—";
  const d = new Date(t * 1000);
  const opts = { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" };
  if (d.getFullYear() !== new Date().getFullYear()) opts.year = "numeric";
  return d.toLocaleString(undefined, opts);
}

export function fmtClock(t) {
  if (!isNum(t)) return "";
  return new Date(t * 1000).toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function stepText(step, total) {
  const s = isNum(step) ? step : 0;
  return isNum(total) && total > 0 ? `${s} / ${total}` : String(s);
}

export function setBadge(node, state) {
  const s = state || "UNKNOWN";
  node.textContent = s;
  node.className = `badge badge-${s.toLowerCase()}`;
  node.dataset.state = s;
}

export function fmtBytes(n) {
  if (!isNum(n)) return "";
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}
