// Live charts: a line per series on a canvas, and the rates and means taken between two snapshots.
import { fmt, total } from "./util.js";

const HISTORY = 90; // points kept per chart (3 minutes at the refresh interval)

export const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04"];

export function push(store, name, value) {
  const s = (store[name] = store[name] || []);
  s.push(value);
  if (s.length > HISTORY) s.shift();
}

export function draw(canvasId, lines) {
  const c = document.getElementById(canvasId);
  if (!c) return;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const values = lines.flatMap((l) => l.points.filter((v) => v !== null));
  const top = Math.max(1e-9, ...values);
  g.font = "11px sans-serif";
  g.fillStyle = "#6b7280";
  g.fillText(fmt(top, 2), 4, 12);
  lines.forEach((line, i) => {
    g.strokeStyle = COLOURS[i % COLOURS.length];
    g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    line.points.forEach((v, x) => {
      if (v === null) return;
      const px = (x / (HISTORY - 1)) * (c.width - 8) + 4;
      const py = c.height - 4 - (v / top) * (c.height - 20);
      if (started) g.lineTo(px, py);
      else g.moveTo(px, py);
      started = true;
    });
    g.stroke();
    if (line.label) {
      g.fillStyle = COLOURS[i % COLOURS.length];
      g.fillText(line.label, 60 + i * 90, 12);
    }
  });
}

// a mean over the interval between two snapshots: (sum now - sum then) / (count now - count then)
export function meanOver(now, then, name, scale) {
  const ds = total(now.metrics, name + "_sum") - total(then.metrics, name + "_sum");
  const dc = total(now.metrics, name + "_count") - total(then.metrics, name + "_count");
  return dc > 0 ? (ds / dc) * scale : null;
}

export function rateOver(now, then, name, where) {
  const dt = now.time - then.time;
  const a = total(now.metrics, name, where);
  const b = total(then.metrics, name, where);
  return dt > 0 && a !== null ? Math.max(0, a - (b || 0)) / dt : null;
}
