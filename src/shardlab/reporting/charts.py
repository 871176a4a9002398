"""Chart helpers for the report: offline-safe Altair output and PNG/SVG files beside the HTML."""

from __future__ import annotations

import colorsys
import html
import json
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import altair as alt

from shardlab.reporting.captions import device_note
from shardlab.tables import read_table  # noqa: F401  (the pages read tables through the reporting package)

if TYPE_CHECKING:
    import pandas as pd

FIGURES = Path("figures")
# A name from the code: snake_case (a run, an experiment, a column), or a strategy named in one word.
CODE_NAME = re.compile(r"\b(?:ddp|tp|zero[0-3]|[a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")
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
             f'.then(r => {{ document.getElementById("{div}").vegaLite = r.spec; }})'  # for the browser test's checks
             f'.catch(console.error); }})();</script>')
    return {"text/html": page}


def _theme() -> alt.theme.ThemeConfig:
    """20 distinguishable colours (Vega's default has 10, and the study has 23 strategies), and labels
    long enough for every run's name."""
    # Run names such as composed_dp2_cp2_fsdp2_grad_op are long: labels get the room to show whole.
    return alt.theme.ThemeConfig({"config": {"range": {"category": {"scheme": "tableau20"}},
                                             "axis": {"labelLimit": 360}, "legend": {"labelLimit": 360}}})


_device_note: list[str] = []  # what the timings were measured on (setup, from the environments and runs tables)


def use_titles(strategies: pd.DataFrame) -> None:
    """Prose names each strategy by its title in the strategies table (the registry's)."""
    if "title" in strategies:
        _titles.update(zip(strategies["strategy"], strategies["title"]))


def setup(strategies: pd.DataFrame | None = None, environments: pd.DataFrame | None = None,
          runs: pd.DataFrame | None = None) -> None:
    """Render charts offline (Vega inlined once), with a palette for 20 categories, and drop
    Altair's 5,000-row limit; prose names strategies by the titles of the strategies table, and timed
    charts say what they were timed on (environments and runs tables)."""
    if strategies is not None:
        use_titles(strategies)
    if environments is not None and runs is not None:
        _device_note[:] = [device_note(environments, runs)]
    alt.renderers.register("shardlab_offline", _offline_html)
    alt.renderers.enable("shardlab_offline")
    alt.theme.register("shardlab", enable=True)(_theme)
    alt.data_transformers.disable_max_rows()
    from IPython import get_ipython
    from IPython.display import HTML, display

    display(HTML(STYLE))
    if shell := get_ipython():  # pointers gathered in a cell are shown as one line at its end
        shell.events.register("post_execute", _show_pointers)
        _pointers_deferred[0] = True


# Pointers to the appendix and folded method notes: one tight line each, so the main body stays short.
# The fallback renderer (nbconvert) pads every cell and output as if code were shown: tighten it.
STYLE = ("<style>.shardlab-appendix-ref{margin:0.1em 0;font-size:0.85em;color:#555}"
         ".jp-Cell,.jp-OutputArea-output{padding-top:0 !important;padding-bottom:0 !important}"
         "details.shardlab-method{margin:0.3em 0;font-size:0.9em}"
         "details.shardlab-method>summary{cursor:pointer;color:#555}</style>")


# A hue per family (the baseline grey), a shade per member: every strategy its own colour, the same in
# every chart, and a family recognisable at a glance. Hues in degrees; families not listed take the last.
FAMILY_HUES = {"baseline": None, "data parallel": 215, "zero": 30, "tensor parallel": 120, "pipeline parallel": 275,
               "context parallel": 180, "expert parallel": 55, "hybrid": 350}
LIGHTNESS = (0.32, 0.72)  # the darkest and the lightest shade of a family


def hls_hex(hue: float, light: float, saturation: float) -> str:
    return "#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hls_to_rgb(hue / 360, light, saturation))


def distinct_colours(n: int) -> list[str]:
    """n colours, none twice, however many categories a chart has (a fixed scheme cycles): hues evenly
    around the wheel, alternately dark and light."""
    return [hls_hex(360 * i / n, (0.38, 0.62)[i % 2], 0.6) for i in range(n)]


def family_shades(members: list[str], hue: float | None) -> dict[str, str]:
    """`members` (in order) to distinct shades of `hue`, dark to light (grey for None)."""
    low, high = LIGHTNESS
    steps = [low + (high - low) * i / max(1, len(members) - 1) for i in range(len(members))]
    saturation = 0.0 if hue is None else 0.65
    return {name: hls_hex(hue or 0, light, saturation) for name, light in zip(members, steps)}


def strategy_colors(strategies: pd.DataFrame):
    """`color(frame, field)`: the colour of each strategy of the `strategies` table (strategy, family, in the
    registry's order, then the variants the study ran): its family's hue, a shade by its place in the family;
    the legend lists only the strategies a chart draws. A name outside the table is grey."""
    families = dict(zip(strategies["strategy"], strategies["family"]))
    palette: dict[str, str] = {}
    for family in dict.fromkeys(families.values()):
        members = [name for name, of in families.items() if of == family]
        palette |= family_shades(members, FAMILY_HUES.get(family, FAMILY_HUES["hybrid"]))

    def color(frame, field: str = "strategy") -> alt.Color:
        drawn = set(frame[field].dropna())
        domain = [*palette, *sorted(drawn - set(palette))]
        return alt.Color(f"{field}:N", scale=alt.Scale(domain=domain, range=[palette.get(n, "#999999") for n in domain]),
                         legend=alt.Legend(values=[name for name in domain if name in drawn]))

    return color


class Figure:
    """A chart as a numbered figure: the chart, then "Figure N." (or "Figure AN." in the appendix) and
    its caption (by default the chart's title), as one HTML figure element the report and its browser
    test can count."""

    count = 0

    def __init__(self, chart: alt.TopLevelMixin, caption: str | None, label: str | None = None):
        if label is None:
            Figure.count += 1
        self.chart, self.label = chart, label or str(Figure.count)
        self.caption = caption or _title(chart.to_dict())

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.chart._repr_mimebundle_(include, exclude)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        caption = readable(html.escape(str(self.caption)))
        return {"text/html": f'<figure class="shardlab-figure" id="figure-{self.label.lower()}">{data["text/html"]}'
                             f"<figcaption><b>Figure {self.label}.</b> {caption}</figcaption></figure>"}


def _title(spec: dict) -> str:
    """A chart's title as text: its own, else its parts' (a layered chart titles a layer, a
    concatenation each of its panels)."""
    title = spec.get("title", "")
    title = title.get("text", "") if isinstance(title, dict) else title
    if title:
        return " — ".join(title) if isinstance(title, list) else title
    parts = [_title(part) for key in ("layer", "hconcat", "vconcat", "concat") for part in spec.get(key, [])]
    return next((p for p in parts if p), "") if "layer" in spec else "; ".join(p for p in parts if p)


def save_chart(chart: alt.TopLevelMixin, name: str, caption: str | None = None, appendix: bool = False,
               timed: bool = False) -> Figure | None:
    """Write figures/<name>.png and .svg (vl-convert, offline) and return the chart as the report's
    next numbered figure; `caption` leads with what the figure shows (default: the chart's title).
    With `appendix`, the figure is set aside for the appendix (show_appendix) and the text gets one
    line pointing to it; nothing is returned to display. A `timed` chart (throughput, step or wall time
    measured here) says in its caption what it was measured on (`device_note`)."""
    if timed and _device_note:
        caption = f"{caption or _title(chart.to_dict())}. {_device_note[0]}".replace(".. ", ". ")
    FIGURES.mkdir(exist_ok=True)
    chart.save(str(FIGURES / f"{name}.svg"))
    chart.save(str(FIGURES / f"{name}.png"))  # scale 2 costs ~0.8 s per chart, scale 1 ~0.1 s
    if not appendix:
        return Figure(chart, caption)
    figure = Figure(chart, caption, label=f"A{sum(isinstance(e, Figure) for e in _appendix) + 1}")
    _appendix.append(figure)
    _point_to(f"Figure {figure.label}", f"figure-{figure.label.lower()}", _first_sentence(figure.caption))
    return None


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[.:;])\s", str(text), maxsplit=1)[0].rstrip(".:;")


_pointers: list[str] = []  # what the running cell set aside, shown as one line when it ends
_pointers_deferred = [False]  # True once setup() has hooked the end of each cell


def _point_to(name: str, anchor: str, what: str) -> None:
    """Note something set aside in the appendix; a cell's notes become one line of text (_show_pointers)."""
    what = readable(html.escape(what))
    _pointers.append(f'<a href="#{anchor}">{name}</a>: {what}')
    if not _pointers_deferred[0]:  # outside a notebook (a script, a test): at once
        _show_pointers()


def _show_pointers() -> None:
    """One line for everything the cell set aside: "In the appendix: Table A2: …; Figure A1: …"."""
    from IPython.display import HTML, display

    if _pointers:
        display(HTML(f'<p class="shardlab-appendix-ref">In the appendix, {"; ".join(_pointers)}.</p>'))
        _pointers.clear()


COLLAPSE_ROWS = 12  # a longer table is folded: the reader opens it when wanted, the page stays short
_appendix: list = []  # set aside for the appendix, in order: a Figure, or a table as (number, title, rows, HTML)


def _table_html(frame, floatfmt: str) -> str:
    return frame.to_html(index=False, na_rep="–", border=0, float_format=lambda v: format(v, floatfmt),
                         classes="shardlab-table")


def show_table(frame, floatfmt: str = ".4g", appendix: str | None = None) -> None:
    """A table in the rendered report (column names must not contain '|'); a missing value shows as a
    dash, never as "nan". A table longer than COLLAPSE_ROWS is folded under a line giving its size.
    With `appendix` (its title, in plain words) the table is set aside for the report's appendix
    (show_appendix) and the text gets one line pointing to it: the main body stays short."""
    from IPython.display import HTML, Markdown, display

    if appendix:
        number = sum(not isinstance(e, Figure) for e in _appendix) + 1
        _appendix.append((number, appendix, len(frame), _table_html(frame, floatfmt)))
        _point_to(f"Table A{number}", f"table-a{number}", appendix)
        return
    if len(frame) > COLLAPSE_ROWS:
        display(HTML(f"<details><summary>Table: {len(frame)} rows</summary>{_table_html(frame, floatfmt)}</details>"))
        return
    shown = frame.astype(object).where(frame.notna(), None)
    display(Markdown(shown.to_markdown(index=False, floatfmt=floatfmt, missingval="–")))


def show_appendix() -> None:
    """Everything set aside by show_table(..., appendix=...) and save_chart(..., appendix=True), in the
    order the text pointed to it: figures drawn, tables folded."""
    from IPython.display import HTML, Markdown, display

    if not _appendix:
        display(Markdown("Nothing was set aside."))
    for entry in _appendix:
        if isinstance(entry, Figure):
            display(entry)
        else:
            n, title, rows, body = entry
            display(HTML(f'<details id="table-a{n}"><summary>Table A{n}. {html.escape(title)} ({rows} rows)</summary>'
                         f"{body}</details>"))


def show_method(text: str, summary: str = "How this is measured") -> None:
    """Method notes (markdown) folded under one line beside the result they explain: the main body
    stays short and the detail stays where a reader looks for it."""
    from IPython.display import HTML, display
    from markdown_it import MarkdownIt  # jupytext's markdown parser

    display(HTML(f'<details class="shardlab-method"><summary>{html.escape(summary)}</summary>'
                 f"{MarkdownIt().render(readable(text))}</details>"))


_titles: dict[str, str] = {}  # strategy -> the registry's title, from the strategies table (setup)


def readable(text: str) -> str:
    """Text with the code's names as a reader reads them: a strategy by its registry title (ddp: DDP, tp_sp:
    TP + SP, a composed plan by its degrees), any other snake_case name (an experiment, a column) in words.
    Code spans (backticks) stay as their author set them."""
    def name(match: re.Match) -> str:
        word = match.group(0)
        return _titles.get(word) or word.replace("_", " ")

    parts = re.split(r"(`+[^`]*`+)", str(text))  # odd parts are code spans
    return "".join(part if i % 2 else CODE_NAME.sub(name, part) for i, part in enumerate(parts))


def prose(text: str):
    """The report's computed markdown, in a reader's words (`readable`)."""
    from IPython.display import Markdown

    return Markdown(readable(text))
