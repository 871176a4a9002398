"""`python -m shardlab plan-zero`: the ZeRO decision tree (`costs.zero_tree`) over DeepSpeed's rungs
of the registry's ladder (`RUNGS`).

    python -m shardlab plan-zero --params 6.9e9 --gpus 2 --gpu-mem 80GB
"""

from __future__ import annotations

import argparse

from shardlab.costs.zero_tree import DEFAULT_HEADROOM, choose, feasibility, parse_bytes
from shardlab.strategies.zero import deepspeed_ladder


def plan(n_params: float, gpus: int, gpu_mem: float, **kw) -> dict:
    rows = feasibility(deepspeed_ladder(), n_params, gpus, gpu_mem, **kw)
    return {"choice": choose(rows), "rows": rows}


def render(result: dict, n_params: float, gpus: int, gpu_mem: float, headroom: float) -> str:
    gb = 1e9
    lines = [f"{n_params / 1e9:.2f}B parameters on {gpus} device(s) of {gpu_mem / gb:.0f} GB "
             f"(budget {gpu_mem * (1 - headroom) / gb:.1f} GB after a {headroom:.0%} activation/headroom margin)"]
    for r in result["rows"]:
        mark = "->" if r["rung"] == result["choice"] else "  "
        lines.append(f"{mark} {r['rung']:14s} {r['device_peak_bytes'] / gb:8.1f} GB/device  "
                     f"{'fits' if r['fits'] else 'no  '}  ({r['why']})")
    lines.append(f"choice: {result['choice'] or 'none: the model states do not fit; add tensor/pipeline parallelism or more devices'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab plan-zero", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, required=True, help="parameter count, e.g. 6.9e9")
    parser.add_argument("--gpus", type=int, required=True, help="data-parallel devices")
    parser.add_argument("--gpu-mem", required=True, help="memory per device, e.g. 80GB or 24GiB")
    parser.add_argument("--host-mem", default=None, help="host memory for offloaded state (default: unlimited)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help="fraction of device memory kept for activations and buffers (default 0.25)")
    args = parser.parse_args(argv)
    gpu_mem = parse_bytes(args.gpu_mem)
    host_mem = parse_bytes(args.host_mem) if args.host_mem else None
    result = plan(args.params, args.gpus, gpu_mem, dtype=args.dtype, optimizer=args.optimizer,
                  headroom=args.headroom, host_mem=host_mem)
    print(render(result, args.params, args.gpus, gpu_mem, args.headroom))
    return 0
