// The pool dashboard (/ui/pool): polls the data endpoint every data-poll seconds and redraws
// the tables and charts in place. Tables are built with textContent (host and tenant names are
// the operator's, but nothing from the server is parsed as markup). Charts: the vendored
// Chart.js (app/static/vendor/chartjs). window.termpoolPool exposes the charts and the number
// of polls drawn, for the browser test.
"use strict";
(function () {
  const root = document.getElementById("pool");
  if (!root) {
    return;
  }
  const state = { polls: 0, charts: {} };
  const queues = document.getElementById("queues");
  // the queue kinds, in the order of the table's header (after its host column)
  const KINDS = queues ? Array.from(queues.tHead.rows[0].cells).slice(1).map(function (th) { return th.textContent; }) : [];
  window.termpoolPool = state;

  function cell(row, text, cls) {
    const td = row.insertCell();
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) {
      td.className = cls;
    }
    return td;
  }

  function badge(row, text) {
    const span = document.createElement("span");
    span.className = "badge " + text;
    span.textContent = text;
    row.insertCell().appendChild(span);
  }

  function fill(id, rows, draw, empty) {
    const table = document.getElementById(id);
    if (!table) {
      return;
    }
    const body = document.createElement("tbody");
    rows.forEach(function (item) {
      const row = body.insertRow();
      row.dataset.key = item.host || item.name || "";
      draw(row, item);
    });
    if (!rows.length) {
      const td = cell(body.insertRow(), empty, "empty");
      td.colSpan = table.tHead.rows[0].cells.length;
    }
    table.replaceChild(body, table.tBodies[0]);
  }

  function gib(bytes) {
    return (bytes / 1073741824).toFixed(1) + " GiB";
  }

  function drawHost(row, h) {
    cell(row, h.host);
    badge(row, h.state);
    cell(row, h.capacity !== undefined ? h.live_runs + " / " + h.capacity : h.live_runs, "num runs");
    if (root.dataset.scope) {
      return;
    }
    const nets = h.networks || {};
    cell(row, nets.total !== undefined ? nets.in_use + " / " + nets.total : "", "num");
    const spaces = (h.disk && h.disk.spaces) || [];
    cell(row, spaces.map(function (s) { return s.root + " " + gib(s.free); }).join(", ") + (h.disk && h.disk.low ? " (low)" : ""));
    cell(row, h.live_restore === null || h.live_restore === undefined ? "not reported" : (h.live_restore ? "on" : "off"));
  }

  function drawTenant(row, t) {
    cell(row, t.name);
    cell(row, t.live_runs, "num runs");
    cell(row, t.max_runs === null ? "no limit" : t.max_runs, "num");
    cell(row, t.reserved_runs, "num");
    cell(row, t.priority);
  }

  function chart(id, config) {
    if (!state.charts[id]) {
      const canvas = document.getElementById(id);
      state.charts[id] = new window.Chart(canvas, config);
    }
    return state.charts[id];
  }

  function barConfig(yType, title) {
    return {
      type: "bar",
      data: { labels: [], datasets: [] },
      options: {
        animation: false,
        maintainAspectRatio: false,
        scales: { y: { type: yType, beginAtZero: true, title: { display: true, text: title } } },
      },
    };
  }

  function drawCharts(data) {
    const ops = Object.keys(data.latency);
    const latency = chart("latency-chart", barConfig("logarithmic", "milliseconds"));
    latency.data.labels = ops;
    latency.data.datasets = [
      { label: "p50", backgroundColor: "#1f5fbf", data: ops.map(function (op) { return data.latency[op].p50_ms; }) },
      { label: "p95", backgroundColor: "#e0902b", data: ops.map(function (op) { return data.latency[op].p95_ms; }) },
    ];
    latency.update("none");
    const codes = Array.from(new Set(Object.keys(data.errors).concat(Object.keys(data.job_failures)))).sort();
    const failures = chart("failures-chart", barConfig("linear", "count"));
    failures.data.labels = codes;
    failures.data.datasets = [
      { label: "error replies", backgroundColor: "#b4262b", data: codes.map(function (c) { return data.errors[c] || 0; }) },
      { label: "failed jobs", backgroundColor: "#6a7380", data: codes.map(function (c) { return data.job_failures[c] || 0; }) },
    ];
    failures.update("none");
  }

  function draw(data) {
    fill("hosts", data.hosts, drawHost, "no worker host has reported");
    fill("tenants", data.tenants, drawTenant, "no tenants file: every request is the operator's");
    fill("queues", data.queues, function (row, q) {
      cell(row, q.host);
      KINDS.forEach(function (kind) { cell(row, q[kind], "num " + kind); });
    }, "no queues");
    fill("builds", data.builds, function (row, b) {
      cell(row, b.host || "(pool-wide)");
      cell(row, b.image);
    }, "none");
    drawCharts(data);
    state.polls += 1;
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString() + " (every " + root.dataset.poll + " s)";
  }

  async function poll() {
    try {
      const reply = await fetch(root.dataset.source, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (reply.status === 401) {
        document.getElementById("updated").textContent = "signed out: reload to sign in again";
        return;
      }
      if (reply.ok) {
        draw(await reply.json());
      }
    } catch (err) {
      // the facade restarting: try again at the next poll
    }
    setTimeout(poll, Number(root.dataset.poll) * 1000);
  }

  poll();
})();
