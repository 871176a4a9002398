"""Open a rendered report in headless Chromium over the DevTools protocol and report what a reader's
browser sees: charts drawn, console errors, network requests, and text that should not be there.

Chromium is Debian's `chromium` package (`.ci/run` installs it when it can); the protocol client is
tornado's websocket (already installed: Jupyter's kernel client, which renders the report, uses it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREEN_BUDGET = 15  # screens of 1400 x 900 a reader reads before the appendix

# Evaluated in the page once it has loaded: what the checks need, as one JSON-able object.
PAGE_FACTS = """(() => {
  CHART_FAULTS_FUNCTION
  const charts = [...document.querySelectorAll('div[id^="chart-"]')];
  const cells = [...document.querySelectorAll('td, th')].map(c => c.textContent.trim());
  const text = document.body.innerText;
  return {
    charts: charts.length,
    drawn: charts.filter(c => c.querySelector('svg, canvas')).length,
    nan_cells: cells.filter(t => t === 'nan' || t === 'NaN').length,
    raw_tables: text.split('\\n').filter(l => /^\\s*\\|[\\s:-]+\\|/.test(l)).length,
    tracebacks: (text.match(/Traceback \\(most recent call last\\)/g) || []).length,
    stderr_outputs: document.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]').length,
    toc_links: document.querySelectorAll('#TOC a').length,
    chart_faults: charts.flatMap(chartFaults).concat(charts.flatMap(claimFaults)),
    unnumbered_charts: charts.filter(c => !/^Figure A?\\d+\\. \\S/.test(
      (c.closest('figure') || {querySelector: () => null}).querySelector('figcaption')?.textContent || '')).length,
    screens: document.documentElement.scrollHeight / window.innerHeight,
    // the main body: everything above the appendix (the whole page if there is none)
    main_screens: ([...document.querySelectorAll('h2')].find(h => h.textContent.startsWith('Appendix'))
      ?.getBoundingClientRect().top + window.scrollY || document.documentElement.scrollHeight) / window.innerHeight,
    // names from the code (snake_case, set as code or not) and file paths in the prose a reader sees above the
    // appendix: folded notes, code blocks and tables aside
    prose_identifiers: (() => {
      const appendix = [...document.querySelectorAll('h2')].find(h => h.textContent.startsWith('Appendix'));
      const end = appendix ? appendix.getBoundingClientRect().top + window.scrollY : Infinity;
      return [...new Set([...document.querySelectorAll('p, li, figcaption, summary, h1, h2, h3, h4')]
        .filter(el => el.getClientRects().length && el.getBoundingClientRect().top + window.scrollY < end)
        .filter(el => el.closest('summary') || !el.closest('details:not([open])'))  // a folded note is not read
        .filter(el => !el.closest('table, pre'))
        .flatMap(el => el.textContent.match(/\\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\\b|\\b(?:src|config|scripts|reports|results|workflow)\\/[\\w.\\/-]+|\\b[\\w-]+\\.(?:py|yaml|qmd|csv)\\b/g) || []))];
    })(),
  };
})()"""

# What makes a drawn chart unreadable, from its SVG (the report embeds charts with Vega's SVG
# renderer): bars too thin to see, facets too narrow to label, text Vega shortened with an ellipsis
# or drawn outside the chart's own box, two entries of a colour legend in one colour (a legend whose
# entries all share one colour tells shapes apart, not colours).
CHART_FAULTS = """function chartFaults(div) {
  const svg = div.querySelector('svg');
  if (!svg) return [];
  const faults = [], root = svg.getBoundingClientRect();
  // The chart's own title is drawn last; facet headers and titles come before it.
  const title = [...svg.querySelectorAll('g.mark-group.role-title')].filter(
    g => !g.parentElement.closest('[class*="header"], [class*="facet-title"]')).at(-1);
  const name = title ? title.textContent : div.id;
  const same = xs => Math.max(...xs) - Math.min(...xs) < 0.5;
  for (const group of svg.querySelectorAll('g.mark-rect')) {
    const boxes = [...group.querySelectorAll(':scope > path')].map(p => p.getBoundingClientRect())
      .filter(b => b.width > 0 && b.height > 0);
    if (!boxes.length) continue;
    const ws = boxes.map(b => b.width), hs = boxes.map(b => b.height);
    // Equal widths and heights (a box plot's boxes of near-equal spread): the bars' thickness is across the
    // axis they are laid out along (side by side: their width; stacked: their height; one box: its larger side).
    const along = same(boxes.map(b => b.left)) ? (same(boxes.map(b => b.top)) ? Math.max(ws[0], hs[0]) : hs[0]) : ws[0];
    const thickness = same(ws) && same(hs) ? along : same(ws) ? ws[0] : same(hs) ? hs[0]
      : Math.min(...boxes.map(b => Math.max(b.width, b.height)));
    if (thickness < 2) faults.push(`${name}: bars ${thickness.toFixed(1)} px thick`);
  }
  const cells = [...svg.querySelectorAll('g.mark-group.role-scope.cell > g > path.background')];
  const narrow = cells.map(c => c.getBoundingClientRect().width).filter(w => w < 120);
  if (narrow.length) faults.push(`${name}: ${narrow.length} facet(s) narrower than 120 px (${Math.min(...narrow).toFixed(0)} px)`);
  for (const text of svg.querySelectorAll('text')) {
    const b = text.getBoundingClientRect(), words = text.textContent;
    if (words.endsWith('…')) faults.push(`${name}: text shortened: "${words}"`);
    else if (words.trim() && (b.left < root.left - 1 || b.right > root.right + 1 || b.top < root.top - 1 ||
                              b.bottom > root.bottom + 1)) faults.push(`${name}: text outside the chart: "${words}"`);
  }
  for (const legend of svg.querySelectorAll('g.role-legend')) {
    const colours = [...legend.querySelectorAll('g.role-legend-symbol path')].map(p => {
      const fill = p.getAttribute('fill');
      return fill && fill !== 'transparent' && fill !== 'none' ? fill : p.getAttribute('stroke');
    });
    const labels = [...legend.querySelectorAll('g.role-legend-label text')].map(t => t.textContent);
    if (new Set(colours).size < 2) continue;
    const first = {};
    colours.forEach((c, i) => {
      if (c in first) faults.push(`${name}: legend entries "${first[c]}" and "${labels[i]}" share colour ${c}`);
      else first[c] = labels[i];
    });
  }
  return faults;
}"""


# What a chart's caption, title and axes claim, checked against what it draws (its Vega-Lite spec, stored on
# its div by the report's renderer, and its SVG legends):
# - a caption or title that names a diagonal: a line whose x and y encode the same field;
# - a title "... vs X": at least 3 values of the x field (two points are a comparison, not a trend);
# - an axis titled "a − b": the chart declares the difference (usermeta.difference: field, after, before, and
#   `flip` {field, value} for the rows plotted as before − after), and every row's value is that difference;
# - a legend with predicted (model, theory) and measured entries draws them with different symbols;
# - every legend entry has a symbol a reader can see.
CLAIM_FAULTS = r"""function claimFaults(div) {
  const spec = div.vegaLite, svg = div.querySelector('svg');
  if (!spec || !svg) return [];
  const faults = [], title = [spec.title].flat().map(t => (t && t.text) || t || '').join(' ');
  const name = title || div.id;
  const caption = (div.closest('figure')?.querySelector('figcaption')?.textContent || '') + ' ' + title;
  const units = [];  // every unit spec with the encoding and the rows it inherits
  const rowsOf = d => d ? (d.values || (spec.datasets || {})[d.name] || []) : [];
  (function walk(s, inherited, data) {
    if (!s || typeof s !== 'object') return;
    const encoding = Object.assign({}, inherited, s.encoding || {}), rows = s.data ? rowsOf(s.data) : data;
    if (s.mark) units.push({mark: s.mark.type || s.mark, encoding, rows});
    for (const child of [...(s.layer || []), ...(s.hconcat || []), ...(s.vconcat || []), ...(s.concat || [])])
      walk(child, encoding, rows);
    if (s.spec) walk(s.spec, encoding, rows);
  })(spec, {}, []);
  const rows = Object.values(spec.datasets || {}).flat().concat(spec.data?.values || []);
  const field = e => e && e.field;
  // a diagonal: a line through points whose x and y are equal
  const diagonal = u => ['line', 'rule'].includes(u.mark) && field(u.encoding.x) && field(u.encoding.y) &&
    u.rows.length >= 2 && u.rows.every(r => r[field(u.encoding.x)] === r[field(u.encoding.y)]);
  if (/diagonal/i.test(caption) && !units.some(diagonal))
    faults.push(`${name}: the caption names a diagonal the chart does not draw`);
  // a trend "vs X": an ordered or quantitative x axis needs three values of X
  // (the layer with the most values of x; one whose field a transform computes cannot be read here)
  const xs = u => new Set(u.rows.filter(r => field(u.encoding.x) in r).map(r => JSON.stringify(r[field(u.encoding.x)])));
  const trend = units.filter(u => ['quantitative', 'ordinal', 'temporal'].includes(u.encoding.x?.type) && !diagonal(u))
    .sort((a, b) => xs(b).size - xs(a).size)[0];
  if (/\bvs\.?\s/.test(title) && trend && xs(trend).size && xs(trend).size < 3)
    faults.push(`${name}: a chart "vs" ${field(trend.encoding.x)} with ${xs(trend).size} value(s) of it`);
  // (a difference inside |...| is a magnitude: it has no sign to check)
  const axes = units.flatMap(u => ['x', 'y'].map(c => u.encoding[c]).filter(
    e => e && /\S \u2212 \S/.test(e.title || '') && !/\|[^|]*\u2212[^|]*\|/.test(e.title)));
  for (const axis of axes) {
    const d = spec.usermeta?.difference;
    if (!d) { faults.push(`${name}: axis "${axis.title}" declares no difference it plots`); continue; }
    const wrong = rows.filter(r => d.field in r).filter(r => {
      const sign = d.flip && r[d.flip.field] === d.flip.value ? -1 : 1, want = sign * (r[d.after] - r[d.before]);
      return Math.abs(r[d.field] - want) > 1e-9 * Math.max(1, Math.abs(want));
    });
    if (wrong.length) faults.push(`${name}: axis "${axis.title}" plots ${wrong.length} value(s) of another sign or size`);
  }
  // a timing (throughput, step or wall time) says on what it was measured
  const heading = [spec.title].flat().map(t => [t?.text ?? t, t?.subtitle].flat().join(' ')).join(' ');
  const timed = units.some(u => ['x', 'y'].some(c => /tokens\/s|throughput|step time|time \(s\)|seconds|\bms\b|wall/i
    .test(u.encoding[c]?.title || u.encoding[c]?.field || '')));
  if (timed && !/\b(CPU|GPU|H100|H200|A100)\b/.test(heading + ' ' + caption))
    faults.push(`${name}: a timing that does not say the device it ran on`);
  for (const legend of svg.querySelectorAll('g.role-legend')) {
    const entries = [...legend.querySelectorAll('g.role-legend-symbol path')].map((p, i) => ({p,
      label: legend.querySelectorAll('g.role-legend-label text')[i]?.textContent || ''}));
    // no paint, or the page's own white: nothing a reader sees
    const none = v => !v || ['none', 'transparent', 'white', '#fff', '#ffffff', 'rgb(255, 255, 255)'].includes(v.toLowerCase());
    for (const e of entries) {
      const b = e.p.getBoundingClientRect(), a = n => e.p.getAttribute(n);
      if ((b.width < 1 && b.height < 1) || (none(a('fill')) && none(a('stroke'))) || a('opacity') === '0' ||
          (a('fill-opacity') === '0' && (none(a('stroke')) || a('stroke-opacity') === '0')))
        faults.push(`${name}: legend entry "${e.label}" has no symbol`);
    }
    const look = e => [e.p.getAttribute('d'), e.p.getAttribute('fill'), e.p.getAttribute('stroke'),
                       e.p.getAttribute('stroke-dasharray'), e.p.getAttribute('opacity')].join('|');
    const predicted = entries.filter(e => /predict|model|theory|\u03b1-\u03b2/i.test(e.label));
    const measured = entries.filter(e => /measur/i.test(e.label));
    for (const p of predicted) for (const m of measured)
      if (look(p) === look(m)) faults.push(`${name}: legend entries "${p.label}" and "${m.label}" are drawn alike`);
  }
  return faults;
}"""


def inspect(html: Path, timeout_s: float = 60.0) -> dict:
    """Facts of `html` as Chromium renders it, plus every request it made and every error it logged."""
    # Chromium's helper processes may still write to the profile as it is removed: they are killed
    # with the browser (its own process group), and a file left behind does not fail the check.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        # Every host name resolves to nothing: a request is still seen (and fails the check), at once,
        # instead of waiting on DNS on an offline machine.
        proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--window-size=1400,900",  # the reader's screen the report is judged on
                                 "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-port=0",
                                 f"--user-data-dir={profile}", "about:blank"],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            port = _devtools_port(proc, timeout_s)
            return asyncio.run(_inspect(port, html.resolve().as_uri(), timeout_s))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _devtools_port(proc: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if match := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
            return int(match.group(1))
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("chromium did not start its DevTools endpoint")


async def _inspect(port: int, url: str, timeout_s: float) -> dict:
    from tornado.websocket import websocket_connect

    targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list").read())
    page = next(t for t in targets if t["type"] == "page")
    ws = await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=64 * 2**20)
    ids, requests, errors, loaded = iter(range(1, 10**6)), [], [], asyncio.Event()
    replies: dict[int, asyncio.Future] = {}

    async def listen():
        while (message := await ws.read_message()) is not None:
            event = json.loads(message)
            if "id" in event and event["id"] in replies:
                replies.pop(event["id"]).set_result(event.get("result", {}))
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                requests.append(params["request"]["url"])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                errors.append(params["entry"]["text"])
            elif method == "Page.loadEventFired":
                loaded.set()

    async def call(method: str, **params):
        reply = asyncio.get_running_loop().create_future()
        replies[message_id := next(ids)] = reply
        await ws.write_message(json.dumps({"id": message_id, "method": method, "params": params}))
        return await asyncio.wait_for(reply, timeout_s)

    listener = asyncio.create_task(listen())
    for domain in ("Network", "Runtime", "Log", "Page"):
        await call(f"{domain}.enable")
    await call("Page.navigate", url=url)
    await asyncio.wait_for(loaded.wait(), timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:  # charts draw asynchronously after the load event
        expression = PAGE_FACTS.replace("CHART_FAULTS_FUNCTION", CHART_FAULTS + CLAIM_FAULTS)
        facts = (await call("Runtime.evaluate", expression=expression, returnByValue=True))["result"]["value"]
        if facts["drawn"] == facts["charts"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    ws.close()
    listener.cancel()
    return dict(facts, requests=requests, errors=errors)
