// Small canvas charts for the dashboard: lines/dots over numeric axes, and bars. No dependencies, so
// the page works offline and needs no build step. Each chart records how many points it drew in
// canvas.dataset.points (the browser test reads it).
"use strict";

const PrimeCharts = (() => {
  // No red: red marks failures (aborted attempts).
  const PALETTE = ["#0969da", "#1f883d", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#4d2d00", "#57606a"];
  const PAD = { left: 56, right: 12, top: 12, bottom: 36 };

  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) { hi = lo + 1; }
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
    return ticks;
  }

  function formatNumber(v) {
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a === 0) return "0";
    if (a < 0.01) return v.toExponential(0);
    return String(+v.toPrecision(3));
  }

  function frame(canvas, xs, ys, opts) {
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    let xlo = Math.min(...xs), xhi = Math.max(...xs), ylo = Math.min(...ys), yhi = Math.max(...ys);
    if (opts.yZero) ylo = Math.min(0, ylo);
    if (xlo === xhi) { xlo -= 1; xhi += 1; }
    if (ylo === yhi) { ylo -= 1; yhi += 1; }
    const ypad = (yhi - ylo) * 0.05;
    ylo = opts.yZero && ylo >= 0 ? ylo : ylo - ypad; yhi += ypad;
    const px = x => PAD.left + (x - xlo) / (xhi - xlo) * (w - PAD.left - PAD.right);
    const py = y => h - PAD.bottom - (y - ylo) / (yhi - ylo) * (h - PAD.top - PAD.bottom);
    ctx.strokeStyle = "#dde2e8"; ctx.fillStyle = "#6b7380"; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (const t of niceTicks(ylo, yhi, 5)) {
      ctx.beginPath(); ctx.moveTo(PAD.left, py(t)); ctx.lineTo(w - PAD.right, py(t)); ctx.stroke();
      ctx.fillText(formatNumber(t), PAD.left - 6, py(t));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const t of niceTicks(xlo, xhi, 6)) ctx.fillText(formatNumber(t), px(t), h - PAD.bottom + 4);
    if (opts.xLabel) ctx.fillText(opts.xLabel, (PAD.left + w - PAD.right) / 2, h - 14);
    return { ctx, px, py };
  }

  function empty(canvas, text) {
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#6b7380"; ctx.font = "13px system-ui, sans-serif"; ctx.textAlign = "center";
    ctx.fillText(text, canvas.width / 2, canvas.height / 2);
    canvas.dataset.points = "0";
  }

  function legend(ctx, canvas, names) {
    ctx.textAlign = "left"; ctx.textBaseline = "middle"; ctx.font = "11px system-ui, sans-serif";
    let x = PAD.left + 8;
    names.forEach(([name, color]) => {
      ctx.fillStyle = color; ctx.fillRect(x, PAD.top + 4, 10, 3);
      ctx.fillStyle = "#1d2430"; ctx.fillText(name, x + 14, PAD.top + 6);
      x += 22 + ctx.measureText(name).width;
    });
  }

  // series: [{name, points: [[x, y]], dots: bool, color?}]
  function lines(canvas, series, opts = {}) {
    const drawn = series.filter(s => s.points.length);
    const all = drawn.flatMap(s => s.points);
    if (!all.length) return empty(canvas, opts.emptyText || "waiting for data…");
    const { ctx, px, py } = frame(canvas, all.map(p => p[0]), all.map(p => p[1]), opts);
    const names = [];
    drawn.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 1.5;
      if (s.dots) {
        for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(px(x), py(y), 3.5, 0, 2 * Math.PI); ctx.fill(); }
      } else {
        ctx.beginPath();
        s.points.forEach(([x, y], j) => {
          if (j && s.steps) ctx.lineTo(px(x), py(s.points[j - 1][1]));
          j ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y));
        });
        ctx.stroke();
      }
      if (s.name) names.push([s.name, color]);
    });
    legend(ctx, canvas, names);
    canvas.dataset.points = String(all.length);
  }

  // bars: [{x, y, color?}]
  function bars(canvas, items, opts = {}) {
    if (!items.length) return empty(canvas, opts.emptyText || "waiting for data…");
    const xs = items.map(b => b.x);
    const { ctx, px, py } = frame(canvas, [Math.min(...xs) - 0.5, Math.max(...xs) + 0.5], items.map(b => b.y),
                                  { ...opts, yZero: true });
    const width = Math.max(1, (px(1) - px(0)) * 0.7);
    for (const b of items) {
      ctx.fillStyle = b.color || PALETTE[0];
      ctx.fillRect(px(b.x) - width / 2, py(b.y), width, py(0) - py(b.y));
    }
    if (opts.legend) legend(ctx, canvas, opts.legend);
    canvas.dataset.points = String(items.length);
  }

  // One lane per node; a filled cell at each round the node took part in, a red one where an
  // attempt with it aborted. rows: [{name, applied: [x], aborted: [x]}]
  function lanes(canvas, rows, opts = {}) {
    const xs = rows.flatMap(r => r.applied.concat(r.aborted));
    if (!xs.length) return empty(canvas, opts.emptyText || "waiting for the first round…");
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    const xlo = Math.min(...xs) - 0.5, xhi = Math.max(...xs) + 0.5;
    const px = x => PAD.left + (x - xlo) / (xhi - xlo) * (w - PAD.left - PAD.right);
    const laneH = Math.min(28, (h - PAD.top - PAD.bottom) / rows.length);
    const cell = Math.max(1, px(1) - px(0));
    rows.forEach((r, i) => {
      const y = PAD.top + i * laneH;
      ctx.fillStyle = "#1d2430"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(r.name, PAD.left - 6, y + laneH / 2);
      ctx.fillStyle = PALETTE[i % PALETTE.length];
      for (const x of r.applied) ctx.fillRect(px(x) - cell / 2, y + 3, Math.max(1, cell - 0.5), laneH - 6);
      ctx.fillStyle = "#cf222e";
      for (const x of r.aborted) ctx.fillRect(px(x) - cell / 2, y + laneH / 2 - 2, Math.max(1, cell - 0.5), 4);
    });
    ctx.fillStyle = "#6b7380"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    const bottom = PAD.top + rows.length * laneH;
    for (const t of niceTicks(xlo, xhi, 6)) if (Number.isInteger(t)) ctx.fillText(formatNumber(t), px(t), bottom + 4);
    if (opts.xLabel) ctx.fillText(opts.xLabel, (PAD.left + w - PAD.right) / 2, bottom + 18);
    canvas.dataset.points = String(xs.length);
  }

  return { lines, bars, lanes, formatNumber, PALETTE };
})();
