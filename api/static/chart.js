// A line chart drawn on <canvas>: nice axis ticks, hover readout, other runs as overlays. No dependencies.

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

export class LineChart {
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
