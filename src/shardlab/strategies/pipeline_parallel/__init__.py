"""Pipeline parallelism: GPT-NeoX split into stages by hand, run by torch.distributed.pipelining schedules."""
