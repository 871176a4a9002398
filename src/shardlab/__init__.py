"""shardlab: measure how LLM training parallelism behaves (memory, throughput, convergence, communication)."""

__version__ = "0.1.0"
