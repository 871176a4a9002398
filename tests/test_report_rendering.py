"""The fallback renderer's own additions to nbconvert's page (the whole report is rendered in the
end-to-end test)."""

import pandas as pd

from shardlab.reporting.render import made_tables, stage, table_of_contents
from shardlab.tables import write_tables

PAGE = ('<h1 id="T">Title<a class="anchor-link" href="#T">¶</a></h1><p>x</p>'
        '<h2 id="A">Part A<a class="anchor-link" href="#A">¶</a></h2><h3 id="A1">Detail<a class="anchor-link" '
        'href="#A1">¶</a></h3><h2 id="B">Part B<a class="anchor-link" href="#B">¶</a></h2>')


def test_the_table_of_contents_lists_sections_in_order_after_the_title():
    html = table_of_contents(PAGE)
    nav = html[html.index('<nav id="TOC">'):html.index("</nav>")]
    assert html.index("</h1>") < html.index('<nav id="TOC">')
    assert [part.split('"')[0] for part in nav.split('href="#')[1:]] == ["A", "A1", "B"]
    assert "Title" not in nav


def test_a_page_without_sections_is_left_alone():
    assert table_of_contents("<h1>Only</h1>") == "<h1>Only</h1>"


def test_a_section_whose_tables_the_study_lacks_says_so_instead_of_failing(tmp_path):
    """A study with no single-device run writes an empty run_predictions.csv (no rows, no columns):
    the predictions section is then a heading and what is missing, not a chunk that cannot parse it."""
    src, out, tables = tmp_path / "reports", tmp_path / "out" / "report", tmp_path / "out" / "tables"
    (src / "sections").mkdir(parents=True)
    tables.mkdir(parents=True)
    (src / "sections" / "a.qmd").write_text("<!-- requires: a.csv -->\n## Section A\n\n```{python}\nA\n```\n")
    (src / "sections" / "b.qmd").write_text("<!-- requires: b.csv -->\n## Section B\n\n```{python}\nB\n```\n")
    (src / "report.qmd").write_text("# T\n\n{{< include sections/a.qmd >}}\n\n{{< include sections/b.qmd >}}\n")
    write_tables({"a": pd.DataFrame({"x": [1]}), "b": pd.DataFrame()}, tables)  # the writer the rules use
    assert (tables / "b.csv").read_text().strip() == ""  # what it writes for a table without columns

    staged = stage(src / "report.qmd", out, made_tables(tables.glob("*.csv"))).read_text()
    assert "{{< include sections/a.qmd >}}" in staged
    assert "include sections/b.qmd" not in staged
    assert "## Section B\n\nNot drawn: this study produced no data for it (missing tables: b)." in staged


def test_every_strategy_has_its_own_colour_in_its_familys_hue():
    """More strategies than any fixed palette has colours (the registry and the study's composed variants):
    a hue per family and a shade per member keep every one distinct and every family recognisable."""
    import colorsys

    from shardlab.reporting.charts import strategy_colors
    from shardlab.strategies import REGISTRY
    from shardlab.tables.mechanisms import strategies

    table = strategies(["composed_dp2_tp2_pp2_zero1", "composed_moe_ep2_tp2sp", "composed_tp2_cp2"])
    scale = strategy_colors(table)(table).to_dict()["scale"]
    colour = dict(zip(scale["domain"], scale["range"]))
    assert len(table) > 20 and len(set(colour.values())) == len(colour) == len(table)
    hue = {name: round(colorsys.rgb_to_hls(*(int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)))[0] * 360)
           for name, c in colour.items()}
    for family, members in table.groupby("family")["strategy"]:
        hues = [hue[name] for name in members]
        assert max(hues) - min(hues) <= 3 or family == "baseline", family  # greys have no hue
    assert hue["tp"] != hue["ddp"] and REGISTRY["composed_tp2_cp2"].family.value == "hybrid"


def test_distinct_colours_never_repeat_however_many_categories():
    from shardlab.reporting.charts import distinct_colours

    for n in (1, 2, 21, 40):  # 21: the communication chart's calls, past category20
        assert len(set(distinct_colours(n))) == n


def test_prose_names_strategies_by_their_titles_and_other_code_names_in_words():
    from shardlab.reporting import charts
    from shardlab.tables.mechanisms import strategies

    charts.use_titles(strategies(["composed_dp2_tp2_pp2_zero1"]))
    assert charts.readable("ddp beats dp_naive in data_parallel; composed_dp2_tp2_pp2_zero1, zero3, tp and `tp_sp`") == (
        "DDP beats naive DP in data parallel; plan dp2 tp2 pp2 zero1, ZeRO-3, TP and `tp_sp`")  # a code span stays code
    assert charts.readable("tp8+sp pp16") == "tp8+sp pp16"  # plan notation is not a name
