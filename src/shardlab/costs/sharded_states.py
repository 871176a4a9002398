"""Predicted per-rank bytes of model states (parameters, gradients, optimizer state) on the ZeRO ladder.

The ZeRO paper's accounting with Ψ parameters and N data-parallel ranks, for mixed-precision Adam:
2Ψ (bf16 weights) + 2Ψ (bf16 gradients) + 12Ψ (fp32 master weights, momentum, variance) = 16Ψ;
ZeRO-1 divides the 12Ψ by N, ZeRO-2 also the gradients, ZeRO-3 also the weights.

Two dtype policies:
- `bf16`: DeepSpeed's bf16 mixed precision (weights and gradients in bf16, fp32 master + moments;
  at stage 0 FP16_UnfusedOptimizer keeps a whole fp32 master copy per tensor, in `fp32_groups`,
  which `strategies.zero.deepspeed` counts as optimizer state).
- `fp32`: weights and gradients in fp32 (4Ψ + 4Ψ), moments 8Ψ for Adam; DeepSpeed still keeps a
  separate fp32 master partition (4Ψ/N) from stage 1 on, which plain fp32 training does not need.
FSDP2 keeps its sharded parameters in fp32 under either policy (bf16 is a compute cast of the
gathered weights) and has no master copy: 4Ψ/N + 4Ψ/N + moments/N.

Gradients are given twice: `grad_bytes` after the reduction at the accumulation boundary (what a
rank holds when the step runs; DeepSpeed partitions gradients there from stage 1 on), and
`grad_peak_bytes` during backward (stages 0-1 hold the full gradient until the reduction, stages 2-3
one reduce bucket on top of their partition). The planner budgets the peak.
With optimizer offload the CPU optimizer steps an fp32 gradient of the master partition (4 bytes per
element in bf16 too): stages 1-2 copy their gradients straight into it, stage 3 keeps it beside its
own gradient partition buffer, both in host memory (measured on CPU).

Exact per rank, given the parameter tensors (`tensors`: their shapes in the model's parameter order,
e.g. `parameter_shapes(ModelShape)`), as DeepSpeed and FSDP2 really cut them:
- stages 1-2 flatten all parameters into one buffer padded to a multiple of 2N elements
  (`nccl_start_alignment_factor` 2 x world size, stage_1_and_2.py) and give rank r the r-th 1/N of it;
  at the step a rank holds the WHOLE gradient of every tensor that overlaps its partition
  (`grads_in_partition` is sized by those tensors' full numel), so a tensor straddling a partition
  boundary is held twice over the ranks: for small or few-tensor models this is the largest error of
  the even split (+27 % on one grid shape);
- stage 3 partitions every tensor on its own, ceil(numel / N) elements each (ds_tensor);
- FSDP2 shards every tensor along dim 0 in torch.chunk's rows, ceil(rows / N) on the first ranks.
Without `tensors` the split is even (Ψ/N). Optimizer `step` scalars (4 bytes per stepped tensor) are
not counted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass



@dataclass(frozen=True)
class ZeroRung:
    """What the memory model needs to know of a ZeRO rung."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    framework: str = "deepspeed"  # or "fsdp2": fp32 shards, no master copy; "torch": fp32 replicas (stage 0-1);
    # "megatron", "mcore" (planner only)

    @classmethod
    def of(cls, zero: int, offload: str = "none", framework: str = "deepspeed") -> ZeroRung:
        """The rung of a Plan's fields (costs.plan.Plan: zero, offload, framework)."""
        return cls(zero, offload_optimizer=offload != "none", offload_param=offload == "optimizer+params",
                   framework=framework)


# Optimizer state per parameter: Adam's two moments in fp32; "adamw-bf16" keeps the moments and the master
# copy in bf16 (NeMo's distributed fused Adam with dtype bf16, as the Nemotron-4 340B recipe runs it);
# SGD without momentum keeps none.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each training dtype: the one table
MOMENT_BYTES = {"adamw": 8, "adamw-bf16": 4, "sgd": 0}


def master_bytes(optimizer: str, dtype: str) -> int:
    """Bytes per parameter of a mixed-precision master copy: fp32, or bf16 where the optimizer's state is bf16."""
    if dtype == "fp32":
        return 0
    return 2 if optimizer == "adamw-bf16" else 4
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


def predict(rung: ZeroRung, n_params: float, ranks: int, dtype: str = "bf16", optimizer: str = "adamw",
            bucket_elements: float = DEFAULT_BUCKET, tensors: Sequence[Sequence[int]] | None = None,
            rank: int | None = None) -> ModelStates:
    """Per-rank model-state bytes of a ZeRO `rung` for a model of `n_params` on `ranks` data-parallel ranks.

    `tensors`: the parameter tensors' shapes in the model's parameter order, for DeepSpeed's padding and
    partition boundaries and FSDP2's row chunks (then `n_params` is their total); `rank`: which rank
    (default: the one holding the most). Without `tensors`, the even split. At scale the boundary
    term matters: with partitions smaller than a weight matrix (e.g. 405B on 1,024 ranks), stages
    1-2 hold whole gradients of one or two matrices per rank, several times the even share."""
    held = Held.even(n_params, ranks) if tensors is None else _held(tuple(map(tuple, tensors)), ranks, rank)
    stage, off_opt, framework = rung.stage, rung.offload_optimizer, rung.framework
    psi, moments = float(n_params), MOMENT_BYTES[optimizer]
    if framework == "fsdp2":
        weight = grad = 4
        master = 0
        params = grads = state = held.fsdp2_shard
    elif framework == "torch":
        # Plain PyTorch: fp32 weights and gradients whole on every replica (bf16 is autocast over them, so
        # no master copy); at stage 1 a distributed optimizer (strategies.composed.distributed_optimizer)
        # keeps the moments of its 1/N of the flat buffer.
        weight = grad = 4
        master = 0
        params = grads = psi
        state = held.flat_partition if stage >= 1 else psi
    elif framework in ("megatron", "mcore"):
        # Megatron-LM's mixed precision: compute-dtype weights, fp32 main gradients (whole: its
        # distributed optimizer, stage 1, reduce-scatters inside the same buffer), fp32 master copy
        # and moments sharded by the distributed optimizer: 18 bytes, or 6 + 12/N. Megatron-Core
        # (grad_reduce_in_fp32 off) and NeMo's distributed fused Adam (contiguous_grad_buffer) keep the
        # gradients in the compute dtype: 16 bytes, or 4 + 12/N.
        weight = DTYPE_BYTES[dtype]
        grad = 4 if framework == "megatron" else DTYPE_BYTES[dtype]
        master = master_bytes(optimizer, dtype)
        params = grads = psi
        state = held.flat_partition if stage >= 1 else psi
    else:
        weight = grad = DTYPE_BYTES[dtype]
        master = 4 if (dtype == "bf16" or stage >= 1) else 0  # fp32 stage 0 updates the weights in place
        params = held.tensor_partition if stage == 3 else held.flat_buffer if stage >= 1 else psi
        state = held.tensor_partition if stage == 3 else held.flat_partition if stage >= 1 else psi
        grads = held.tensor_partition if stage == 3 else held.boundary_gradient if stage >= 1 else psi

    param_bytes = weight * params
    grad_bytes = grad * grads
    opt = (master + moments) * state
    if framework in ("megatron", "mcore", "torch"):  # the whole gradient, reduced in place (stage 1) or not
        grad_peak = grad_bytes
    elif stage <= 1:
        grad_peak = grad * psi + (grad_bytes if stage == 1 else 0)  # full gradient, then its reduced partition
    else:
        grad_peak = grad_bytes + grad * min(bucket_elements, psi)
    if off_opt:
        # The CPU optimizer's fp32 gradient of the master partition: stages 1-2 hold only it, stage 3
        # also its own gradient partition buffer (measured).
        kept = grad_bytes if stage == 3 else 0.0
        grad_peak += 4 * state - (grad_bytes - kept)
        grad_bytes = 4 * state + kept
    offload = "optimizer+params" if rung.offload_param else "optimizer" if off_opt else "none"
    return ModelStates(param_bytes, grad_bytes, opt, grad_peak, host_bytes(offload, param_bytes, grad_bytes, opt))


@dataclass(frozen=True)
class Held:
    """Elements one rank holds under each framework's cut of the parameters."""

    flat_buffer: float  # DeepSpeed stages 1-2: the whole padded flat parameter buffer
    flat_partition: float  # ... and this rank's 1/N of it (master weights, moments)
    boundary_gradient: float  # ... and the gradients of every tensor overlapping that partition
    tensor_partition: float  # DeepSpeed stage 3: ceil(numel / N) of every tensor
    fsdp2_shard: float  # FSDP2: this rank's dim-0 chunk of every tensor

    @classmethod
    def even(cls, n_params: float, ranks: int) -> Held:
        share = float(n_params) / ranks
        return cls(float(n_params), share, share, share, share)

    @classmethod
    def exact(cls, tensors: Sequence[Sequence[int]], ranks: int, rank: int | None = None) -> Held:
        """What rank `rank` holds; None: the fullest rank (only one field varies with the rank under each
        framework, so the field-wise maxima are one rank's). Linear in tensors + ranks."""
        sizes = [math.prod(shape) for shape in tensors]
        padded = _round_up(sum(sizes), 2 * ranks)  # DeepSpeed's alignment: 2 elements x world size
        partition = padded // ranks
        boundary = _boundary_gradients(sizes, partition, ranks)
        first = rank or 0  # FSDP2 gives the first ranks the longer chunks
        return cls(padded, partition, max(boundary) if rank is None else boundary[rank],
                   sum(math.ceil(n / ranks) for n in sizes), sum(_chunk_numel(s, ranks, first) for s in tensors))


@functools.lru_cache(maxsize=4096)
def _held(tensors: tuple[tuple[int, ...], ...], ranks: int, rank: int | None) -> Held:
    return Held.exact(tensors, ranks, rank)  # a planner asks for the same model and ranks many times


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _boundary_gradients(sizes: list[int], partition: int, ranks: int) -> list[int]:
    """Per rank, the total numel of the tensors (laid out back to back) that overlap its partition."""
    held, offset = [0] * ranks, 0
    for n in sizes:
        if n:
            for r in range(offset // partition, min((offset + n - 1) // partition, ranks - 1) + 1):
                held[r] += n
        offset += n
    return held


def _chunk_numel(shape: Sequence[int], ranks: int, rank: int) -> int:
    """Elements of torch.chunk(tensor, ranks, dim=0)[rank] (FSDP2's shard; empty past the last row)."""
    rows = shape[0] if shape else 1
    per = math.ceil(rows / ranks)
    mine = max(0, min(per, rows - rank * per))
    return mine * math.prod(shape[1:])


def parameter_shapes(model) -> list[tuple[int, ...]]:
    """A `ModelShape`'s parameter shapes in Hugging Face's parameter order: GPT-NeoX (embedding; per
    layer two LayerNorms, fused QKV, output projection, MLP up and down, with biases; final LayerNorm;
    LM head), or, for bias-free or SwiGLU shapes, Llama's (per layer q, k, v, o, gate, up, down, two
    RMSNorms). Only the order of big tensors matters to the partition boundaries."""
    h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
    if getattr(model, "num_experts", 0):
        raise ValueError("parameter_shapes does not lay out mixture-of-experts models")
    kv = h * (getattr(model, "num_kv_heads", None) or model.num_heads) // model.num_heads
    head = [] if getattr(model, "tied_embeddings", False) else [(v, h)]
    if getattr(model, "biases", True) and getattr(model, "mlp", "gelu") == "gelu":
        layer = [(h,), (h,), (h,), (h,), (h + 2 * kv, h), (h + 2 * kv,), (h, h), (h,), (i, h), (i,), (h, i), (h,)]
        return [(v, h), *layer * model.num_layers, (h,), (h,), *head]
    mlp = [(i, h), (i, h), (h, i)] if getattr(model, "mlp", "gelu") == "swiglu" else [(i, h), (h, i)]
    layer = [(h, h), (kv, h), (kv, h), (h, h), *mlp, (h,), (h,)]
    return [(v, h), *layer * model.num_layers, (h,), *head]


def host_bytes(offload: str, param_bytes: float, grad_bytes: float, optimizer_bytes: float) -> float:
    """The part of a rank's model states that an offloading plan (`offload`: a Plan's "none",
    "optimizer" or "optimizer+params") keeps in host memory: the optimizer state and the gradient
    partition(s) the CPU optimizer steps on, and the parameter partition. One rule for predicted and
    measured bytes alike."""
    host = (optimizer_bytes + grad_bytes) if offload != "none" else 0.0
    return host + (param_bytes if offload == "optimizer+params" else 0.0)
