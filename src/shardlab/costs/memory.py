"""Predicted per-rank bytes of model states (parameters, gradients, optimizer state) on the ZeRO ladder.

The ZeRO paper's accounting with Ψ parameters and N data-parallel ranks, for mixed-precision Adam:
2Ψ (bf16 weights) + 2Ψ (bf16 gradients) + 12Ψ (fp32 master weights, momentum, variance) = 16Ψ;
ZeRO-1 divides the 12Ψ by N, ZeRO-2 also the gradients, ZeRO-3 also the weights.

Two dtype policies:
- `bf16`: DeepSpeed's bf16 mixed precision (weights and gradients in bf16, fp32 master + moments).
- `fp32`: weights and gradients in fp32 (4Ψ + 4Ψ), moments 8Ψ for Adam; DeepSpeed still keeps a
  separate fp32 master partition (4Ψ/N) from stage 1 on, which plain fp32 training does not need.
FSDP2 keeps its sharded parameters in fp32 under either policy (bf16 is a compute cast of the
gathered weights) and has no master copy: 4Ψ/N + 4Ψ/N + moments/N.

Gradients are given twice: `grad_bytes` after the reduction at the accumulation boundary (what a
rank holds when the step runs; DeepSpeed partitions gradients there from stage 1 on), and
`grad_peak_bytes` during backward (stages 0-1 hold the full gradient until the reduction, stages 2-3
one reduce bucket on top of their partition). The planner budgets the peak.
With optimizer offload at stage 3, DeepSpeed holds two gradient partitions in host memory (its
partition buffer and the fp32 gradient of the master partition; measured on CPU).
Padding of DeepSpeed's aligned flat buffers is not modelled (at most a few elements per rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass



@dataclass(frozen=True)
class ZeroRung:
    """What the memory model needs to know of a ZeRO rung."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    framework: str = "deepspeed"  # or "fsdp2": fp32 shards, no master copy


# The ZeRO ladder, the one definition of each rung (the registry's zero specs and the DeepSpeed
# settings derive from it), in the decision tree's order: least communication first.
ZERO_LADDER: dict[str, ZeroRung] = {
    "zero0": ZeroRung(0),
    "zero1": ZeroRung(1),
    "zero2": ZeroRung(2),
    "zero3": ZeroRung(3),
    "zero2_offload": ZeroRung(2, offload_optimizer=True),
    "zero3_offload": ZeroRung(3, offload_optimizer=True, offload_param=True),
}
FSDP2_RUNGS: dict[str, ZeroRung] = {"fsdp2_grad_op": ZeroRung(3, framework="fsdp2"),
                                    "fsdp2_full": ZeroRung(3, framework="fsdp2")}
MOMENT_BYTES = {"adamw": 8, "sgd": 0}  # fp32 state per parameter (SGD without momentum keeps none)
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default reduce bucket, in elements


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds. `*_offloaded` parts live in host memory, the rest on the device."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    grad_peak_bytes: float
    offloaded_bytes: float  # part of the three above that sits in host memory

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def device_peak_bytes(self) -> float:
        """Model-state bytes the accelerator must hold at the worst moment of a step."""
        return self.param_bytes + self.grad_peak_bytes + self.optimizer_bytes - self.offloaded_bytes

    def as_dict(self) -> dict:
        return dict(asdict(self), total_bytes=self.total_bytes, device_peak_bytes=self.device_peak_bytes)


def unsharded(n_params: float, dtype: str = "fp32", optimizer: str = "adamw") -> ModelStates:
    """Plain torch training of `n_params` parameters on one rank: fp32 weights and gradients (bf16 is
    autocast over fp32 master weights) and the optimizer's fp32 moments, nothing sharded or offloaded."""
    psi = float(n_params)
    return ModelStates(4 * psi, 4 * psi, MOMENT_BYTES[optimizer] * psi, 4 * psi, 0.0)


def predict(rung: str | ZeroRung, n_params: float, ranks: int, dtype: str = "bf16", optimizer: str = "adamw",
            bucket_elements: float = DEFAULT_BUCKET) -> ModelStates:
    """Per-rank model-state bytes of a ZeRO `rung` (a name of ZERO_LADDER / FSDP2_RUNGS or its facts)
    for a model of `n_params` on `ranks` data-parallel ranks."""
    if isinstance(rung, str):
        rung = {**ZERO_LADDER, **FSDP2_RUNGS}[rung]
    stage, off_opt, off_param, framework = rung.stage, rung.offload_optimizer, rung.offload_param, rung.framework
    psi, n = float(n_params), ranks
    moments = MOMENT_BYTES[optimizer]
    if framework == "fsdp2":
        weight = grad = 4
        master = 0
    else:
        weight = grad = 2 if dtype == "bf16" else 4
        master = 4 if (dtype == "bf16" or stage >= 1) else 0  # fp32 stage 0 updates the weights in place

    params = weight * psi / (n if stage == 3 else 1)
    grads = grad * psi / (n if stage >= 1 else 1)
    opt = (master + moments) * psi / (n if stage >= 1 else 1)
    if stage <= 1:
        grad_peak = grad * psi + (grads if stage == 1 else 0)  # full gradient, then its reduced partition
    else:
        grad_peak = grads + grad * min(bucket_elements, psi)
    if off_opt and stage == 3:
        # Measured: DeepSpeed's stage-3 offload keeps its gradient partition buffer AND a separate fp32
        # gradient of the master partition for the CPU optimizer, both in host memory.
        grads += 4 * psi / n
        grad_peak += 4 * psi / n
    return ModelStates(params, grads, opt, grad_peak, host_bytes(rung, params, grads, opt))


def host_bytes(rung: ZeroRung, param_bytes: float, grad_bytes: float, optimizer_bytes: float) -> float:
    """The part of a rank's model states that an offloading rung keeps in host memory: the optimizer
    state and the gradient partition(s) the CPU optimizer steps on (optimizer offload), the parameter
    partition (parameter offload). One rule for predicted and measured bytes alike."""
    host = (optimizer_bytes + grad_bytes) if rung.offload_optimizer else 0.0
    return host + (param_bytes if rung.offload_param else 0.0)
