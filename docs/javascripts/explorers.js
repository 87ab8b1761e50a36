/* The chapters' explorers, live on the static site. scripts/site_explorers.py writes each one's HTML: its
 * controls (each named by data-control, its description in the chapter), its readouts
 * (.minserve-widget-readout, in the widget's order) and its data as inline JSON. The page has no Python
 * kernel, so an explorer answers in one of two ways (data-mode):
 *   grid:  the build set the controls to each point of a grid and kept the readouts; the controls pick one.
 *   model: its arithmetic, written once below (the same formulas as minserve.capacity), runs here.
 * Nothing is fetched from anywhere: everything is in the page. */
(function () {
  "use strict";

  // --- the arithmetic explorers: (values by control description, data, root) -> {readouts, status} ----------

  // Chapter 08: speculation's speedup over k, (1 − α^(k+1)) / (1 − α) tokens a step over k·c + v step costs.
  function speculation(v, _data, root) {
    const a = Number(v["α"]), c = Number(v["draft cost c"]), cost = Number(v["verify cost v"]);
    const ks = [1, 2, 3, 4, 5, 6, 7, 8];
    const tokens = (k) => (a === 1 ? k + 1 : (1 - a ** (k + 1)) / (1 - a));
    const speedup = ks.map((k) => tokens(k) / (k * c + cost));
    const chart = root.querySelector(".js-plotly-plot");  // the chapter's figure: redraw its predicted curve
    const name = `predicted: α=${a.toFixed(2)}, c=${c.toFixed(2)}, v=${cost.toFixed(2)}`;
    if (chart && window.Plotly) window.Plotly.restyle(chart, { x: [ks], y: [speedup], name: [name] }, [0]);
    const best = speedup.indexOf(Math.max(...speedup));
    const verdict = speedup[best] > 1 ? "pays" : "does not pay: plain decoding is faster";
    return { status: `α=${a.toFixed(2)}, c=${c.toFixed(2)}, v=${cost.toFixed(2)}: best k = ${ks[best]}, ` +
                     `${speedup[best].toFixed(2)}× plain decoding (speculation ${verdict})` };
  }

  // Decimal units, as accelerator memory is sold (minserve.lab.kv.format_bytes).
  function formatBytes(n) {
    const sign = n < 0 ? "−" : "";
    n = Math.abs(n);
    for (const unit of ["B", "kB", "MB", "GB"]) {
      if (n < 1000) return unit === "B" ? `${sign}${n.toFixed(0)} B` : `${sign}${n.toFixed(1)} ${unit}`;
      n /= 1000;
    }
    return `${sign}${n.toFixed(1)} TB`;
  }

  // Chapter 04: minserve.capacity.fit, from the bytes the build exported per model and dtype.
  function kvCalculator(v, data) {
    const model = data.models[v["model"]];
    if (!model) return { status: `${v["model"]} is sized in JupyterLab only (make lab)` };
    const context = Math.max(1, parseInt(v["context"], 10) || 1), batch = Math.max(1, parseInt(v["batch"], 10) || 1);
    const block = data.block_size, perToken = model.kv_per_token[v["KV cache"]];
    const weights = model.weights[v["weights"]], gpu = data.gpus[v["GPU"]];
    const usable = Math.floor(gpu * data.utilization);
    const perRequest = Math.ceil(context / block) * block * perToken;  // whole blocks of the paged cache
    const kv = batch * perRequest, fits = weights + kv <= usable;
    const blocks = Math.floor(Math.max(usable - weights, 0) / (block * perToken));
    const rows = [
      ["KV per token", `${perToken.toLocaleString("en-US")} B`], ["KV per request", formatBytes(perRequest)],
      ["KV for the batch", formatBytes(kv)], ["weights", formatBytes(weights)], ["usable memory", formatBytes(usable)],
      ["headroom", formatBytes(usable - weights - kv)],
      ["max batch at this context", Math.floor(blocks / Math.ceil(context / block)).toLocaleString("en-US")],
    ];
    const body = rows.map(([k, x]) => `<tr><td style='padding:0 12px'>${k}</td><td style='text-align:right'>${x}</td></tr>`);
    const verdict = `<p style='color:${fits ? "#009E73" : "#D55E00"};font-weight:bold'>${fits ? "fits" : "does not fit"}</p>`;
    return { readouts: [`<table>${body.join("")}</table>${verdict}`],
             status: `${v["model"]}, ${batch} × ${context} tokens on ${v["GPU"]}: computed in this page` };
  }

  const MODELS = { "speculation": speculation, "kv-calculator": kvCalculator };

  // --- the built grid: the controls' positions name a point; its readouts were recorded at build time --------

  function gridAnswer(root, data) {
    const positions = data.controls.map((name, i) => {
      const el = root.querySelector(`[data-control="${CSS.escape(name)}"]`);
      if (el.tagName === "SELECT") return data.values[i].indexOf(el.selectedIndex);
      if (el.type === "checkbox") return data.values[i].indexOf(el.checked);
      const x = Number(el.value);  // a slider: the nearest value on the grid
      const gaps = data.values[i].map((g) => Math.abs(g - x));
      return gaps.indexOf(Math.min(...gaps));
    });
    const row = data.index[positions.join(",")];
    if (row === undefined) {
      return { status: "This combination was not built (the grid moves one control at a time from the " +
                       "chapter's setting): run the chapter in JupyterLab for it." };
    }
    return { readouts: data.readouts[row], status: `A built result, ${row + 1} of ${data.readouts.length} distinct.` };
  }

  // --- wiring -----------------------------------------------------------------------------------------------

  function values(root) {
    const out = {};
    root.querySelectorAll("[data-control]").forEach((el) => {
      out[el.dataset.control] = el.tagName === "SELECT" ? el.options[el.selectedIndex].text
        : el.type === "checkbox" ? el.checked : el.value;
    });
    return out;
  }

  // innerHTML does not run scripts; a built readout's chart draws from its own script, so run each anew.
  function setHtml(el, html) {
    el.innerHTML = html;
    el.querySelectorAll("script").forEach((old) => {
      const script = document.createElement("script");
      script.text = old.text;
      old.replaceWith(script);
    });
  }

  function init(root) {
    const data = JSON.parse(root.querySelector("script.minserve-explorer-data").textContent);
    const readouts = [...root.querySelectorAll(".minserve-widget-readout")];
    const original = readouts.map((r) => r.innerHTML);  // what the chapter left: a grid's null means this
    const status = root.querySelector(".minserve-explorer-status");
    const update = () => {
      const answer = root.dataset.mode === "grid" ? gridAnswer(root, data)
        : MODELS[root.dataset.explorer](values(root), data, root);
      (answer.readouts || []).forEach((html, i) => {
        if (readouts[i] && html !== undefined) setHtml(readouts[i], html === null ? original[i] : html);
      });
      status.textContent = answer.status || "";
    };
    root.querySelectorAll("[data-control]").forEach((el) => {
      const shown = el.parentElement.querySelector("output");  // a slider's value beside it
      const changed = () => { if (shown) shown.textContent = el.value; update(); };
      el.addEventListener("input", changed);
      el.addEventListener("change", changed);
    });
    root.dataset.ready = "true";  // for the site test: the controls now answer
  }

  document.querySelectorAll(".minserve-explorer").forEach(init);
})();
