"""Communication analysis: collective benchmarks, an alpha-beta cost model, per-strategy volumes
and what-if predictions of step time as the network changes.

- `collectives`: names and nccl-tests bus-bandwidth conventions (no torch needed).
- `bench`: the torchrun benchmark program and its launcher (`python -m shardlab.comm.bench`).
- `alpha_beta`: least-squares latency + size/bandwidth fit per collective, with fit quality.
- `volume`: the collectives each strategy must issue per step, from model and training shape.
- `whatif`: communication share of measured step time, and predicted step time per link.
"""
