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
    chart_faults: charts.flatMap(chartFaults),
    unnumbered_charts: charts.filter(c => !/^Figure A?\\d+\\. \\S/.test(
      (c.closest('figure') || {querySelector: () => null}).querySelector('figcaption')?.textContent || '')).length,
    screens: document.documentElement.scrollHeight / window.innerHeight,
    // the main body: everything above the appendix (the whole page if there is none)
    main_screens: ([...document.querySelectorAll('h2')].find(h => h.textContent.startsWith('Appendix'))
      ?.getBoundingClientRect().top + window.scrollY || document.documentElement.scrollHeight) / window.innerHeight,
    // code identifiers in the prose a reader reads (code elements and tables aside)
    prose_identifiers: [...new Set([...document.querySelectorAll('p, li, figcaption, summary, h1, h2, h3, h4')]
      .flatMap(el => {
        const prose = el.cloneNode(true);
        prose.querySelectorAll('code, pre, table').forEach(c => c.remove());
        return prose.textContent.match(/\\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\\b/g) || [];
      }))],
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
        expression = PAGE_FACTS.replace("CHART_FAULTS_FUNCTION", CHART_FAULTS)
        facts = (await call("Runtime.evaluate", expression=expression, returnByValue=True))["result"]["value"]
        if facts["drawn"] == facts["charts"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    ws.close()
    listener.cancel()
    return dict(facts, requests=requests, errors=errors)
