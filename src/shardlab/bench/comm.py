"""Time each collective over a range of message sizes, nccl-tests style, under torchrun.

    python -m shardlab bench-comm --settings '{"max_bytes": 65536}' --bench-out comm_bench.csv --fit-out comm_fit.csv

launches `torchrun ... -m shardlab.bench.comm worker ...` (one process per rank, owned by
`runner.launch` as a training run is), which writes one row per (collective, size): the slowest
rank's median time per call over `repeats` back-to-back calls after `warmup` untimed ones, and
algbw/busbw. Each collective's result is checked once on known inputs first (a fast wrong
collective is no benchmark). Then the alpha-beta fit is written. Like a training run, a failed
benchmark is recorded (status column), never a DAG failure.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from shardlab import cli
from shardlab.costs.collectives import bus_factor
from shardlab.config import load_schema, validate_against_schema
from shardlab.runner.failures import record
from shardlab.runner.launch import launch_module

BENCH_COLUMNS = ["collective", "size_bytes", "elements", "dtype", "world_size", "backend", "device", "device_name",
                 "warmup", "repeats", "time_s", "algbw_GBps", "busbw_GBps", "status"]


def resolve_settings(settings: dict | None) -> dict:
    """The `comm_bench` config block with the schema's defaults filled in (one source of defaults)."""
    settings = copy.deepcopy(settings or {})
    validate_against_schema(settings, load_schema()["properties"]["comm_bench"], prefix="comm_bench")
    if settings["max_bytes"] < settings["min_bytes"]:
        from shardlab.errors import ConfigError

        raise ConfigError("comm_bench.max_bytes", f"{settings['max_bytes']} is below min_bytes={settings['min_bytes']}")
    return settings


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# --- the per-rank program ----------------------------------------------------------------------
def collective_call(collective: str, elements: int, rank: int, world: int, device, dtype) -> tuple[Callable, Callable]:
    """(call, check) for one collective on `elements` elements (nccl-tests' size convention).

    Inputs hold `rank + 1`, so `check()` after one `call()` knows the exact expected output.
    """
    import torch
    import torch.distributed as dist

    def full(n):
        return torch.full((n,), float(rank + 1), device=device, dtype=dtype)

    chunk = elements // world
    total = world * (world + 1) / 2  # sum over ranks of rank + 1
    if collective == "all_reduce":
        buf = full(elements)
        return (lambda: dist.all_reduce(buf)), lambda: _reset_after(buf, rank, torch.all(buf == total))
    if collective == "all_gather":
        inp, out = full(chunk), torch.empty(chunk * world, device=device, dtype=dtype)
        expect = torch.arange(1, world + 1, device=device, dtype=dtype).repeat_interleave(chunk)
        return (lambda: dist.all_gather_into_tensor(out, inp)), lambda: bool(torch.equal(out, expect))
    if collective == "reduce_scatter":
        inp, out = full(chunk * world), torch.empty(chunk, device=device, dtype=dtype)
        return (lambda: dist.reduce_scatter_tensor(out, inp)), lambda: bool(torch.all(out == total))
    if collective == "all_to_all":
        inp, out = full(chunk * world), torch.empty(chunk * world, device=device, dtype=dtype)
        expect = torch.arange(1, world + 1, device=device, dtype=dtype).repeat_interleave(chunk)
        return (lambda: dist.all_to_all_single(out, inp)), lambda: bool(torch.equal(out, expect))
    if collective == "broadcast":
        buf = full(elements)
        return (lambda: dist.broadcast(buf, src=0)), lambda: _reset_after(buf, rank, torch.all(buf == 1))
    if collective == "sendrecv":
        # Ring exchange as in nccl-tests' sendrecv: send to the next rank, receive from the previous.
        send, recv = full(elements), torch.empty(elements, device=device, dtype=dtype)
        nxt, prev = (rank + 1) % world, (rank - 1) % world

        def call():
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prev)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return call, lambda: bool(torch.all(recv == prev + 1))
    raise ValueError(f"unknown collective '{collective}'")


def _reset_after(buf, rank: int, ok) -> bool:
    buf.fill_(float(rank + 1))  # in-place collectives: restore the known input for the next check
    return bool(ok)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call: Callable, warmup: int, repeats: int, device) -> float:
    """Median seconds of `repeats` back-to-back calls on this rank.

    nccl-tests reports the mean; the median keeps one preempted call on a shared CPU from
    dominating a point.
    """
    import statistics

    import torch.distributed as dist

    for _ in range(warmup):
        call()
    _synchronize(device)
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: float, device) -> float:
    """A collective is as slow as its slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def benchmark(settings: dict, topo) -> list[dict]:
    import torch

    dtype, element = torch.float32, 4
    world, device = topo.world_size, topo.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    time_calls(collective_call("all_reduce", world, topo.rank, world, device, dtype)[0], 3, 1, device)  # connect
    for collective in settings["collectives"]:
        checked = False
        for size in message_sizes(settings["min_bytes"], settings["max_bytes"], settings["size_factor"]):
            elements = max(world, size // element // world * world)  # divisible into one chunk per rank
            row = {"collective": collective, "size_bytes": elements * element, "elements": elements, "dtype": "float32",
                   "world_size": world, "backend": topo.backend, "device": device.type, "device_name": device_name,
                   "warmup": settings["warmup"], "repeats": settings["repeats"]}
            call, check = collective_call(collective, elements, topo.rank, world, device, dtype)
            if not checked:
                call()
                _synchronize(device)
                if not check():
                    raise RuntimeError(f"{collective} returned wrong values on rank {topo.rank}")
                checked = True
            seconds = slowest(time_calls(call, settings["warmup"], settings["repeats"], device), device)
            algbw = row["size_bytes"] / seconds
            rows.append(dict(row, time_s=seconds, algbw_GBps=algbw / 1e9,
                             busbw_GBps=algbw * bus_factor(collective, world) / 1e9, status="ok"))
            if topo.is_main:
                print(f"[comm_bench] {collective:14s} {row['size_bytes']:>12,d} B  {seconds * 1e6:10.1f} us  "
                      f"busbw {rows[-1]['busbw_GBps']:.3f} GB/s", flush=True)
            del call, check
    return rows


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def worker(settings: dict, out: Path) -> None:
    import pandas as pd

    from shardlab.core.topology import init_topology, shutdown

    topo = init_topology({"device": settings["device"], "backend": settings["backend"],
                          "threads_per_rank": settings["threads_per_rank"]})
    try:
        rows = benchmark(settings, topo)
        if topo.is_main:
            pd.DataFrame(rows, columns=BENCH_COLUMNS).to_csv(out, index=False)
    finally:
        shutdown()


# --- the launcher ------------------------------------------------------------------------------
def resolve_world_size(settings: dict) -> int:
    if settings["world_size"] != "auto":
        return int(settings["world_size"])
    import torch

    return max(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def failed_rows(settings: dict, world: int | None, reason: str) -> list[dict]:
    return [{"collective": c, "world_size": world, "status": f"failed: {reason}"} for c in settings["collectives"]]


def run_benchmark(settings: dict, bench_out: Path) -> "pd.DataFrame":  # noqa: F821
    """Run the torchrun job; always leaves a table at `bench_out` (failure rows if it failed)."""
    import pandas as pd

    bench_out.parent.mkdir(parents=True, exist_ok=True)
    if bench_out.exists():
        bench_out.unlink()
    world = resolve_world_size(settings)
    print(f"[comm_bench] {world} processes", flush=True)
    with tempfile.TemporaryDirectory(prefix="comm_bench-") as tmp:
        run_dir = Path(tmp)
        ranks_out = run_dir / bench_out.name
        reason = launch_module(world, "shardlab.bench.comm", ["worker", "--settings", json.dumps(settings),
                                                              "--out", str(ranks_out)],
                               run_dir, ranks_out, settings["timeout_s"], "comm_bench.timeout_s",
                               env=dict(os.environ, OMP_NUM_THREADS=str(settings["threads_per_rank"])))
        if reason is None:
            shutil.copyfile(ranks_out, bench_out)
            return pd.read_csv(bench_out)
    print(f"[comm_bench] recorded as failed: {reason}", flush=True)
    table = pd.DataFrame(failed_rows(settings, world, reason), columns=BENCH_COLUMNS)
    table.to_csv(bench_out, index=False)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        parser = cli.Parser(prog="shardlab.bench.comm worker")
        parser.add_argument("--settings", required=True, type=cli.json_value, help="resolved comm_bench settings (JSON)")
        parser.add_argument("--out", type=Path, required=True)
        args = parser.parse_args(argv[1:])
        worker(args.settings, args.out)
        return 0
    parser = cli.Parser(prog="shardlab bench-comm", description=__doc__)
    parser.add_argument("--settings", type=cli.json_value, default={},
                        help="the config's comm_bench block (JSON); defaults from the schema")
    parser.add_argument("--bench-out", type=Path, required=True)
    parser.add_argument("--fit-out", type=Path, required=True)
    args = parser.parse_args(argv)
    from shardlab.costs.alpha_beta import fit_table

    settings = resolve_settings(args.settings)
    bench = run_benchmark(settings, args.bench_out)
    fits = fit_table(bench)
    fits.to_csv(args.fit_out, index=False)
    print(f"[comm_bench] {int((bench['status'] == 'ok').sum())} timings -> {args.bench_out}; "
          f"{len(fits)} fits -> {args.fit_out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
