"""Tensor-parallel inference benchmark: greedy generation with a KV cache, single device vs the
hand-written tensor-parallel strategy.

    python -m shardlab bench-inference --experiment-config results/E/experiment.json --model-dir M --out tp_inference.csv

runs the single-device benchmark in this process, then the same generation under `torchrun` with the
model wrapped by the benchmarked strategy (this module with `--worker`), and writes one row per
(mode, rank): tokens/s, KV-cache bytes held by the rank, and whether the generated tokens equal the
single device's. `mode` is the strategy's name, or its registry reference for the single device.
Under TP each rank caches only its own heads' keys and values, so the cache per rank should be 1/t.
A failed TP launch becomes a row with status 'failed' and its reason (failure is data).

The strategy benchmarked comes from the registry (`benchmarked_strategy`): the hand-written one (it
has a production twin) that splits activations as plain tensor parallelism does.
"""

from __future__ import annotations

import csv
import json
import statistics
import time

import torch

from shardlab import cli
from shardlab.bench.driver import bench_parser, run_worker
from shardlab.runner.failures import record
from shardlab.strategies.roles import tp_pair

FIELDS = ["experiment", "model", "mode", "tp", "rank", "status", "reason", "batch", "prompt_len", "new_tokens",
          "tokens_per_s", "latency_s", "kv_cache_bytes", "param_bytes", "matches_single"]


def benchmarked_strategy() -> str:
    """The hand-written tensor-parallel strategy without sequence parallelism, from the registry."""
    return tp_pair()[0]


def prompt_ids(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))


def kv_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def benchmark(model, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Median wall time of `repeats` greedy generations (after one warm-up) and the cache it built."""
    model.eval()
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, use_cache=True, return_dict_in_generate=True, pad_token_id=0)
    model.generate(prompt, **kwargs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        times.append(time.perf_counter() - start)
    latency = statistics.median(times)
    return {"latency_s": latency, "tokens_per_s": prompt.shape[0] * new_tokens / latency,
            "kv_cache_bytes": kv_cache_bytes(out.cache), "sequences": out.sequences.tolist(),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def worker(args) -> None:
    """One rank of the TP benchmark (under torchrun)."""
    import torch.distributed as dist

    from shardlab.core.model import load_model
    from shardlab.core.topology import init_topology, shutdown
    from shardlab.strategies import get_spec

    exp = json.loads(args.experiment_config.read_text())
    topo = init_topology(exp["launch"])
    try:
        # The strategy wraps the model as in training; no options: generation needs whole logits.
        model = get_spec(args.strategy).build(load_model(args.model_dir), topo, exp["training"], {}).model
        prompt = prompt_ids(model.config.vocab_size, args.batch, args.prompt_len).to(topo.device)
        result = benchmark(model, prompt, args.new_tokens, args.repeats)
        result["rank"] = topo.rank
        results = [None] * topo.world_size
        dist.all_gather_object(results, result)
        if topo.is_main:
            args.worker_out.write_text(json.dumps(results))
    finally:
        shutdown()


def _row(mode: str, tp: int, rank: int, args, result: dict | None, reference: list | None, reason: str = "") -> dict:
    row = {"experiment": args.experiment, "model": args.model, "mode": mode, "tp": tp, "rank": rank,
           "status": "ok" if result else "failed", "reason": reason,
           "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    if result:
        row.update({k: result[k] for k in ("tokens_per_s", "latency_s", "kv_cache_bytes", "param_bytes")})
        row["matches_single"] = result["sequences"] == reference if reference is not None else True
    return row


def run_tp(args, tp: int) -> tuple[list | None, str]:
    """The TP ranks' results (one per rank), or None and why the launch failed."""
    return run_worker(tp, "shardlab.bench.inference",
                      ["--strategy", args.strategy, "--experiment-config", str(args.experiment_config),
                       "--model-dir", str(args.model_dir), "--batch", str(args.batch), "--prompt-len",
                       str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
                      args.timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("shardlab bench-inference", __doc__, tokens=False, timeout_s=600)
    parser.add_argument("--strategy", default=None, help="strategy to benchmark (default: benchmarked_strategy())")
    parser.add_argument("--tp", type=cli.count, default=None,
                        help="TP degree (default: the experiment's launch.world_size)")
    parser.add_argument("--batch", type=cli.count, default=4)
    parser.add_argument("--prompt-len", type=cli.count, default=16)
    parser.add_argument("--new-tokens", type=cli.count, default=32)
    parser.add_argument("--repeats", type=cli.count, default=2)
    args = parser.parse_args(argv)
    args.strategy = args.strategy or benchmarked_strategy()
    if args.worker:
        return worker(args)

    from shardlab.core.model import load_model
    from shardlab.strategies import get_spec

    exp = json.loads(args.experiment_config.read_text())
    args.experiment, args.model = exp["name"], exp["model"]["name"]
    single_mode = get_spec(args.strategy).reference
    tp = args.tp or int(exp["launch"]["world_size"])
    torch.set_num_threads(exp["launch"].get("threads_per_rank", 1))  # same threads as one TP rank
    model = load_model(args.model_dir)
    single = benchmark(model, prompt_ids(model.config.vocab_size, args.batch, args.prompt_len),
                       args.new_tokens, args.repeats)
    rows = [_row(single_mode, 1, 0, args, single, None)]
    results, reason = run_tp(args, tp)
    if results is None:
        rows.append(_row(args.strategy, tp, 0, args, None, None, reason))
    else:
        rows += [_row(args.strategy, tp, r["rank"], args, r, single["sequences"]) for r in results]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print({k: row.get(k) for k in ("mode", "rank", "status", "tokens_per_s", "kv_cache_bytes", "matches_single")})


if __name__ == "__main__":
    main()
