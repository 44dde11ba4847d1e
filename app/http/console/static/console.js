// The console's own script: copy buttons and the charts. No inline script is
// allowed by the pages' Content-Security-Policy, so everything lives here.
"use strict";

const PALETTE = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#65a30d", "#db2777"];
const NANO_USD_PER_USD = 1e9;

function usdLabel(nanoUsd, decimals = 2, decimalsMax = decimals) {
  // Axis and legend labels only: every figure shown as text comes exact from the server.
  return "$" + (nanoUsd / NANO_USD_PER_USD).toLocaleString("en-US", {minimumFractionDigits: decimals, maximumFractionDigits: decimalsMax});
}

function axisDecimals(ticks) {
  // Cents, or as many decimals as tell two ticks apart (down to the nano-dollar) when amounts are small.
  const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : NANO_USD_PER_USD;
  return step > 0 ? Math.min(9, Math.max(2, Math.ceil(-Math.log10(step / NANO_USD_PER_USD)))) : 2;
}

function setUpCopyButtons(root) {
  root.querySelectorAll("button[data-copy]").forEach((button) => {
    button.addEventListener("click", async () => {
      const text = document.getElementById(button.dataset.copy).textContent.trim();
      try {
        await navigator.clipboard.writeText(text);
        button.textContent = "Copied";
      } catch (err) {
        const range = document.createRange();  // no clipboard access: select it for Ctrl+C
        range.selectNodeContents(document.getElementById(button.dataset.copy));
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        button.textContent = "Selected: press Ctrl+C";
      }
    });
  });
}

function stackedBars(area, chart) {
  const days = chart.days.map((day) => Date.parse(day + "T00:00:00Z") / 1000);
  const raw = chart.series.map((s) => s.values);
  const stacked = [];
  let running = days.map(() => 0);
  for (const values of raw) {
    running = running.map((sum, i) => sum + values[i]);
    stacked.push(running);
  }
  // Drawn from the tallest down, so each lower segment covers the one above it.
  const order = stacked.map((_, i) => i).reverse();
  const bars = uPlot.paths.bars({size: [0.7, 40]});
  const series = [{value: (u, ts) => ts == null ? "—" : new Date(ts * 1000).toISOString().slice(0, 10)}].concat(order.map((i) => ({
    label: chart.series[i].label,
    stroke: PALETTE[i % PALETTE.length],
    fill: PALETTE[i % PALETTE.length],
    paths: bars,
    points: {show: false},
    value: (u, v, si, idx) => idx == null ? "—" : usdLabel(raw[i][idx], 2, 9),
  })));
  const width = () => Math.max(280, area.clientWidth);
  const plot = new uPlot({
    width: width(), height: 240, series: series,
    scales: {x: {time: true}},
    axes: [{}, {values: (u, ticks) => ticks.map((tick) => usdLabel(tick, axisDecimals(ticks))), size: 90}],
  }, [days].concat(order.map((i) => stacked[i])), area);
  window.addEventListener("resize", () => plot.setSize({width: width(), height: 240}));
}

function keepNewestOfEachRow(rows) {
  // A request shown again (its charge reversed) arrives at the top: the older copy goes.
  const seen = new Set();
  rows.querySelectorAll("tr[data-generation]").forEach((row) => {
    if (seen.has(row.dataset.generation)) row.remove();
    else seen.add(row.dataset.generation);
  });
  const empty = document.getElementById("activity-empty");
  if (empty && seen.size) empty.remove();
}

function setUpCharts(root) {
  if (typeof uPlot === "undefined") return;
  root.querySelectorAll("script[data-chart]").forEach((block) => {
    const area = document.getElementById(block.dataset.chart);
    const chart = JSON.parse(block.textContent);
    if (!chart.series.length) {
      area.textContent = "Nothing in these 30 days yet.";
      return;
    }
    stackedBars(area, chart);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  setUpCopyButtons(document);
  setUpCharts(document);
  document.body.addEventListener("htmx:afterSwap", (event) => {
    setUpCopyButtons(event.target);
    if (event.target.id === "activity-rows") keepNewestOfEachRow(event.target);
  });
  // Forms that htmx sends carry the page's CSRF token like any other form.
  document.body.addEventListener("htmx:configRequest", (event) => {
    const token = document.querySelector("input[name=csrf_token]");
    if (token) event.detail.headers["X-CSRF-Token"] = token.value;
  });
});
