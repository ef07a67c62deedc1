/* searchrl view: renders window.SEARCHRL (data/main.js, written by `searchrl view`). Plain JavaScript, no
   dependencies, opens from disk. Views: evaluation (questions, transcripts, filters), compare (two
   evaluations paired by question), training (the tokens a step trained on, coloured by mask, advantage,
   ratio or log-prob gap), curves. */
"use strict";
(function () {
  const D = window.SEARCHRL;
  const main = document.getElementById("main");
  const PAGE = 200; // cards rendered at a time
  const steps = {}; // "stage:step" -> the step's record, filled by data/STAGE-step-N.js

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  const fmt = (x, d = 3) => (typeof x === "number" && isFinite(x) ? x.toFixed(d) : "–");
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : NaN);

  if (!D) {
    main.textContent = "data/main.js did not load: open index.html from the folder `searchrl view` wrote.";
    return;
  }
  document.getElementById("title").textContent = D.title;
  document.title = "searchrl view: " + D.title;

  // ------------------------------------------------------------------ tabs
  const tabs = [];
  if (D.evals.length) tabs.push(["evaluation", "Evaluation", renderEval]);
  if (D.compare) tabs.push(["compare", "Compare", renderCompare]);
  if (D.training.length) tabs.push(["training", "Training", renderTraining]);
  if (D.curves.length) tabs.push(["curves", "Curves", renderCurves]);
  const nav = document.getElementById("tabs");
  function show(name) {
    const tab = tabs.find((t) => t[0] === name) || tabs[0];
    for (const b of nav.children) b.classList.toggle("active", b.dataset.tab === tab[0]);
    main.replaceChildren();
    main.dataset.view = tab[0];
    tab[2]();
    if (location.hash !== "#" + tab[0]) history.replaceState(null, "", "#" + tab[0]);
  }
  for (const [name, label] of tabs) {
    nav.append(el("button", { "data-tab": name, id: "tab-" + name, onclick: () => show(name) }, label));
  }

  // ------------------------------------------------------------------ transcripts
  function docList(docs) {
    return docs.map((d) =>
      el(
        "details",
        { class: "doc" + (d.gold ? " gold" : "") },
        el("summary", {}, (d.gold ? "★ gold · " : "") + "[" + d.id + "] " + (d.title || "")),
        el("p", {}, d.text || ""),
      ),
    );
  }
  function transcript(rec) {
    const segs = rec.segments || [{ kind: "transcript", text: rec.transcript || "" }];
    return segs.map((s) => {
      const invalid = s.kind === "action" && s.valid === false;
      let label = s.kind;
      if (s.kind === "action" && s.step) label += " · " + s.step + (invalid ? " (invalid: " + (s.error || "?") + ")" : "");
      if (s.docs) label += " · " + s.docs.length + " documents";
      return el(
        "div",
        { class: "seg seg-" + s.kind + (invalid ? " invalid" : "") },
        el("div", { class: "kind" }, label),
        el("pre", {}, s.text),
        s.docs ? docList(s.docs) : null,
      );
    });
  }
  function scoreBadge(rec) {
    const right = Number(rec.em) > 0;
    return el("span", { class: "badge " + (right ? "right" : "wrong") }, right ? "EM 1" : "EM 0");
  }
  function answersLine(rec) {
    const right = Number(rec.em) > 0;
    return el(
      "div",
      { class: "answers" },
      "gold: ",
      el("span", { class: "gold" }, (rec.answers || []).join(" | ")),
      " · prediction: ",
      el("span", { class: "pred" + (right ? "" : " wrong") }, rec.prediction === null ? "(none)" : rec.prediction),
    );
  }
  function card(rec) {
    const body = el("div", { class: "body", hidden: true });
    const head = el(
      "div",
      { class: "head" },
      scoreBadge(rec),
      el("div", {}, el("div", { class: "qtext" }, rec.question), answersLine(rec)),
      el(
        "div",
        { class: "meta" },
        "F1 " + fmt(rec.f1, 2) + " · " + rec.searches + " searches · " + hopsOf(rec) + " hops · " + (rec.finish_reason || "?"),
      ),
    );
    const c = el("div", { class: "card question", "data-id": rec.id }, head, body);
    head.addEventListener("click", () => {
      if (!body.childElementCount) body.append(...transcript(rec));
      body.hidden = !body.hidden;
      c.classList.toggle("open", !body.hidden);
    });
    return c;
  }
  const hopsOf = (r) => (r.hops ? String(r.hops) : "unknown");
  const searchBin = (r) => (r.searches >= 3 ? "3+" : String(r.searches));

  // ------------------------------------------------------------------ evaluation view
  function select(id, label, values, onchange) {
    const s = el("select", { id, onchange }, values.map(([v, t]) => el("option", { value: v }, t)));
    return el("label", {}, label + " ", s);
  }
  function renderEval() {
    let ev = D.evals[0];
    const controls = el("div", { class: "controls" });
    const summary = el("div", { class: "summary", id: "summary" });
    const list = el("div", { id: "questions" });
    const uniq = (f) => [...new Set(ev.records.map(f))].sort();
    function build() {
      controls.replaceChildren(
        D.evals.length > 1
          ? select("f-eval", "evaluation", D.evals.map((e, i) => [String(i), e.name]), (e) => {
              ev = D.evals[Number(e.target.value)];
              build();
            })
          : el("span", { class: "meta" }, ev.name),
        el("label", {}, el("input", { type: "checkbox", id: "f-wrong", onchange: apply }), " wrong only"),
        select("f-hops", "hops", [["", "all"], ...uniq(hopsOf).map((h) => [h, h])], apply),
        select("f-searches", "searches", [["", "all"], ...uniq(searchBin).map((h) => [h, h])], apply),
        select("f-finish", "finish", [["", "all"], ...uniq((r) => r.finish_reason || "?").map((h) => [h, h])], apply),
        el("input", { type: "search", id: "f-text", placeholder: "search questions, answers, ids", oninput: apply }),
      );
      const sel = controls.querySelector("#f-eval");
      if (sel) sel.value = String(D.evals.indexOf(ev));
      apply();
    }
    function apply() {
      const v = (id) => (controls.querySelector("#" + id) || {}).value || "";
      const wrong = controls.querySelector("#f-wrong").checked;
      const text = v("f-text").toLowerCase();
      const shown = ev.records.filter(
        (r) =>
          (!wrong || !(Number(r.em) > 0)) &&
          (!v("f-hops") || hopsOf(r) === v("f-hops")) &&
          (!v("f-searches") || searchBin(r) === v("f-searches")) &&
          (!v("f-finish") || (r.finish_reason || "?") === v("f-finish")) &&
          (!text || [r.question, r.id, r.prediction || "", ...(r.answers || [])].join(" ").toLowerCase().includes(text)),
      );
      const ems = ev.records.map((r) => Number(r.em) || 0);
      summary.replaceChildren(
        el("b", { id: "shown-count" }, String(shown.length)),
        " of " + ev.records.length + " questions shown · EM ",
        el("b", {}, fmt(mean(ems))),
        " · F1 " + fmt(mean(ev.records.map((r) => Number(r.f1) || 0))) +
          " · searches per question " + fmt(mean(ev.records.map((r) => r.searches || 0)), 2) +
          " · " + ev.file,
      );
      paged(list, shown, card);
    }
    main.append(controls, summary, list);
    build();
  }
  function paged(list, items, render) {
    list.replaceChildren();
    let at = 0;
    function more() {
      const btn = list.querySelector("button.more");
      if (btn) btn.remove();
      list.append(...items.slice(at, at + PAGE).map(render));
      at += PAGE;
      if (at < items.length) list.append(el("button", { class: "more", onclick: more }, "show " + Math.min(PAGE, items.length - at) + " more"));
    }
    if (!items.length) list.append(el("div", { class: "empty" }, "no question matches the filters"));
    else more();
  }

  // ------------------------------------------------------------------ compare view
  function renderCompare() {
    const C = D.compare, S = C.stats;
    const a = Object.fromEntries(C.a.records.map((r) => [r.id, r]));
    const b = Object.fromEntries(C.b.records.map((r) => [r.id, r]));
    const rank = (id) => (Number(a[id].em) > 0 && !(Number(b[id].em) > 0) ? 0 : Number(b[id].em) > 0 && !(Number(a[id].em) > 0) ? 1 : 2);
    const ids = S.ids.slice().sort((x, y) => rank(x) - rank(y));
    const row = (k, name) => {
      const s = S[k];
      const sig = s.p < 0.05;
      return el(
        "tr",
        {},
        el("td", {}, name),
        el("td", {}, fmt(s.a)),
        el("td", {}, fmt(s.b)),
        el("td", { class: sig ? "sig" : "" }, (s.difference >= 0 ? "+" : "") + fmt(s.difference) + " [" + fmt(s.low) + ", " + fmt(s.high) + "]"),
        el("td", { class: sig ? "sig" : "" }, fmt(s.p, 4)),
      );
    };
    const n = S.counts;
    main.append(
      el("h3", {}, "A = " + C.a.name + " · B = " + C.b.name),
      el(
        "table",
        { class: "stats", id: "compare-stats" },
        el("tr", {}, el("th", {}, "metric"), el("th", {}, "A"), el("th", {}, "B"), el("th", {}, "A − B [95% interval]"), el("th", {}, "paired p")),
        row("em", "EM"),
        row("f1", "F1"),
      ),
      el(
        "div",
        { class: "summary" },
        S.questions + " questions in both · A right, B wrong: ",
        el("b", {}, String(n.a_only)),
        " · B right, A wrong: ",
        el("b", {}, String(n.b_only)),
        " · both right: " + n.both + " · both wrong: " + n.neither + " (paired bootstrap over questions, searchrl.stats)",
      ),
    );
    const controls = el("div", { class: "controls" });
    const list = el("div", { id: "pairs" });
    const apply = () => {
      const only = controls.querySelector("#f-discordant").checked;
      paged(list, ids.filter((id) => !only || rank(id) < 2), pairCard);
    };
    controls.append(el("label", {}, el("input", { type: "checkbox", id: "f-discordant", onchange: apply }), " only questions where A and B differ"));
    main.append(controls, list);
    apply();
    function pairCard(id) {
      const ra = a[id], rb = b[id];
      const body = el("div", { class: "body", hidden: true });
      const head = el(
        "div",
        { class: "head" },
        el("div", {}, scoreBadge(ra), " ", scoreBadge(rb)),
        el("div", {}, el("div", { class: "qtext" }, ra.question), el("div", { class: "answers" }, "gold: ", el("span", { class: "gold" }, (ra.answers || []).join(" | ")), " · A: " + (ra.prediction ?? "(none)") + " · B: " + (rb.prediction ?? "(none)"))),
        el("div", { class: "meta" }, ["A before B", "B before A", ""][rank(id)]),
      );
      head.addEventListener("click", () => {
        if (!body.childElementCount) body.append(el("div", { class: "pair" }, el("div", {}, el("h4", {}, "A"), ...transcript(ra)), el("div", {}, el("h4", {}, "B"), ...transcript(rb))));
        body.hidden = !body.hidden;
      });
      return el("div", { class: "card pair-card", "data-id": id }, head, body);
    }
  }

  // ------------------------------------------------------------------ training view
  const MODES = {
    mask: "loss mask (trained or not)",
    advantages: "advantage",
    ratio: "ratio π/π_old (log, clipped to ±0.5)",
    gap: "log-prob gap trainer − sampler",
    logp: "trainer log-prob",
  };
  function tokenValue(row, mode, i) {
    if (mode === "advantages") return row.advantages ? row.advantages[i] : null;
    if (mode === "ratio") return row.logp_old ? row.logp[i] - row.logp_old[i] : null;
    if (mode === "gap") return row.logp[i] - row.logp_sampled[i];
    if (mode === "logp") return row.logp[i];
    return null;
  }
  function colour(v, scale) {
    // diverging: red below 0, blue above, white at 0; |v| >= scale is full colour
    const t = Math.max(-1, Math.min(1, v / (scale || 1)));
    const mix = (c) => Math.round(255 + (c - 255) * Math.abs(t));
    return t < 0 ? `rgb(${mix(220)}, ${mix(38)}, ${mix(38)})` : `rgb(${mix(37)}, ${mix(99)}, ${mix(235)})`;
  }
  const KIND = ["prompt", "action", "observation"];
  function tokenRow(row, mode, scale) {
    const box = el("div", { class: "tokens" });
    const ends = {};
    (row.steps || []).forEach((s, k) => (ends[s.end] = [k, s]));
    const frag = document.createDocumentFragment();
    for (let i = 0; i < row.ids.length; i++) {
      const kind = KIND[row.kinds[i]];
      const m = row.loss_mask[i];
      let cls = "tok k-" + kind;
      if (kind === "action") cls += m ? " trained" : " untrained";
      const tip = [
        "#" + i + " id " + row.ids[i] + " · " + kind + (kind === "action" ? (m ? " · trained" : " · not trained") : ""),
        "log-prob trainer " + fmt(row.logp[i], 4) + " · sampler " + fmt(row.logp_sampled[i], 4) + (row.logp_old ? " · π_old " + fmt(row.logp_old[i], 4) : ""),
        row.advantages ? "advantage " + fmt(row.advantages[i], 4) : "",
        row.is_weight ? "IS weight " + fmt(row.is_weight[i], 4) : "",
        row.versions ? "sampled by policy version " + row.versions[i] : "",
      ].filter(Boolean).join("\n");
      const span = el("span", { class: cls, title: tip, "data-i": i }, row.tokens[i]);
      if (mode !== "mask" && m) {
        const v = tokenValue(row, mode, i);
        if (v !== null && v !== undefined) {
          span.classList.add("valued");
          span.style.background = colour(v, scale);
          if (Math.abs(v) > 0.6 * (scale || 1)) span.style.color = "#fff"; // legible on a strong colour
        }
      }
      frag.append(span);
      if (ends[i]) {
        const [k, s] = ends[i];
        frag.append(el("span", { class: "step-end", title: (s.query ? "query: " + s.query + "\n" : "") + (s.doc_ids.length ? "documents: " + s.doc_ids.join(", ") : "") }, "step " + (k + 1) + " · " + s.kind + (s.valid ? "" : " (invalid)") + " · step reward " + fmt(s.reward, 3)));
      }
    }
    box.append(frag);
    return box;
  }
  function renderTraining() {
    const controls = el("div", { class: "controls" });
    const legend = el("div", { class: "legend", id: "legend" });
    const metrics = el("div", { class: "metrics" });
    const list = el("div", { id: "rows" });
    let stage = D.training[0];
    const stageSel = select("t-stage", "stage", D.training.map((s, i) => [String(i), s.name + " (" + s.steps.length + " steps saved)"]), (e) => {
      stage = D.training[Number(e.target.value)];
      fillSteps();
      load();
    });
    const stepSel = el("select", { id: "t-step", onchange: () => load() });
    const modeSel = select("t-mode", "colour by", Object.entries(MODES), () => draw());
    function fillSteps() {
      stepSel.replaceChildren(...stage.steps.map((s) => el("option", { value: String(s) }, "step " + s)));
      stepSel.value = String(stage.steps[stage.steps.length - 1]);
    }
    controls.append(stageSel, el("label", {}, "step ", stepSel), modeSel);
    main.append(controls, legend, metrics, list);
    fillSteps();
    function key() {
      return stage.name + ":" + stepSel.value;
    }
    function load() {
      if (steps[key()]) return draw();
      list.replaceChildren(el("div", { class: "empty" }, "loading step " + stepSel.value + "…"));
      const s = document.createElement("script");
      s.src = "data/" + stage.name + "-step-" + String(stepSel.value).padStart(6, "0") + ".js";
      s.onerror = () => list.replaceChildren(el("div", { class: "empty" }, "could not load " + s.src));
      document.body.append(s);
    }
    window.SEARCHRL_STEP = function (stageName, step, rec) {
      steps[stageName + ":" + step] = rec;
      if (main.dataset.view === "training" && stageName + ":" + step === key()) draw();
    };
    function draw() {
      const rec = steps[key()];
      if (!rec) return;
      const mode = controls.querySelector("#t-mode").value;
      const vals = [];
      for (const r of rec.rows) for (let i = 0; i < r.ids.length; i++) if (r.loss_mask[i]) { const v = tokenValue(r, mode, i); if (v !== null) vals.push(Math.abs(v)); }
      vals.sort((x, y) => x - y);
      let scale = vals.length ? vals[Math.floor(0.95 * (vals.length - 1))] : 1; // 95th percentile of |value|
      if (mode === "ratio") scale = 0.5;
      legend.replaceChildren(
        ...(mode === "mask"
          ? [["trained", "action, trained (loss mask 1)"], ["untrained", "action, not trained"], ["obs", "observation"], ["prompt", "prompt"]].map(([c, t]) => el("span", {}, el("span", { class: "swatch", style: "background: var(--" + c + ")" }), t))
          : [el("span", {}, fmt(-scale, 3) + " "), el("span", { class: "gradient" }), el("span", {}, " " + fmt(scale, 3) + " · " + MODES[mode] + " on trained tokens")]),
      );
      const m = rec.metrics || {};
      metrics.textContent = ["reward/mean", "train/loss", "train/em", "train/clip_frac", "train/kl", "rollout/logprob_abs_diff", "async/staleness_max"].filter((k) => k in m).map((k) => k + " " + fmt(m[k], 4)).join(" · ");
      list.replaceChildren(
        ...rec.rows.map((r) =>
          el(
            "div",
            { class: "row", "data-row": r.row },
            el(
              "div",
              { class: "head" },
              el("div", { class: "qtext" }, "group " + r.group + " · " + (r.question || r.id || "row " + r.row)),
              el(
                "div",
                { class: "answers" },
                "gold: ",
                el("span", { class: "gold" }, (r.answers || []).join(" | ")),
                " · prediction: " + (r.prediction ?? "(none)") + " · reward " + fmt(r.reward, 3) + " · " + (r.finish_reason || "?") +
                  " · " + r.loss_mask.reduce((x, y) => x + y, 0) + " trained tokens of " + r.ids.length + (r.trained ? "" : " · row not trained (masked)"),
              ),
            ),
            tokenRow(r, mode, scale),
          ),
        ),
      );
    }
    load();
  }

  // ------------------------------------------------------------------ curves
  function renderCurves() {
    main.append(el("div", { class: "curves" }, D.curves.map((c) => el("div", {}, el("a", { href: c }, c), el("br"), el("img", { src: c, alt: c })))));
  }

  const start = location.hash.slice(1);
  if (tabs.length) show(start);
  else main.textContent = "nothing to show";
})();
