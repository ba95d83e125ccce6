// The expert-load heatmap of a mixture-of-experts job, drawn on <canvas>: for one layer (picked
// in the select; by default the one most out of balance at the last step), a column per step and
// a row per expert, coloured by the expert's tokens over the layer's mean that step (blue under,
// white at the mean, red over). Imbalance reads faster from a picture than from numbers.

function color(ratio) {
  // 0 -> blue, 1 -> white, >= 2 -> red (a log-like clamp keeps 4x and 8x distinguishable)
  const t = Math.max(-1, Math.min(1, Math.log2(Math.max(ratio, 1e-3)) / 2));
  const shade = (v) => Math.round(255 * (1 - Math.abs(v)));
  return t >= 0 ? `rgb(255,${shade(t)},${shade(t)})` : `rgb(${shade(t)},${shade(t)},255)`;
}

function imbalance(loads) {
  const mean = loads.reduce((a, b) => a + b, 0) / loads.length;
  return mean > 0 ? Math.max(...loads) / mean : 1;
}

export class ExpertHeatmap {
  constructor(figure, canvas, select, readout) {
    Object.assign(this, { figure, canvas, select, readout });
    this.recs = [];
    this.layer = null; // the user's pick; null: the worst layer at the last step
    select.addEventListener("change", () => {
      this.layer = select.value || null;
      this.draw();
    });
    if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
  }

  // recs: the job's metric records by step; those of a MoE job carry expert_load {layer: [tokens]}
  setData(recs) {
    this.recs = recs.filter((r) => r.expert_load && typeof r.expert_load === "object");
    this.figure.hidden = this.recs.length === 0;
    this.canvas.dataset.steps = String(this.recs.length);
  }

  layers() {
    const last = this.recs[this.recs.length - 1];
    return last ? Object.keys(last.expert_load).sort((a, b) => Number(a) - Number(b)) : [];
  }

  worstLayer() {
    const last = this.recs[this.recs.length - 1].expert_load;
    return this.layers().reduce((best, l) => (imbalance(last[l]) > imbalance(last[best]) ? l : best));
  }

  renderSelect(layers) {
    const have = [...this.select.options].map((o) => o.value).join(",");
    if (have === ["", ...layers].join(",")) return;
    this.select.replaceChildren(new Option("most imbalanced", ""), ...layers.map((l) => new Option(`layer ${l}`, l)));
    this.select.value = this.layer ?? "";
  }

  draw() {
    if (this.figure.hidden) return;
    const layers = this.layers();
    this.renderSelect(layers);
    const layer = layers.includes(this.layer) ? this.layer : this.worstLayer();
    const rows = this.recs.map((r) => r.expert_load[layer] || []);
    const experts = Math.max(...rows.map((r) => r.length));
    const rect = this.canvas.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.max(1, Math.round(rect.width * dpr));
    this.canvas.height = Math.max(1, Math.round(rect.height * dpr));
    const ctx = this.canvas.getContext("2d");
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    const w = this.canvas.width / rows.length;
    const h = this.canvas.height / experts;
    rows.forEach((loads, i) => {
      const mean = loads.reduce((a, b) => a + b, 0) / loads.length || 1;
      loads.forEach((n, e) => {
        ctx.fillStyle = color(n / mean);
        ctx.fillRect(Math.floor(i * w), Math.floor(e * h), Math.ceil(w), Math.ceil(h));
      });
    });
    const last = this.recs[this.recs.length - 1];
    const worst = imbalance(last.expert_load[layer]);
    this.canvas.dataset.layer = layer;
    this.canvas.dataset.experts = String(experts);
    const text = `layer ${layer}: ${experts} experts, busiest ${worst.toFixed(2)}x the mean at step ${last.step}`;
    this.readout.textContent = text;
    this.canvas.setAttribute("aria-label", `Expert load heatmap (x: step, y: expert), ${text}`);
  }
}
