"""Render reports/report.qmd to HTML: `quarto render` when Quarto is on PATH, else a fallback.

The fallback executes the same .qmd without Quarto: includes are expanded, jupytext's Rmd reader
turns ```{python} chunks into notebook cells, nbclient runs them, nbconvert exports HTML with the
inputs hidden per `#| echo: false` / `#| include: false`. Quarto-only features (cross-references,
callouts, tabsets) are not used by the report so both renderers give the same content.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from shardlab import cli
from shardlab.tables import has_columns

INCLUDE = re.compile(r"^\{\{<\s*include\s+(\S+)\s*>\}\}\s*$", re.MULTILINE)
REQUIRES = re.compile(r"^<!--\s*requires:(.*?)-->", re.MULTILINE)
FALLBACK = "fallback (jupytext + nbclient + nbconvert; quarto not on PATH)"


def stage(qmd: Path, out_dir: Path, tables: set[str]) -> Path:
    """Copy the report and its sections next to the outputs (the report runs in out_dir and reads
    ../tables); a section whose `<!-- requires: ... -->` tables this study did not make becomes its
    heading and a line saying what the study lacks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = qmd.parent / "sections"
    if sections.is_dir():
        shutil.copytree(sections, out_dir / "sections", dirs_exist_ok=True)

    def keep_or_skip(match: re.Match) -> str:
        section = (qmd.parent / match.group(1)).read_text()
        required = REQUIRES.match(section)
        missing = set(required.group(1).split()) - tables if required else set()
        if missing:
            print(f"section {match.group(1)} not drawn: this study has no {', '.join(sorted(missing))}")
            return lacking(section, missing)
        return match.group(0)

    staged = out_dir / qmd.name
    staged.write_text(INCLUDE.sub(keep_or_skip, qmd.read_text()))
    return staged


def lacking(section: str, missing: set[str]) -> str:
    """A section's heading and what this study did not produce for it, in place of the section."""
    heading = next((line for line in section.splitlines() if line.startswith("## ")), "## (untitled section)")
    names = ", ".join(name.removesuffix(".csv").replace("_", " ") for name in sorted(missing))
    return f"{heading}\n\nNot drawn: this study produced no data for it (missing tables: {names}).\n"


def made_tables(paths) -> set[str]:
    """The names of the tables a study made: a table without columns (`tables.has_columns`) is none."""
    return {Path(p).name for p in paths if Path(p).is_file() and has_columns(p)}


def expand_includes(text: str, base: Path) -> str:
    """Inline `{{< include path >}}` lines (Quarto's include shortcode), recursively."""
    return INCLUDE.sub(lambda m: expand_includes((base / m.group(1)).read_text(), (base / m.group(1)).parent), text)


def _cell_options(source: str) -> dict[str, str]:
    return dict(re.findall(r"^#\|\s*([\w-]+):\s*(.+?)\s*$", source, re.MULTILINE))


def render_fallback(qmd: Path, title: str) -> Path:
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    notebook = jupytext.reads(expand_includes(qmd.read_text(), qmd.parent), fmt="Rmd")
    notebook.cells = [c for c in notebook.cells if c.cell_type != "raw"]  # the YAML header
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell(f"# {title}"))
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        options = _cell_options(cell.source)
        tags = cell.metadata.setdefault("tags", [])
        if options.get("include") == "false":
            tags.append("remove_cell")
        elif options.get("echo", "false") == "false":  # the report's default: results, not code
            tags.append("remove_input")
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(qmd.parent)}}).execute()
    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(Path(__file__).parent / "templates")])
    exporter.register_preprocessor(TagRemovePreprocessor(remove_cell_tags={"remove_cell"},
                                                         remove_input_tags={"remove_input"}), enabled=True)
    exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    notebook.metadata["title"] = title
    body, _ = exporter.from_notebook_node(notebook)
    html = qmd.with_suffix(".html")
    html.write_text(table_of_contents(body))
    return html


# The contents stay in view at the left, so the first screen holds the title, abstract and verdicts.
SIDE_TOC_STYLE = ("<style>#TOC{position:fixed;top:0;left:0;width:270px;height:100vh;overflow-y:auto;"
                  "box-sizing:border-box;padding:1em;font-size:0.85em;border-right:1px solid #ddd;"
                  "background:#fafafa}body{margin-left:290px !important}</style>")


def table_of_contents(html: str) -> str:
    """Insert a table of contents of the section headings after the title, as Quarto's `toc: true`
    does (same element id, `TOC`), with links to nbconvert's heading anchors; it is drawn as a
    fixed side panel."""
    heads = re.findall(r'<h([23]) id="([^"]+)"[^>]*>(.*?)<a class="anchor-link"', html, re.DOTALL)
    if not heads or "</h1>" not in html:
        return html
    items = "".join(f'<li style="margin-left:{(int(level) - 2) * 1.5}em"><a href="#{anchor}">{text.strip()}</a></li>'
                    for level, anchor, text in heads)
    nav = f'<nav id="TOC"><strong>Contents</strong><ul style="list-style:none;padding-left:0">{items}</ul></nav>'
    html = html.replace("</head>", SIDE_TOC_STYLE + "</head>", 1)
    return html.replace("</h1>", "</h1>" + nav, 1)


def render(qmd: Path, out_dir: Path, title: str, tables: set[str]) -> tuple[Path, str]:
    staged = stage(qmd, out_dir, tables)
    renderer = "quarto" if shutil.which("quarto") else FALLBACK
    (out_dir / "renderer.txt").write_text(renderer + "\n")  # before rendering: the report states it
    if renderer == "quarto":
        subprocess.run(["quarto", "render", staged.name, "--to", "html"], cwd=out_dir, check=True)
        html = staged.with_suffix(".html")
    else:
        html = render_fallback(staged, title)
    return html, renderer


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab render-report", description=__doc__)
    parser.add_argument("--qmd", type=cli.existing_file, default=Path("reports/report.qmd"))
    parser.add_argument("--out-dir", type=Path, default=Path("results/report"))
    parser.add_argument("--title", default="shardlab study report")
    parser.add_argument("tables", type=cli.existing_file, nargs="*", help="the tables this study made (default: all in ../tables)")
    args = parser.parse_args(argv)
    tables = args.tables or list((args.out_dir / ".." / "tables").glob("*.csv"))
    html, renderer = render(args.qmd.resolve(), args.out_dir.resolve(), args.title, made_tables(tables))
    print(f"report rendered with {renderer} -> {html}")
    return 0
