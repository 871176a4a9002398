"""Test hooks (`training.fault_injection`): failures the launcher must record correctly, injected at
step 1 so that step 0's metrics exist. Each stands in for a real failure mode:

- raise_oom: every rank raises an out-of-memory error;
- oom_rank1: only rank 1 runs out of memory (the others then see their peer disconnect);
- kill_rank0: rank 0 dies by SIGKILL, as under the kernel's out-of-memory killer (no error file);
- hang: every rank stops silently (a stuck collective), so only the launcher's deadline ends the run;
- hang_rank1: rank 1 stops silently while the others wait for it in a collective, which the
  process-group timeout (launch.collective_timeout_s) ends;
- non_utf8: rank 0 prints bytes that are not UTF-8, then trains on;
- kill_rank1_once: rank 1 dies by SIGKILL at step 3 of a run that has not resumed (a rank lost
  mid-run once; the resumed run, by a torchrun restart or a rerun, goes through);
- stall_rank1_once: rank 1 stops silently at step 3 of a run that has not resumed, so that a test
  can interrupt the workflow in mid-run, after a checkpoint (the rerun resumes and goes through);
- drop_optimizer_state: a resumed run loads the parameters but not the optimizer's state (the worker
  asks the checkpoint so), so that the resumed-trajectory check must fail.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

FAULT_STEP = 1
# Faults that remove one gradient reduction from a strategy, so that its parity check must fail: the
# methods that reduce, by name (every strategy names its reductions so), replaced by no-ops for the run.
NUMERIC_FAULTS = {
    "skip_grad_average": ("average_replica_gradients", "bucket_ready"),  # data-parallel replicas' average
    "skip_sp_grad_sum": ("sum_partial_gradients",),  # SP's partial LayerNorm gradients over tp
    "skip_expert_grad_sum": ("reduce_expert_gradients",),  # experts' gradients over the ranks holding them
}
ONCE_STEP = 3  # late enough for a checkpoint before it


def remove_reductions(strategy, kind: str) -> None:
    """Test hook: `strategy` with the reductions a numeric fault names skipped (each rank keeps its own
    partial gradients, so the run must leave its reference)."""
    for name in NUMERIC_FAULTS.get(kind, ()):
        if hasattr(strategy, name):
            setattr(strategy, name, lambda *args, **kwargs: None)


def inject_fault(kind: str, step: int, rank: int, resumed: bool = False) -> None:
    if kind.endswith("_rank1_once") and step == ONCE_STEP and rank == 1 and not resumed:
        sys.stdout.flush()
        if kind == "kill_rank1_once":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(3600)
    if step != FAULT_STEP or kind in ("none", "drop_optimizer_state", *NUMERIC_FAULTS):
        return
    if kind == "raise_oom" or (kind == "oom_rank1" and rank == 1):
        raise torch.OutOfMemoryError(f"fault injection: simulated out of memory at step {step} on rank {rank}")
    if kind == "kill_rank0" and rank == 0:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang" or (kind == "hang_rank1" and rank == 1):
        time.sleep(3600)
    if kind == "non_utf8" and rank == 0:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), b"fault injection: bytes that are not UTF-8: \xff\xfe\xc3\x28\n")
