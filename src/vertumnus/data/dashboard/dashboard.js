/* Vertumnus: the pool over time, drawn with plotly.js.
 *
 * The data is a timeline (policy/timeline.py): samples (one per period: workers per
 * degree, rate, TTFT percentiles against the SLO, attainment, hit rate, queues, copies)
 * and events (one per reshape: its rule, inputs and the candidates weighed), plus the
 * workers as they are now. Three entry points:
 *
 *   Vertumnus.live(root, {url, periodMs})  the server's /dashboard: polls url
 *                                          (?since=T after the first answer)
 *   Vertumnus.report(root, data)           a simulation's report.html (data embedded)
 *   Vertumnus.compare(root, data)          an experiment's variants side by side
 *
 * window.vertumnusStats counts renders and their times (the browser test reads it).
 */
(function () {
  "use strict";

  const COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#72B7B2", "#EECA3B", "#FF9DA6", "#9D755D"];
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };
  const MAX_EVENTS = 1000;
  const stats = { renders: 0, lastRenderMs: 0, maxRenderMs: 0, polls: 0, errors: 0, samples: 0 };
  window.vertumnusStats = stats;

  // -- small helpers -----------------------------------------------------------------

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (typeof x !== "number") return String(x);
    if (Math.abs(x) < 5e-7) x = 0; // no "-0.000"
    if (Number.isInteger(x)) return x.toLocaleString("en-US");
    const d = digits === undefined ? (Math.abs(x) >= 100 ? 1 : Math.abs(x) >= 1 ? 3 : 4) : digits;
    return x.toFixed(d);
  }

  function spans(ids) { // [0, 1, 2, 3, 8] -> "0–3, 8"
    const out = [];
    for (const id of ids || []) {
      const last = out[out.length - 1];
      if (last && id === last[1] + 1) last[1] = id;
      else out.push([id, id]);
    }
    return out.map(([a, b]) => (a === b ? String(a) : `${a}–${b}`)).join(", ");
  }

  function pct(x) {
    return x === null || x === undefined ? null : 100 * x;
  }

  function xOf(view, t) {
    return view.t0 === null ? t : new Date((view.t0 + t) * 1000);
  }

  function axis(view) {
    return view.t0 === null
      ? { title: { text: view.timeTitle || "time (s)" }, zeroline: false }
      : { type: "date" };
  }

  function layout(view, extra) {
    return Object.assign(
      {
        margin: { l: 56, r: 56, t: 24, b: 36 },
        legend: { orientation: "h", yanchor: "bottom", y: 1.02, x: 0, bgcolor: "rgba(0,0,0,0)" },
        xaxis: axis(view),
        hovermode: "x unified",
        uirevision: "keep",
        paper_bgcolor: "#fff",
        plot_bgcolor: "#fff",
      },
      extra
    );
  }

  function line(view, samples, key, name, opts) {
    const scale = (opts && opts.scale) || ((v) => v);
    return Object.assign(
      {
        type: "scatter",
        // markers only where few samples: thousands of SVG markers would slow redraws
        mode: samples.length <= 120 ? "lines+markers" : "lines",
        marker: { size: 4 },
        name: name,
        x: samples.map((s) => xOf(view, s.t)),
        y: samples.map((s) => (s[key] === null || s[key] === undefined ? null : scale(s[key]))),
        connectgaps: false,
      },
      opts && opts.trace
    );
  }

  function degreesOf(samples) {
    const seen = new Set();
    for (const s of samples) for (const d of Object.keys(s.workers || {})) seen.add(d);
    return [...seen].sort((a, b) => Number(a) - Number(b));
  }

  function sampleAt(samples, t) {
    // the last sample at or before t (the composition the decision was taken on)
    let lo = 0, hi = samples.length - 1;
    if (hi < 0) return null;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (samples[mid].t <= t) lo = mid;
      else hi = mid - 1;
    }
    return samples[lo];
  }

  function describe(e) {
    const inp = e.inputs || {};
    const parts = [`<b>${e.kind}</b> (${e.rule})`];
    for (const op of e.ops || []) parts.push(`workers ${(op.sources || []).join(", ")} → CP${op.degree}`);
    if (inp.demand_s !== undefined) parts.push(`demand ${fmt(inp.demand_s)} s, capacity ${fmt(inp.capacity_s)} s`);
    if (inp.long_fraction !== undefined) parts.push(`long fraction ${fmt(inp.long_fraction, 3)}`);
    for (const c of (e.candidates || []).slice(0, 8)) {
      let text;
      if (c && c.composition !== undefined) { // the what-if controller's candidate
        const mark = c.composition === inp.chosen ? "→ " : "· ";
        text = `${mark}${c.composition} (${c.move || ""}): next ${fmt(c.next_s)} s, steady ${fmt(c.steady_s)} s, score ${fmt(c.score_s)} s`;
      } else {
        const raw = JSON.stringify(c);
        text = "· " + (raw.length > 140 ? raw.slice(0, 137) + "..." : raw);
      }
      parts.push(text);
    }
    return parts.join("<br>");
  }

  // -- the charts ----------------------------------------------------------------------

  function workersAxis(samples) { // whole workers: a tick every 1, 2, 5, ... of them
    let most = 1;
    for (const s of samples) most = Math.max(most, Object.values(s.workers || {}).reduce((a, b) => a + b, 0) + (s.not_active || 0));
    const step = [1, 2, 5, 10, 20, 50, 100, 200, 500].find((d) => most / d <= 8) || 1000;
    return { title: { text: "workers" }, rangemode: "tozero", dtick: step, tickformat: "d" };
  }

  function compositionTraces(view, samples, events) {
    const traces = degreesOf(samples).map((d, i) => ({
      type: "scatter",
      mode: "lines",
      name: `CP${d}`,
      stackgroup: "workers",
      line: { shape: "hv", width: 0.5, color: COLORS[i % COLORS.length] },
      x: samples.map((s) => xOf(view, s.t)),
      y: samples.map((s) => (s.workers || {})[d] || 0),
    }));
    traces.push({
      type: "scatter",
      mode: "lines",
      name: "reshaping",
      stackgroup: "workers",
      line: { shape: "hv", width: 0.5, color: "#bbb" },
      x: samples.map((s) => xOf(view, s.t)),
      y: samples.map((s) => s.not_active || 0),
    });
    for (const [kind, symbol, color] of [["split", "triangle-up", "#cf222e"], ["merge", "triangle-down", "#0969da"], ["operator", "diamond", "#8250df"]]) {
      const mine = events.filter((e) => (kind === "operator" ? e.rule === "operator" : e.kind === kind && e.rule !== "operator"));
      if (!mine.length) continue;
      traces.push({
        type: "scatter",
        mode: "markers",
        name: kind === "operator" ? "operator reshape" : kind,
        x: mine.map((e) => xOf(view, e.t)),
        y: mine.map((e) => {
          const s = sampleAt(samples, e.t);
          if (!s) return 0;
          return Object.values(s.workers || {}).reduce((a, b) => a + b, 0) + (s.not_active || 0) + 0.15;
        }),
        text: mine.map(describe),
        hovertemplate: "%{text}<extra></extra>",
        marker: { symbol: symbol, size: 13, color: color, line: { width: 1, color: "#fff" } },
      });
    }
    return traces;
  }

  const CHARTS = [
    {
      id: "composition",
      title: "Composition: workers per degree (▲ split, ▼ merge: hover for the rule, inputs and candidates)",
      draw: (view) => [compositionTraces(view, view.samples, view.events), layout(view, { yaxis: workersAxis(view.samples) })],
    },
    {
      id: "ttft",
      title: "TTFT of the requests answered, against the SLO",
      windowed: true,
      draw: (view) => {
        const s = view.samples;
        return [
          [
            line(view, s, "ttft_p50_s", "P50"),
            line(view, s, "ttft_p90_s", "P90"),
            line(view, s, "ttft_p99_s", "P99"),
            line(view, s, "tau_p50_s", "SLO τ (median)", { trace: { line: { dash: "dash", color: "#cf222e" } } }),
          ],
          layout(view, { yaxis: { title: { text: "seconds" }, type: view.logTtft ? "log" : "linear", rangemode: "tozero" } }),
        ];
      },
    },
    {
      id: "rate",
      title: "Request rate and token SLO attainment",
      windowed: true,
      draw: (view) => {
        const s = view.samples;
        return [
          [
            line(view, s, "rate", "requests / s"),
            line(view, s, "slo_attainment", "SLO attainment (%)", { scale: pct, trace: { yaxis: "y2" } }),
          ],
          layout(view, {
            yaxis: { title: { text: "requests / s" }, rangemode: "tozero" },
            yaxis2: { title: { text: "% of tokens" }, overlaying: "y", side: "right", range: [0, 105] },
          }),
        ];
      },
    },
    {
      id: "cache",
      title: "Prefix cache: token hit rate, replications, reclamations, copies in flight",
      windowed: true,
      draw: (view) => {
        const s = view.samples;
        return [
          [
            line(view, s, "hit_rate", "hit rate (%)", { scale: pct }),
            line(view, s, "replications", "replications (total)", { trace: { yaxis: "y2" } }),
            line(view, s, "reclamations", "reclamations (total)", { trace: { yaxis: "y2" } }),
            line(view, s, "copies_in_flight", "copies in flight", { trace: { yaxis: "y2", line: { dash: "dot" } } }),
          ],
          layout(view, {
            yaxis: { title: { text: "% of tokens" }, range: [0, 105] },
            yaxis2: { title: { text: "count" }, overlaying: "y", side: "right", rangemode: "tozero" },
          }),
        ];
      },
    },
    {
      id: "queue",
      title: "Queues: requests waiting and predicted work outstanding",
      draw: (view) => {
        const s = view.samples;
        return [
          [line(view, s, "queued", "queued"), line(view, s, "outstanding_s", "outstanding work (s)", { trace: { yaxis: "y2" } })],
          layout(view, {
            yaxis: { title: { text: "requests" }, rangemode: "tozero" },
            yaxis2: { title: { text: "seconds" }, overlaying: "y", side: "right", rangemode: "tozero" },
          }),
        ];
      },
    },
  ];

  // -- tables --------------------------------------------------------------------------

  function table(columns, rows, cls) {
    const head = el("tr", {}, columns.map((c) => el("th", { text: c[0], class: c[2] || "" })));
    const body = rows.map((r) => el("tr", {}, columns.map((c) => {
      const cell = el("td", { class: c[2] || "" });
      const v = c[1](r);
      if (v instanceof Node) cell.appendChild(v);
      else cell.textContent = v;
      return cell;
    })));
    return el("table", { class: cls || "" }, [el("thead", {}, [head]), el("tbody", {}, body)]);
  }

  function workersTable(workers) {
    return table(
      [
        ["worker", (w) => String(w.worker)],
        ["degree", (w) => `CP${w.cp_degree}`],
        ["state", (w) => el("span", { class: `state-${w.state}`, text: w.state + (w.restarting ? " (restarting)" : "") }), "text"],
        ["queued", (w) => fmt(w.queued)],
        ["running", (w) => (w.running === null || w.running === undefined ? "–" : `#${w.running}`)],
        ["outstanding (s)", (w) => fmt(w.outstanding_s, 3)],
        ["cached blocks", (w) => fmt(w.cached_blocks)],
        ["ranks", (w) => spans(w.ranks), "text"],
        ["hosts", (w) => (w.host_names && w.host_names.length ? w.host_names : w.hosts || []).join(", "), "text"],
      ],
      workers,
      "workers"
    );
  }

  function eventsTable(view) {
    const recent = view.events.slice(-30).reverse();
    return table(
      [
        ["time", (e) => (view.t0 === null ? `${fmt(e.t, 1)} s` : new Date((view.t0 + e.t) * 1000).toLocaleTimeString())],
        ["reshape", (e) => e.kind, "text"],
        ["rule", (e) => e.rule, "text"],
        ["workers", (e) => (e.ops || []).map((o) => `${(o.sources || []).join("+")} → CP${o.degree}`).join("; "), "text"],
        ["demand / capacity (s)", (e) => (e.inputs && e.inputs.demand_s !== undefined ? `${fmt(e.inputs.demand_s, 2)} / ${fmt(e.inputs.capacity_s, 2)}` : "–")],
        ["candidates", (e) => ((e.candidates || []).length ? `${e.candidates.length}${e.inputs && e.inputs.chosen ? `, chose ${e.inputs.chosen}` : ""}` : "–")],
        ["audit: predicted / measured (s), vs holding", (e) => (e.kind === "audit" && e.inputs ? `${fmt(e.inputs.predicted_s, 3)} / ${fmt(e.inputs.measured_s, 3)}, ${fmt(100 * e.inputs.vs_hold, 1)} %` : "–")],
      ],
      recent,
      "events"
    );
  }

  function summaryTable(summary) { // a row per scalar figure of a run's summary
    const keys = Object.keys(summary || {}).filter((k) => {
      const v = summary[k];
      return v === null || ["number", "string", "boolean"].includes(typeof v);
    });
    return table([["", (k) => k, "text"], ["value", (k) => fmt(summary[k])]], keys, "summary");
  }

  // -- the page ----------------------------------------------------------------------

  function skeleton(root, view, withTables) {
    root.innerHTML = "";
    const facts = el("header", {}, [
      el("h1", { text: view.title }),
      el("span", { class: "fact" }, [el("span", { text: "composition " }), el("b", { id: "composition", text: view.composition || "–" })]),
      el("span", { class: "fact", id: "epoch", text: view.epoch === undefined ? "" : `epoch ${view.epoch}` }),
      el("span", { class: "fact", id: "samples", text: "" }),
      el("span", { class: "fact", id: "host-tier", text: "" }),
      el("span", { class: "fact", id: "status", text: "" }),
    ]);
    const main = el("main", {}, [el("div", { id: "keyform" })]);
    const grid = el("div", { class: "grid" });
    for (const c of CHARTS) {
      const wide = c.id === "composition" ? " wide" : "";
      const title = el("h2", { text: c.title }, c.windowed ? [el("span", { class: "window muted" })] : []);
      grid.appendChild(el("div", { class: "card" + wide }, [title, el("div", { class: "chart", id: `chart-${c.id}` })]));
    }
    main.appendChild(grid);
    if (withTables) {
      const tables = el("div", { class: "grid" }, [
        el("div", { class: "card" }, [el("h2", { text: "Workers" }), el("div", { class: "scroll", id: "workers" })]),
        el("div", { class: "card" }, [el("h2", { text: "Reshapes and their audits (latest first)" }), el("div", { class: "scroll", id: "events" })]),
      ]);
      main.appendChild(tables);
    }
    root.appendChild(facts);
    root.appendChild(main);
  }

  function render(view) {
    const started = performance.now();
    for (const c of CHARTS) {
      const [traces, lay] = c.draw(view);
      Plotly.react(document.getElementById(`chart-${c.id}`), traces, lay, CONFIG);
    }
    document.getElementById("composition").textContent = view.composition || "–";
    if (view.window_s) {
      for (const node of document.querySelectorAll(".window")) node.textContent = ` (over the last ${fmt(view.window_s, 1)} s)`;
    }
    document.getElementById("epoch").textContent = view.epoch === undefined ? "" : `epoch ${view.epoch}`;
    document.getElementById("samples").textContent = `${view.samples.length} samples, ${view.workers.length} workers`;
    hostTier(view);
    const workers = document.getElementById("workers");
    if (workers) workers.replaceChildren(workersTable(view.workers));
    const events = document.getElementById("events");
    if (events) events.replaceChildren(eventsTable(view));
    const ms = performance.now() - started;
    stats.renders += 1;
    stats.lastRenderMs = ms;
    stats.maxRenderMs = Math.max(stats.maxRenderMs, ms);
    stats.samples = view.samples.length;
    document.body.dataset.renders = String(stats.renders);
  }

  // The host KV tier's use (the server's /v1/timeline host_tier; none: nothing shown).
  function hostTier(view) {
    const node = document.getElementById("host-tier");
    const t = view.host_tier;
    if (!node) return;
    node.textContent = t
      ? `host tier ${fmt(t.used_bytes / 2 ** 20, 1)} / ${fmt(t.capacity_bytes / 2 ** 20, 1)} MiB, ` +
        `${t.demoted_blocks} blocks demoted, ${t.loaded_blocks} loaded back`
      : "";
  }

  function newView(title, t0) {
    return { title: title, t0: t0, samples: [], events: [], workers: [], composition: null, epoch: undefined };
  }

  // -- live: the server's /dashboard ---------------------------------------------------

  function live(root, opts) {
    const url = opts.url || "/v1/timeline";
    const period = opts.periodMs || 1000;
    let view = newView(opts.title || "Vertumnus", null);
    let since = null;
    let started = undefined;
    skeleton(root, view, true);

    function status(text, stale) {
      const node = document.getElementById("status");
      node.textContent = text;
      node.className = stale ? "fact stale" : "fact muted";
    }

    function askKey(message) {
      const form = el("form", { class: "key" }, [
        el("span", { text: message + " " }),
        el("input", { type: "password", id: "apikey", placeholder: "API key", autocomplete: "off" }),
        el("button", { type: "submit", text: "Use" }),
      ]);
      form.addEventListener("submit", (ev) => {
        ev.preventDefault();
        sessionStorage.setItem("vertumnus-key", document.getElementById("apikey").value);
        document.getElementById("keyform").replaceChildren();
        poll();
      });
      document.getElementById("keyform").replaceChildren(form);
    }

    async function poll() {
      const due = performance.now() + period; // the next poll, however long this one takes
      const next = () => setTimeout(poll, Math.max(0, due - performance.now()));
      const key = sessionStorage.getItem("vertumnus-key");
      const headers = key ? { Authorization: `Bearer ${key}` } : {};
      let data;
      try {
        const resp = await fetch(since === null ? url : `${url}?since=${since}`, { headers: headers, cache: "no-store" });
        if (resp.status === 401) {
          askKey(key ? "The API key was refused; enter it again:" : "This server needs its API key:");
          return;
        }
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        data = await resp.json();
      } catch (err) {
        stats.errors += 1;
        status(`not updating: ${err.message}`, true);
        next();
        return;
      }
      stats.polls += 1;
      if (started !== undefined && data.started_unix !== started) {
        view = newView(view.title, null); // the server restarted: start over
        since = null;
      }
      started = data.started_unix;
      view.t0 = data.started_unix;
      view.samples.push(...data.samples);
      if (view.samples.length > data.capacity) view.samples.splice(0, view.samples.length - data.capacity);
      view.events.push(...data.events);
      if (view.events.length > MAX_EVENTS) view.events.splice(0, view.events.length - MAX_EVENTS);
      view.workers = data.workers;
      view.composition = data.composition;
      view.epoch = data.epoch;
      view.window_s = data.window_s;
      view.host_tier = data.host_tier;
      const last = [view.samples, view.events].map((a) => (a.length ? a[a.length - 1].t : -Infinity));
      if (Math.max(...last) > -Infinity) since = Math.max(...last);
      const changed = data.samples.length || data.events.length || stats.renders === 0;
      if (changed) render(view);
      else {
        document.getElementById("composition").textContent = view.composition || "–";
        hostTier(view);
        const workers = document.getElementById("workers");
        if (workers) workers.replaceChildren(workersTable(view.workers));
      }
      status(`updated ${new Date().toLocaleTimeString()}`, false);
      next();
    }
    poll();
  }

  // -- reports: a simulation's run, an experiment's variants ---------------------------

  function report(root, data) {
    const view = Object.assign(newView(data.title, null), data, { t0: null, timeTitle: "simulated time (s)" });
    skeleton(root, view, true);
    const main = root.querySelector("main");
    main.appendChild(el("div", { class: "card" }, [el("h2", { text: "Summary" }), summaryTable(data.summary)]));
    render(view);
  }

  function compare(root, data) {
    // Over time, one rate at a time (a select when the experiment ran several).
    root.innerHTML = "";
    const rates = [...new Set(data.variants.map((v) => v.rate))];
    const picker = el("select", { id: "rate" }, rates.map((r) => el("option", { value: String(r), text: r === null || r === undefined ? "as recorded" : `rate ×${r}` })));
    const header = el("header", {}, [
      el("h1", { text: data.title }),
      el("span", { class: "fact", id: "composition", text: `${data.runs.length} runs` }),
      el("span", { class: "fact" }, rates.length > 1 ? [el("span", { text: "over time at " }), picker] : []),
    ]);
    const main = el("main", {});
    const runs = table(
      [["run", (r) => r.name, "name"]].concat(data.columns.map((k) => [k, (r) => fmt(r.summary[k])])),
      data.runs,
      "summary"
    );
    main.appendChild(el("div", { class: "card wide" }, [el("h2", { text: "Every run" }), el("div", { class: "scroll" }, [runs])]));
    const grid = el("div", { class: "grid" });
    main.appendChild(grid);
    root.appendChild(header);
    root.appendChild(main);
    const specs = [
      ["ttft_p90_s", "P90 TTFT, over a trailing window (s)"],
      ["ttft_mean_s", "Mean TTFT, over a trailing window (s)"],
      ["slo_attainment", "Token SLO attainment (%)", pct],
      ["hit_rate", "Token hit rate (%)", pct],
    ];
    const view = { t0: null, timeTitle: "simulated time (s)" };

    function draw(rate) {
      const started = performance.now();
      const shown = data.variants.filter((v) => String(v.rate) === String(rate));
      for (const node of [...grid.querySelectorAll(".js-plotly-plot")]) Plotly.purge(node);
      grid.replaceChildren();
      const pending = [];
      for (const [key, title, scale] of specs) {
        const div = el("div", { class: "chart", id: `chart-${key}` });
        grid.appendChild(el("div", { class: "card" }, [el("h2", { text: title }), div]));
        const traces = shown.map((v, i) => line(view, v.samples, key, v.name, { scale: scale, trace: { line: { color: COLORS[i % COLORS.length] } } }));
        const yaxis = scale ? { range: [0, 105] } : { rangemode: "tozero" };
        pending.push([div, traces, layout(view, { yaxis: yaxis })]);
      }
      for (const v of shown) {
        const div = el("div", { class: "chart", id: `chart-composition-${v.name}` });
        grid.appendChild(el("div", { class: "card" }, [el("h2", { text: `Composition: ${v.name}` }), div]));
        pending.push([div, compositionTraces(view, v.samples, v.events), layout(view, { yaxis: workersAxis(v.samples) })]);
      }
      for (const [div, traces, lay] of pending) Plotly.newPlot(div, traces, lay, CONFIG);
      stats.renders += 1;
      stats.lastRenderMs = performance.now() - started;
      stats.maxRenderMs = Math.max(stats.maxRenderMs, stats.lastRenderMs);
      document.body.dataset.renders = String(stats.renders);
    }
    picker.addEventListener("change", () => draw(picker.value));
    draw(String(rates[0]));
  }

  window.Vertumnus = { live: live, report: report, compare: compare };
})();
