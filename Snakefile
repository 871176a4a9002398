# shardlab: one DAG from model to rendered report.
#   snakemake --cores all                      # embedded CPU study (config/config.yaml)
#   snakemake --cores all --profile runpod     # multi-GPU pod (profiles/runpod, config/runpod.yaml)
from snakemake.utils import min_version

min_version("8.20")


# The planner's scenarios, shared by every study (config/planning.yaml).
configfile: "config/planning.yaml"


# The embedded default study, unless a --configfile replaces it (e.g. config/test.yaml).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


wildcard_constraints:
    exp="[A-Za-z0-9_-]+",
    strategy="[a-z0-9_]+",
    model="[A-Za-z0-9_.-]+",
    corpus="[A-Za-z0-9_.-]+",


include: "workflow/rules/prepare.smk"
include: "workflow/rules/run.smk"
include: "workflow/rules/runs.smk"
include: "workflow/rules/data_parallel.smk"
include: "workflow/rules/zero.smk"
include: "workflow/rules/tensor_parallel.smk"
include: "workflow/rules/communication.smk"
include: "workflow/rules/context_expert.smk"
include: "workflow/rules/pipeline.smk"
include: "workflow/rules/composed.smk"
include: "workflow/rules/science.smk"
include: "workflow/rules/verdicts.smk"
include: "workflow/rules/predictions.smk"
include: "workflow/rules/planning.smk"
include: "workflow/rules/guide.smk"
include: "workflow/rules/abstract.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.render_report.output.html,


# Under a cluster executor (profiles/slurm, profiles/kubernetes) only the jobs that compute are
# submitted: runs, benchmarks, model and data preparation, evaluation. The rest read tables or copy
# small files and run where snakemake runs.
LOCAL_RULES = (
    "all",
    "render_report",
    "experiment_settings",
    "share_reference",
    "science_splits",
)
workflow.localrules(*(r.name for r in workflow.rules if r.name.endswith("_tables") or r.name in LOCAL_RULES))
