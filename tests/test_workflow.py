"""The workflow end to end: lint, the DAG on the reduced config, failures recorded as data."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import REPO, TEST_EXPERIMENT, browser, with_experiments
from shardlab.strategies import REGISTRY


def snakemake(*args, timeout=1500):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_lint_is_clean():
    proc = snakemake("--lint")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Lints for" not in proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_the_workflow_is_formatted():
    """snakefmt (line length in pyproject.toml) leaves every rule file as it is."""
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "workflow"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_runpod_profile_resolves_from_repository_root():
    proc = snakemake("-n", "--cores", "all", "--profile", "runpod", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run_strategy" in proc.stdout


def test_workflow_runs_from_another_directory(tmp_path):
    """`--directory` elsewhere: data, code and report inputs resolve against the repository (as the
    config check does), and a data job reads the shipped file from there."""
    base = ["--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--configfile",
            str(REPO / "config" / "test.yaml")]
    proc = snakemake("-n", *base, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    proc = snakemake("results/science_biology/splits/manifest.json", "--cores", "1", *base, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    manifest = json.loads((tmp_path / "results/science_biology/splits/manifest.json").read_text())
    assert sum(part["rows"] for part in manifest["parts"].values()) > 0


def _run_job_requests(local: bool, monkeypatch) -> dict[str, tuple[int, int]]:
    """{strategy: (threads, gpus)} of the data_parallel runs, on a 64-core submit host with launch.device
    cuda and 3 threads per rank, under the local executor or (local=False) a cluster executor."""
    from types import SimpleNamespace

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings
    from snakemake.workflow import Workflow

    monkeypatch.setattr(Workflow, "local_exec", property(lambda self: local))
    monkeypatch.setattr("shardlab.strategies.available_cores", lambda: 64)
    overrides = {"defaults": {"launch": {"device": "cuda", "threads_per_rank": 3}}}
    with SnakemakeApi() as api:
        workflow = api.workflow(resource_settings=ResourceSettings(cores=64), snakefile=REPO / "Snakefile",
                                config_settings=ConfigSettings(configfiles=[REPO / "config/test.yaml"], config=overrides),
                                workdir=REPO)
        rule = workflow.dag().workflow_api._workflow.get_rule("run_strategy")
        requests = {}
        for strategy in ("single", "ddp"):
            wildcards = SimpleNamespace(exp="data_parallel", strategy=strategy)
            requests[strategy] = tuple(rule.resources[r].evaluate(wildcards).value for r in ("_cores", "gpu"))
    return requests


def test_run_jobs_request_what_they_use_and_gpus_for_cuda(monkeypatch):
    """Locally a run takes every core (runs never overlap); under a cluster executor it asks for ranks x
    threads_per_rank, never the submit host's core count, and one GPU per rank for cuda runs. The
    one-process run gets the threads of the experiment's widest run (equal cores for throughput)."""
    assert _run_job_requests(False, monkeypatch) == {"single": (2 * 3, 1), "ddp": (2 * 3, 2)}
    assert _run_job_requests(True, monkeypatch) == {"single": (64, 1), "ddp": (64, 2)}


@pytest.fixture(scope="module")
def reduced_study(tmp_path_factory) -> Path:
    """The whole DAG on config/test.yaml, once for the tests that read its results."""
    results = tmp_path_factory.mktemp("study") / "results"
    proc = snakemake("--cores", "2", "--nolock", "--configfile", "config/test.yaml", "--config",
                     f"results_dir={results}", f"resources_dir={results.parent / 'resources'}",
                     "allow_outside_project=True")  # Snakemake's --config parses True, not true
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return results


@pytest.mark.e2e
def test_dag_end_to_end_on_reduced_config(reduced_study):
    results = reduced_study
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    expected = {(exp, s) for exp, e in config["experiments"].items() for s in e["strategies"]}
    runs = pd.read_csv(results / "tables" / "runs.csv")
    assert set(zip(runs["experiment"], runs["strategy"])) == expected
    assert (runs["status"] == "ok").all(), runs[runs["status"] != "ok"][["strategy", "reason"]]
    steps = pd.read_csv(results / "tables" / "steps.csv")
    assert len(steps) == sum(config["defaults"]["training"]["steps"] if "training" not in e or "steps" not in e["training"]
                             else e["training"]["steps"] for e in config["experiments"].values() for _ in e["strategies"])

    html = (results / "report" / "report.html").read_text()
    assert html.count("vegaEmbed(\"#chart-") >= 5  # every chart embedded...
    assert html.count("window.vegaEmbed=") == 1  # ...with the Vega bundle inlined once (offline)
    assert 'id="TOC"' in html and 'href="#Choosing-a-parallelism"' in html  # a table of contents, either renderer
    assert 'id="Abstract"' in html and "training runs of" in html  # the computed abstract opens the report
    verdicts = pd.read_csv(results / "tables" / "verdicts.csv")
    assert set(verdicts["verdict"]) <= {"supported", "contradicted", "not decidable"} and len(verdicts) >= 7
    # The opening's summaries from the real writers' tables: the abstract says what carries over, the guide
    # holds each technique's measured shares and the planner's plans.
    abstract = " ".join(pd.read_csv(results / "tables" / "abstract.csv")["sentence"])
    assert "Memory per rank follows the cost model's accounting" in abstract and "the planner was not fitted to" in abstract
    guide = pd.read_csv(results / "tables" / "guide_techniques.csv")
    assert len(guide) >= 2 and guide["holds"].str.fullmatch(r"\d\.\d\d( · \d\.\d\d){3}").all(), guide["holds"]
    assert guide["communicates"].str.contains("MiB a step").all()
    assert len(pd.read_csv(results / "tables" / "guide_plans.csv")) == len(config["planning"]["scenarios"])
    # A checkpoint continued under other plans, as the rule and the table writer make it.
    resharding = pd.read_csv(results / "tables" / "resharding.csv").set_index("strategy")
    resumed = resharding[resharding["role"] == "resumed"]
    assert set(resumed.index) == set(config["resharding"]["resume_under"]) and (resumed["status"] == "ok").all()
    assert (resumed["from_step"] == config["resharding"]["at_step"]).all() and (resumed["written_by"] == "ddp").all()
    assert resumed["within_tolerance"].astype(bool).all() and resharding["within_reference_tolerance"].astype(bool).all()
    assert "continue the uninterrupted run&#x27;s losses within" in html or "continue the uninterrupted run's losses within" in html
    for figure in ("throughput", "memory_by_category", "parity_deviation", "dp_comm_time"):
        assert (results / "report" / "figures" / f"{figure}.png").stat().st_size > 1000
    renderer = (results / "report" / "renderer.txt").read_text()
    assert renderer.startswith("quarto") or renderer.startswith("fallback")


@pytest.mark.e2e
def test_the_planner_predicts_every_run_and_plans_at_scale(reduced_study):
    tables = reduced_study / "tables"
    runs = pd.read_csv(tables / "runs.csv")
    predicted = pd.read_csv(tables / "run_predictions.csv")
    assert set(zip(predicted["experiment"], predicted["strategy"])) == set(zip(runs["experiment"], runs["strategy"]))
    assert predicted["predicted_step_s"].gt(0).all() and predicted["predicted_activation_bytes"].gt(0).all()
    # Data-parallel replicas and the ZeRO ladder: the planner's model states are exact for any shape.
    replicas = predicted[predicted["strategy"].map(lambda s: REGISTRY[s].family in ("baseline", "data parallel", "zero"))]
    assert len(replicas) and replicas["model_states_error_pct"].abs().max() <= 1.0, replicas
    # One prediction per rank, written once by the runs step from the real summaries: every rank of every
    # run has its row, and the ranks table shows exactly those predicted bytes.
    per_rank = pd.read_csv(tables / "rank_predictions.csv")
    assert len(per_rank) == runs["world_size"].sum()
    ranks = pd.read_csv(tables / "ranks.csv").merge(per_rank, on=["experiment", "strategy", "rank"],
                                                    suffixes=("", "_written"), validate="one_to_one")
    for category in ("param", "grad", "optimizer"):
        column = f"predicted_{category}_bytes"
        assert ranks[column].equals(ranks[f"{column}_written"]), category
    scenarios = pd.read_csv(tables / "planning_scenarios.csv")
    assert len(scenarios) and scenarios["fitting"].gt(0).all() and scenarios["best_plan"].ne("none fits").all()
    assert "Planning at scale" in (reduced_study / "report" / "report.html").read_text()


@pytest.mark.e2e
def test_the_gpu_record_reads_what_the_study_writes(reduced_study):
    """The GPU check's record (tables.gpu_check) built from the tables the DAG wrote for one experiment, with
    the device named as torch names an H100 (the only edit): the planner is scored before and after its
    calibration on the single-device run, every figure survives the JSON file, and the report's table and
    caption read it back."""
    from shardlab.reporting.captions import gpu_measured
    from shardlab.tables import TableInputs, read_table
    from shardlab.tables.gpu_check import TABLES, record, table

    exp = "data_parallel"
    tables = {t: read_table(reduced_study / "tables" / f"{t}.csv") for t in TABLES}
    tables = {t: f[f["experiment"] == exp] if "experiment" in f else f for t, f in tables.items()}
    tables["runs"] = tables["runs"].assign(**{"environment.device_name": "NVIDIA H100 80GB HBM3"})
    models = [json.loads(p.read_text()) for p in (reduced_study.parent / "resources").glob("models/*/shardlab_model.json")]
    inputs = TableInputs(experiments={exp: json.loads((reduced_study / exp / "experiment.json").read_text())},
                         models={m["name"]: m for m in models}, tables=tables)
    rec = json.loads(json.dumps(record(inputs)))  # as reports/gpu/ keeps it: plain JSON, nothing as text
    rows = {r["strategy"]: r for r in rec["runs"]}
    assert set(rows) == set(tables["runs"]["strategy"]) and len(rows) >= 3
    assert rows["single"]["calibration_run"] and rows["single"]["planner_after_error"] == pytest.approx(0, abs=1e-9)
    ranks = tables["ranks"].set_index("strategy")
    for strategy, row in rows.items():
        assert isinstance(row["planner_before_error"], float) and isinstance(row["planner_after_error"], float)
        mine = ranks.loc[[strategy]]
        fullest = mine[mine["param_bytes"] == mine["param_bytes"].max()]
        assert (row["param_bytes"], row["peak_bytes"]) == (fullest["param_bytes"].max(), fullest["peak_bytes"].max())
        assert isinstance(row["activation_error"], float) and 0 < row["mfu"] < 1
    assert rows["ddp"]["within_tolerance"] is True
    shown = table([rec])
    assert list(shown["strategy"]) == list(rows) and gpu_measured(shown).startswith("On NVIDIA H100 80GB HBM3")


@pytest.mark.e2e
@pytest.mark.skipif(browser.CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's package "
                                                     "when apt can reach a mirror)")
def test_the_report_reads_right_in_a_browser(reduced_study):
    """What a reader sees in headless Chromium: every chart drawn, nothing fetched from the network,
    no console error, no raw markdown table, no "nan", no traceback or stderr output."""
    facts = browser.inspect(reduced_study / "report" / "report.html")
    assert facts["charts"] >= 5 and facts["drawn"] == facts["charts"], facts
    assert [u for u in facts["requests"] if not u.startswith("file:")] == [], facts["requests"]
    assert facts["errors"] == []
    assert (facts["raw_tables"], facts["nan_cells"], facts["tracebacks"], facts["stderr_outputs"]) == (0, 0, 0, 0)
    assert facts["toc_links"] >= 5
    assert facts["chart_faults"] == [], facts["chart_faults"]  # bars, facets and labels a reader can see
    assert facts["unnumbered_charts"] == 0  # every chart a numbered figure with a caption
    assert facts["prose_identifiers"] == []  # the prose above the appendix names things as a reader does
    assert facts["main_screens"] <= browser.SCREEN_BUDGET, facts["main_screens"]  # the rest is in the appendix


@pytest.mark.skipif(browser.CHROMIUM is None, reason="no chromium on PATH")
def test_the_browser_check_can_fail(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<html><body><script src="https://cdn.invalid/lib.js"></script><div id="chart-x"></div>'
                    '<table><tr><td>nan</td></tr></table><script>console.error("boom")</script>'
                    "<p>| a | b |</p><p>|---|---|</p><p>faster than dp_naive, as <code>ddp_twin</code>, see costs/plan.py</p>"
                    "<details><summary>How</summary><p>folded: hidden_name</p></details><pre>code_block_name</pre>"
                    f'<div style="height:{browser.SCREEN_BUDGET + 1}00vh"></div><h2>Appendix</h2>'
                    '<div style="height:300vh"></div></body></html>')
    facts = browser.inspect(page, timeout_s=5)  # the chart never draws: waits this long
    assert facts["charts"] == 1 and facts["drawn"] == 0 and facts["unnumbered_charts"] == 1
    # a name set as code is still a name in the prose; folded notes and code blocks are not read
    assert facts["prose_identifiers"] == ["dp_naive", "ddp_twin", "plan.py"]
    assert browser.SCREEN_BUDGET < facts["main_screens"] < facts["screens"] - 2  # the appendix is not counted
    assert any(u.startswith("https://cdn.invalid") for u in facts["requests"])
    assert any("boom" in e for e in facts["errors"])
    assert facts["nan_cells"] == 1 and facts["raw_tables"] == 1


@pytest.mark.skipif(browser.CHROMIUM is None, reason="no chromium on PATH")
def test_the_chart_checks_can_fail(tmp_path):
    """Each chart check flags what makes a drawn chart unreadable, and nothing in a sound chart: bars
    under 2 px thick, facets under 120 px wide, a label Vega shortened with an ellipsis, two entries of a
    colour legend in one colour. A box plot whose boxes are equally narrow (tight timings) is sound: its
    boxes are 14 px thick across the axis; so is a legend of shapes in one colour."""
    import altair as alt

    from shardlab.reporting import charts

    charts._bundle_sent = False  # this page needs its own copy of the Vega bundle
    bars = pd.DataFrame({"x": [f"b{i:03d}" for i in range(300)], "y": 1.0})
    sound = pd.DataFrame({"x": ["a", "b", "c"], "y": [1.0, 2.0, 3.0], "f": ["p", "q", "q"]})
    specs = [
        alt.Chart(bars).mark_bar().encode(x="x:N", y="y:Q").properties(width=200, title="hairline"),
        alt.Chart(sound).mark_bar().encode(x="x:N", y="y:Q").properties(width=60).facet("f:N").properties(
            title="narrow"),
        alt.Chart(sound.assign(c="a label much longer than the room its legend gives it")).mark_bar().encode(
            x="x:N", y="y:Q", color=alt.Color("c:N", legend=alt.Legend(labelLimit=60))).properties(title="shortened"),
        alt.Chart(sound).mark_bar().encode(x="x:N", y="y:Q").properties(width=200).facet("f:N").properties(
            title="sound"),
        alt.Chart(pd.DataFrame({"s": list("abc") * 8, "t": [0.01 + 1e-5 * (i // 3) for i in range(24)]})).mark_boxplot(
            size=14).encode(y="s:N", x=alt.X("t:Q", scale=alt.Scale(type="log", domain=[0.001, 1]))).properties(
            width=200, title="tight boxes"),
        alt.Chart(sound).mark_point().encode(x="x:N", y="y:Q", color=alt.Color(
            "x:N", scale=alt.Scale(domain=["a", "b", "c"], range=["#1f77b4", "#ff7f0e", "#1f77b4"]))).properties(
            title="one colour twice"),
        alt.Chart(sound).mark_point(color="black").encode(x="x:N", y="y:Q", shape="f:N").properties(title="shapes"),
    ]
    page = tmp_path / "charts.html"
    page.write_text("<html><body>" + "".join(charts._offline_html(s.to_dict())["text/html"] for s in specs)
                    + "</body></html>")
    facts = browser.inspect(page)
    assert facts["drawn"] == 7 and facts["errors"] == [], facts
    faults = facts["chart_faults"]
    assert any(f.startswith("hairline: bars") for f in faults), faults
    assert any(f.startswith("narrow: 2 facet(s) narrower than 120 px") for f in faults), faults
    assert any(f.startswith("shortened: text shortened") for f in faults), faults
    assert any(f.startswith('one colour twice: legend entries "a" and "c" share colour') for f in faults), faults
    assert not [f for f in faults if f.startswith(("sound", "tight boxes", "shapes"))], faults


@pytest.mark.skipif(browser.CHROMIUM is None, reason="no chromium on PATH")
def test_the_claim_checks_fail_a_chart_that_does_not_show_its_caption(tmp_path):
    """Each rule between what a chart says and what it draws flags a page built to break it, and passes the
    sound twin: a diagonal named but not drawn; a "vs m" chart with one m; an axis "after − before" whose rows
    are before − after (or that declares nothing); predicted and measured drawn alike; a legend without symbols;
    a timing that does not say what it ran on."""
    import altair as alt

    from shardlab.reporting import charts

    charts._bundle_sent = False
    points = pd.DataFrame({"measured": [1.0, 2.0, 3.0], "predicted": [1.1, 1.9, 3.2]})
    diagonal = alt.Chart(pd.DataFrame({"v": [1.0, 3.0]})).mark_line().encode(x="v:Q", y="v:Q")
    scatter = alt.Chart(points).mark_point().encode(x="measured:Q", y="predicted:Q")
    sweep = pd.DataFrame({"m": [4, 4, 4], "idle": [0.2, 0.3, 0.25], "run": ["a", "b", "c"]})
    taught = pd.DataFrame({"value": [0.4, 1.9], "baseline": [0.3, 4.0], "better": ["higher", "lower"]})
    right = taught.assign(gain=[0.1, 2.1])  # after − before, before − after where lower is better
    declared = {"difference": {"field": "gain", "after": "value", "before": "baseline",
                               "flip": {"field": "better", "value": "lower"}}}
    axis = alt.X("gain:Q", title="improvement: after − before")
    series = pd.DataFrame({"step": [1, 2, 1, 2], "bytes": [1.0, 2.0, 1.1, 2.1], "kind": ["predicted"] * 2 + ["measured"] * 2})
    specs = [
        scatter.properties(title="Predicted against measured: the diagonal is a perfect prediction"),
        (scatter + diagonal).properties(title="Sound: predicted against measured, the diagonal drawn"),
        alt.Chart(sweep).mark_line(point=True).encode(x="m:O", y="idle:Q").properties(title="Idle share vs m"),
        alt.Chart(sweep.assign(m=[2, 4, 8])).mark_line(point=True).encode(x="m:O", y="idle:Q").properties(
            title="Sound: idle share vs m"),
        alt.Chart(taught.assign(gain=[0.1, -2.1])).mark_point().encode(x=axis).properties(
            title="Reversed", usermeta=declared),
        alt.Chart(right).mark_point().encode(x=axis).properties(title="Undeclared"),
        alt.Chart(right).mark_point().encode(x=axis).properties(title="Sound: declared", usermeta=declared),
        alt.Chart(series).mark_line(point=True).encode(x="step:O", y="bytes:Q", color=alt.Color(
            "kind:N", scale=alt.Scale(range=["#1f77b4", "#1f77b4"]))).properties(title="Alike"),
        alt.Chart(series).mark_line(point=True).encode(x="step:O", y="bytes:Q", color="kind:N", strokeDash="kind:N",
                                                       shape="kind:N").properties(title="Sound: predicted dashed"),
        alt.Chart(series).mark_line().encode(x="step:O", y="bytes:Q", color=alt.Color(
            "kind:N", legend=alt.Legend(symbolOpacity=0))).properties(title="Blank legend"),
        alt.Chart(series).mark_point().encode(x="step:O", y="bytes:Q", shape="kind:N", color="step:N",
                                              fill=alt.value("white")).properties(title="White on white"),
        alt.Chart(sweep).mark_bar().encode(x="run:N", y=alt.Y("idle:Q", title="tokens/s")).properties(title="Speed"),
        alt.Chart(sweep).mark_bar().encode(x="run:N", y=alt.Y("idle:Q", title="tokens/s")).properties(
            title=alt.TitleParams("Sound: speed", subtitle="timed on CPU, 2 cores")),
    ]
    page = tmp_path / "claims.html"
    page.write_text("<html><body>" + "".join(charts._offline_html(s.to_dict())["text/html"] for s in specs)
                    + "</body></html>")
    faults = browser.inspect(page)["chart_faults"]
    for start in ("Predicted against measured: the diagonal is a perfect prediction: the caption names a diagonal",
                  'Idle share vs m: a chart "vs" m with 1 value(s)',
                  'Reversed: axis "improvement: after − before" plots 1 value(s) of another sign',
                  'Undeclared: axis "improvement: after − before" declares no difference',
                  'Alike: legend entries "predicted" and "measured" are drawn alike',
                  'Blank legend: legend entry "measured" has no symbol',
                  'White on white: legend entry',
                  'Speed: a timing that does not say the device'):
        assert any(f.startswith(start) for f in faults), (start, faults)
    assert not [f for f in faults if f.startswith("Sound")], faults


@pytest.mark.torchrun
def test_out_of_memory_is_recorded_and_partial_metrics_kept(run_strategy):
    summary, steps = run_strategy("dp_naive", {"training": {"fault_injection": "raise_oom"}})
    assert summary["status"] == "oom"
    assert "OutOfMemoryError" in summary["reason"]
    assert [s["step"] for s in steps] == [0]  # what was measured before the failure is kept


@pytest.mark.torchrun
def test_crash_is_recorded_with_reason(tiny_assets, tmp_path):
    from helpers import TEST_EXPERIMENT
    from shardlab.runner.launch import launch

    _, tokens = tiny_assets
    exp_path = tmp_path / "exp.json"
    exp_path.write_text(json.dumps(TEST_EXPERIMENT))
    summary = launch(TEST_EXPERIMENT, exp_path, "ddp", tmp_path / "no-such-model", tokens, tmp_path / "runs" / "ddp")
    assert summary["status"] == "failed"
    assert summary["reason"].startswith("rank ")
    assert json.loads((tmp_path / "runs" / "ddp" / "summary.json").read_text())["status"] == "failed"
    # Every attempt keeps its own folder, outside what Snakemake deletes on a rerun.
    assert [p.name for p in (tmp_path / "attempts" / "ddp").iterdir()] and Path(summary["attempt"]).is_dir()


def test_hub_model_offline_gives_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    spec = json.dumps({"name": "pythia-160m", "source": "hub", "hub_id": "EleutherAI/pythia-160m"})
    proc = subprocess.run([sys.executable, "-m", "shardlab", "prepare-model", "--model-json", spec, "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "could not download 'EleutherAI/pythia-160m'" in proc.stderr
    assert "model.source: local" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_corrupt_model_or_tokenizer_folder_is_named_in_the_error(tiny_assets, tmp_path):
    from shardlab.core.data import load_tokenizer
    from shardlab.core.model import load_model
    from shardlab.errors import ArtifactError

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_assets[0], model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # a download or copy cut short
    with pytest.raises(ArtifactError, match=f"cannot load the model in {model_dir}.*SafetensorError"):
        load_model(model_dir)
    with pytest.raises(ArtifactError, match=f"cannot load the tokenizer in {tmp_path / 'gone'}"):
        load_tokenizer(tmp_path / "gone")


@pytest.mark.torchrun
def test_a_run_on_a_corrupt_model_is_recorded_with_its_path(tiny_assets, tmp_path):
    from shardlab.runner.launch import launch

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_assets[0], model_dir)
    (model_dir / "config.json").write_text("{not json")
    exp_path = tmp_path / "exp.json"
    exp_path.write_text(json.dumps(TEST_EXPERIMENT))
    summary = launch(TEST_EXPERIMENT, exp_path, "single", model_dir, tiny_assets[1], tmp_path / "runs" / "single")
    assert summary["status"] == "failed"
    assert summary["reason"].startswith(f"rank 0: ArtifactError: cannot load the model in {model_dir}"), summary["reason"]


def _rule_inputs(rule: str, kind: str):
    """A rule's declared input `kind` of the reduced study (a list, or a function of the wildcards)."""
    return _all_rule_inputs(kind)[rule]


@functools.cache
def _all_rule_inputs(kind: str) -> dict:
    """Every rule's declared input `kind` (None where it declares none) of the reduced study."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings

    with SnakemakeApi() as api:
        workflow = api.workflow(resource_settings=ResourceSettings(cores=2), snakefile=REPO / "Snakefile",
                                config_settings=ConfigSettings(configfiles=[REPO / "config/test.yaml"]), workdir=REPO)
        rules = workflow.dag().workflow_api._workflow.rules
        return {rule.name: rule.input.get(kind) for rule in rules}


def _relative(files) -> set[str]:
    return {str(Path(f).relative_to(REPO / "src/shardlab")) for f in files}


def test_a_run_declares_the_code_it_executes():
    """Editing a strategy reruns the runs that import it only; editing the loop reruns every run."""
    from types import SimpleNamespace

    code = _rule_inputs("run_strategy", "code")
    files = {s: _relative(code(SimpleNamespace(strategy=s))) for s in ("single", "dp_naive", "zero2", "composed")}
    for strategy in files:
        assert {"runner/loop.py", "runner/worker.py", "core/model.py", "strategies/base.py"} <= files[strategy]
    assert "strategies/data_parallel/naive.py" in files["dp_naive"] and "strategies/zero/deepspeed.py" in files["zero2"]
    implementations = {"strategies/zero/deepspeed.py", "strategies/zero/fsdp2.py", "strategies/pipeline_parallel/pipeline.py"}
    assert not implementations & (files["dp_naive"] | files["single"])
    assert "strategies/single.py" in files["single"]
    # A composed run executes the techniques it composes, in their own families' packages.
    assert {"strategies/tensor_parallel/tensor_parallel.py", "strategies/pipeline_parallel/pipeline.py",
            "strategies/context_parallel/ring_attention.py", "strategies/zero/fsdp2.py"} <= files["composed"]


@pytest.mark.parametrize("rule, imported", [("verdicts_tables", "costs/sharded_states.py"),
                                            ("data_parallel_tables", "core/step_stats.py"),
                                            ("composed_tables", "costs/rank_memory.py"),
                                            ("render_report", "reporting/charts.py")])
def test_a_table_rule_declares_every_module_its_builder_imports(rule, imported):
    """Tables never go stale: a table rule's code inputs are its builder and everything it imports (the
    report's: its renderer and chart helpers), so an edit to any of them reruns the rule (Snakemake
    reruns a job whose input changed)."""
    assert imported in _relative(_rule_inputs(rule, "code"))


def _dry_run(root: Path) -> str:
    """Snakemake's dry run of the reduced study in `root`, judging staleness by modification times
    (the trigger a code edit fires); `root`'s own package on the path, so code inputs point into it."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", "--configfile", "config/test.yaml",
                           "--rerun-triggers", "mtime"], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root / "src")))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr


def _scheduled(dry_run: str) -> tuple[set[str], set[str]]:
    """(every rule with a job to run, the rules with a job scheduled because an input of its own changed
    on disk), from the jobs' `reason:` lines."""
    jobs, direct = set(), set()
    for block in re.split(r"^(?:local)?rule ", dry_run, flags=re.MULTILINE)[1:]:
        rule, reason = block.split(":", 1)[0], re.search(r"^\s*reason: (.*)$", block, re.MULTILINE)
        jobs.add(rule)
        if reason and "Updated input files" in reason.group(1):
            direct.add(rule)
    return jobs, direct


@pytest.fixture(scope="module")
def built_study_copy(tmp_path_factory) -> Path:
    """A copy of the repository in which every output of the reduced study exists and is newer than
    every source: Snakemake has nothing to do there, until a file is edited (a test that edits one
    puts it back as it was, time included)."""
    root = tmp_path_factory.mktemp("built") / "repo"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name, follow_symlinks=False)
    summary = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", "--configfile",
                              "config/test.yaml", "--summary"], cwd=root, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=str(root / "src")), check=True).stdout
    outputs = [line.split("\t")[0] for line in summary.splitlines()[1:] if line.count("\t") == 5]
    old = os.stat(REPO / "Snakefile").st_mtime - 3600
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, (old, old))
    for output in outputs:
        (root / output).parent.mkdir(parents=True, exist_ok=True)
        (root / output).touch()
        os.utime(root / output, (old + 60, old + 60))
    return root


@pytest.mark.parametrize("edited, untouched", [
    ("costs/zero_tree.py", {"runs_tables", "pipeline_tables", "science_tables"}),  # the ZeRO decision tree
    ("tables/runs.py", {"science_tables"}),  # a module tables/verdicts.py imports
    ("reporting/captions.py", {"runs_tables", "verdicts_tables", "science_tables"}),  # a module the report imports
])
def test_editing_a_module_reruns_exactly_the_tables_that_import_it(built_study_copy, edited, untouched):
    """Tables (and the report) never go stale, and nothing else reruns: in a built copy of the reduced study, an edit to a
    module schedules every rule whose code inputs hold it, and what reads their tables (down to the
    report); no run, no data preparation, and not the table rules that neither import it nor read what
    it changes. (Snakemake names the changed file as the reason only for a job with nothing rerun
    upstream: those must be importers.)"""
    root = built_study_copy
    assert "Nothing to be done" in _dry_run(root)
    importers = {rule for rule, code in _all_rule_inputs("code").items()
                 if isinstance(code, list) and edited in _relative(code)}
    assert importers and all(rule.endswith("_tables") or rule == "render_report" for rule in importers), importers

    source = root / "src/shardlab" / edited
    text, before = source.read_text(), source.stat()
    source.write_text(text + "\n# edited\n")
    try:
        jobs, direct = _scheduled(_dry_run(root))
    finally:
        source.write_text(text)
        os.utime(source, (before.st_atime, before.st_mtime))
    assert direct and direct <= importers, (direct, importers)
    assert {"render_report", *importers} <= jobs
    assert not jobs & {"run_strategy", "prepare_data", *untouched}, jobs


def _only(experiment: str):
    return lambda name, frame: frame[frame["experiment"] == experiment] if "experiment" in frame else frame


# Studies the config check accepts that lack parts of the default one, made from the reduced study's tables
# (the runs are the same; the report must say what each lacks instead of failing).
REDUCED = {
    "no science": lambda name, frame: None if name.startswith("science_") else frame,
    "no planner scenarios": lambda name, frame: None if name.startswith("planning_") else frame,
    "one family only": _only("tensor_parallel"),
    # As the table rules write it without a single-device run: the predictions table empty, no reference rows.
    "no single-device run": lambda name, frame: (frame.iloc[0:0] if name.startswith("run_prediction") else
                                                 frame[frame["strategy"] != "single"] if "strategy" in frame else frame),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", REDUCED)
def test_the_report_renders_for_a_reduced_study(case, reduced_study, tmp_path):
    from shardlab.reporting import render

    from shardlab.tables import read_table, write_tables

    tables = tmp_path / "results" / "tables"
    for path in (reduced_study / "tables").glob("*.csv"):
        kept = REDUCED[case](path.stem, read_table(path))
        if kept is not None:  # a topic with no rows is written as its rule writes it (write_tables)
            write_tables({path.stem: kept if len(kept) else pd.DataFrame()}, tables)
    assert render.main(["--qmd", str(REPO / "reports" / "report.qmd"), "--out-dir", str(tmp_path / "results" / "report")]) == 0
    html = (tmp_path / "results" / "report" / "report.html").read_text()
    assert "Traceback" not in html and 'id="Abstract"' in html
    assert "Not drawn: this study produced no data for it" in html  # the section that lacks its data says so


@pytest.mark.e2e
def test_a_study_of_sharded_data_parallelism_alone_renders(reduced_study, tmp_path):
    """ddp, zero3 and fsdp2_full with no single-device run, through the real DAG: its runs, every table rule
    (the predictions table has no reference to predict against) and the report."""
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config = with_experiments(config, {"sharded": {"strategies": ["ddp", "zero3", "fsdp2_full"]}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    proc = snakemake("--cores", "2", "--nolock", "--configfile", str(tmp_path / "config.yaml"), "--config",
                     f"results_dir={results}", f"resources_dir={reduced_study.parent / 'resources'}",
                     "allow_outside_project=True")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert (results / "tables" / "run_predictions.csv").read_text().strip() == ""  # written, without columns
    html = (results / "report" / "report.html").read_text()
    assert "Traceback" not in html and 'id="Abstract"' in html
