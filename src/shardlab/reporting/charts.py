"""Chart helpers for the report: offline-safe Altair output and PNG/SVG files beside the HTML."""

from __future__ import annotations

import html
import json
import re
import uuid
from pathlib import Path

import altair as alt

FIGURES = Path("figures")
IDENTIFIER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
MIB = 1024**2
_bundle_sent = False


def _offline_html(spec: dict, **_metadata) -> dict:
    """Altair renderer: the Vega bundle (vl-convert's, ~0.9 MB) is inlined ONCE per report, and each
    chart is a div plus a scoped embed call. Altair's own "inline" template repeats the bundle in
    every chart, and its top-level `const`s collide when several charts share one page. SVG, not
    canvas: a chart's marks and labels are then elements a browser test can measure."""
    global _bundle_sent
    import vl_convert

    div = f"chart-{uuid.uuid4().hex[:12]}"
    page = ""
    if not _bundle_sent:
        page += f'<script type="text/javascript">{vl_convert.javascript_bundle()}</script>\n'
        _bundle_sent = True
    page += (f'<div id="{div}"></div>\n<script type="text/javascript">(function () {{'
             f' vegaEmbed("#{div}", {json.dumps(spec)}, {{"mode": "vega-lite", "actions": false, "renderer": "svg"}})'
             f'.catch(console.error); }})();</script>')
    return {"text/html": page}


def _theme() -> alt.theme.ThemeConfig:
    """20 distinguishable colours (Vega's default has 10, and the study has 23 strategies), and labels
    long enough for every run's name."""
    # Run names such as composed_dp2_cp2_fsdp2_grad_op are long: labels get the room to show whole.
    return alt.theme.ThemeConfig({"config": {"range": {"category": {"scheme": "tableau20"}},
                                             "axis": {"labelLimit": 360}, "legend": {"labelLimit": 360}}})


def setup() -> None:
    """Render charts offline (Vega inlined once), with a palette for 20 categories, and drop
    Altair's 5,000-row limit."""
    alt.renderers.register("shardlab_offline", _offline_html)
    alt.renderers.enable("shardlab_offline")
    alt.theme.register("shardlab", enable=True)(_theme)
    alt.data_transformers.disable_max_rows()


class Figure:
    """A chart as a numbered figure: the chart, then "Figure N." and its caption (by default the
    chart's title), as one HTML figure element the report and its browser test can count."""

    count = 0

    def __init__(self, chart: alt.TopLevelMixin, caption: str | None):
        Figure.count += 1
        self.chart, self.number = chart, Figure.count
        self.caption = caption or _title(chart.to_dict())

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.chart._repr_mimebundle_(include, exclude)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        # Names of runs, experiments and metrics (snake_case) read as names: set as code.
        caption = IDENTIFIER.sub(r"<code>\g<0></code>", html.escape(str(self.caption)))
        return {"text/html": f'<figure class="shardlab-figure" id="figure-{self.number}">{data["text/html"]}'
                             f"<figcaption><b>Figure {self.number}.</b> {caption}</figcaption></figure>"}


def _title(spec: dict) -> str:
    """A chart's title as text: its own, else its parts' (a layered chart titles a layer, a
    concatenation each of its panels)."""
    title = spec.get("title", "")
    title = title.get("text", "") if isinstance(title, dict) else title
    if title:
        return " — ".join(title) if isinstance(title, list) else title
    parts = [_title(part) for key in ("layer", "hconcat", "vconcat", "concat") for part in spec.get(key, [])]
    return next((p for p in parts if p), "") if "layer" in spec else "; ".join(p for p in parts if p)


def save_chart(chart: alt.TopLevelMixin, name: str, caption: str | None = None) -> Figure:
    """Write figures/<name>.png and .svg (vl-convert, offline) and return the chart as the report's
    next numbered figure; `caption` leads with what the figure shows (default: the chart's title)."""
    FIGURES.mkdir(exist_ok=True)
    chart.save(str(FIGURES / f"{name}.svg"))
    chart.save(str(FIGURES / f"{name}.png"))  # scale 2 costs ~0.8 s per chart, scale 1 ~0.1 s
    return Figure(chart, caption)


COLLAPSE_ROWS = 12  # a longer table is folded: the reader opens it when wanted, the page stays short


def show_table(frame, floatfmt: str = ".4g") -> None:
    """A table in the rendered report (column names must not contain '|'); a missing value shows as a
    dash, never as "nan". A table longer than COLLAPSE_ROWS is folded under a line giving its size."""
    from IPython.display import HTML, Markdown, display

    if len(frame) > COLLAPSE_ROWS:
        body = frame.to_html(index=False, na_rep="–", border=0,
                             float_format=lambda v: format(v, floatfmt), classes="shardlab-table")
        display(HTML(f"<details><summary>Table: {len(frame)} rows</summary>{body}</details>"))
        return
    shown = frame.astype(object).where(frame.notna(), None)
    display(Markdown(shown.to_markdown(index=False, floatfmt=floatfmt, missingval="–")))
