"""The fallback renderer's own additions to nbconvert's page (the whole report is rendered in the
end-to-end test)."""

from shardlab.reporting.render import table_of_contents

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
