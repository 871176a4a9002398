"""`python -m shardlab plan-zero`: the ZeRO decision tree (`costs.zero_tree`) over DeepSpeed's rungs
of the registry's ladder (`RUNGS`), predicted by the planner itself (so `plan evaluate` agrees).

    python -m shardlab plan-zero --model pythia-6.9b --hardware "A100-80GB SXM" --gpus 2
    python -m shardlab plan-zero --model pythia-6.9b --hardware "A100-80GB SXM" --gpus 2 --what-if hbm_gb=0.3
"""

from __future__ import annotations

from shardlab import cli
from shardlab.costs.planner import accelerator, what_if_overrides
from shardlab.costs.shapes import model_shape
from shardlab.costs.zero_tree import choose, cluster_of, ladder
from shardlab.strategies.zero import deepspeed_ladder

GB = 1e9


def plan(model, accelerator: str, gpus: int, seq_len: int = 2048, micro_batch: int = 1, host_memory_gb=None,
         overrides: dict | None = None, **kw) -> dict:
    rows = ladder(model, cluster_of(accelerator, gpus, host_memory_gb, overrides), seq_len, deepspeed_ladder(),
                  micro_batch, **kw)
    return {"choice": choose(rows), "rows": rows}


def render(result: dict, name: str, accelerator: str, gpus: int, seq_len: int, micro_batch: int) -> str:
    lines = [f"{name} on {gpus} x {accelerator}, one micro-batch of {micro_batch} x {seq_len} tokens per device, "
             "DeepSpeed (memory as `plan evaluate` predicts it)"]
    for r in result["rows"]:
        mark = "->" if r["rung"] == result["choice"] else "  "
        held = f"{r['device_bytes'] / GB:8.1f} GB of {r['usable_bytes'] / GB:.1f}" if "device_bytes" in r else " " * 8
        lines.append(f"{mark} {r['rung']:14s} {held}  {'fits' if r['fits'] else 'no  '}  ({r['why']})")
    lines.append(f"choice: {result['choice'] or 'none: add tensor/pipeline parallelism or more devices'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab plan-zero", description=__doc__)
    parser.add_argument("--model", required=True, help="a name of costs/models.yaml, or a config file of a shape")
    parser.add_argument("--hardware", required=True, type=accelerator, help="accelerator name in costs/hardware.yaml")
    parser.add_argument("--gpus", type=cli.count, required=True, help="data-parallel devices (at least 1)")
    parser.add_argument("--seq-len", type=cli.count, default=2048)
    parser.add_argument("--micro-batch", type=cli.count, default=1, help="sequences per device and micro-batch")
    parser.add_argument("--host-memory-gb", type=float, default=None, help="per node, for offload (default: unlimited)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--what-if", nargs="*", default=[], type=cli.what_if_item,
                        help="scale catalog figures, e.g. hbm_gb=0.3")
    args = parser.parse_args(argv)
    try:
        result = plan(model_shape(args.model), args.hardware, args.gpus, args.seq_len, args.micro_batch,
                      args.host_memory_gb, what_if_overrides(args.hardware, args.what_if, parser),
                      dtype=args.dtype, optimizer=args.optimizer)
    except ValueError as err:  # the model is unknown, or the devices are not whole nodes
        parser.error(str(err))
    print(render(result, args.model, args.hardware, args.gpus, args.seq_len, args.micro_batch))
    return 0
