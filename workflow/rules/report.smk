# Stage 5: render reports/report.qmd (reads only tables) to HTML, with Quarto if on PATH,
# else the documented jupytext + nbclient + nbconvert fallback.


rule render_report:
    input:
        tables=lambda w: REPORT_INPUTS,
        qmd=f"{workflow.basedir}/reports/report.qmd",
        sections=glob.glob(f"{workflow.basedir}/reports/sections/*.qmd"),
        code=report_sources(),
    output:
        html=report(
            f"{RESULTS}/report/report.html",
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        title=config.get("report", {}).get("title", "shardlab study report"),
    shell:
        "python -m shardlab render-report --qmd {input.qmd} --out-dir {params.out}"
        " --title {params.title:q} {input.tables} 2>&1 | tee {log}"
