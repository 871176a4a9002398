"""A composed plan's run. One named mesh `(pp, dp, cp, tp)` from the Plan (tp innermost, so that a
tensor-parallel group sits inside a node), and on it, in this order:

1. hand-written TP (+SP) inside each `tp` group (`tensor_parallel.parallelize_neox`);
2. ring attention over each `cp` group on a zig-zag shard of every sequence, with global positions;
3. with pp > 1, the TP/CP model cut into stages (`pipeline_parallel.stages`) and run by a
   torch.distributed.pipelining schedule over each `pp` group, otherwise FSDP2 over `dp` x `cp` if asked;
4. data-parallel replicas: each dp rank trains on its own rows of the batch.

Gradients are reduced over exactly the dimensions that replicate a parameter: SP's partial sums
(LayerNorms and row-parallel biases applied to one sequence shard) over `tp`; every parameter's
replicas over `dp` x `cp` (one flattened group, over which FSDP2 also shards and averages).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from transformers import AttentionInterface

from shardlab.strategies import get_spec
from shardlab.strategies.base import Strategy
from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies.context_parallel.comms import Ring
from shardlab.strategies.context_parallel.strategy import ATTENTION_NAME, make_ring_attention_forward
from shardlab.strategies.mesh import MeshDataParallel, all_reduce_gradients
from shardlab.strategies.pipeline_parallel.probe import PipelineProbe
from shardlab.strategies.pipeline_parallel.pipeline import GPipe
from shardlab.strategies.pipeline_parallel.stages import NeoXStage
from shardlab.strategies.tensor_parallel.tensor_parallel import parallelize_neox
from shardlab.strategies.zero.fsdp2 import transformer_blocks

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class Composition(MeshDataParallel):
    """What every composed run shares: the mesh, TP and CP applied to the model, this rank's share of the
    batch, the loss reduction and the gradient reduction."""

    def compose(self, model):
        fields = get_spec(self.name).plan_fields(self.topo.world_size, self.options)
        self.tp_size, self.cp_size, self.sp = fields["tp"], fields["cp"], fields["sp"]
        self.mesh = self.topo.mesh(pp=fields["pp"], dp=fields["dp"], cp=self.cp_size, tp=self.tp_size)
        self.replica_mesh = self.topo.flattened(self.mesh, "dp", "cp")  # ranks holding the same parameter shard
        if self.tp_size > 1:
            parallelize_neox(model, self.mesh["tp"].get_group(), self.sp, gather_logits=True)
        self.tp_shard_dims = {n: p.tp_shard_dim for n, p in model.named_parameters() if hasattr(p, "tp_shard_dim")}
        self.partial_sum_names = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        self.shard_positions = None  # with cp: this rank's zig-zag tokens' global positions
        if self.cp_size > 1:
            ring = Ring(self.mesh["cp"].get_group(), timer=self.comm)
            AttentionInterface.register(ATTENTION_NAME, make_ring_attention_forward(ring))
            model.set_attn_implementation(ATTENTION_NAME)
            self.shard_positions = zigzag.positions(self.training["seq_len"], ring.rank, ring.size).to(
                self.topo.device).unsqueeze(0)
        return model

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    def local_batch(self, inputs, labels):
        """This dp rank's rows, and of them this cp rank's zig-zag shard of each sequence."""
        inputs, labels = super().local_batch(inputs, labels)
        if self.cp_size == 1:
            return inputs, labels
        return zigzag.shard(inputs, self.cp_rank, self.cp_size), zigzag.shard(labels, self.cp_rank, self.cp_size)

    def state_namespace(self):
        coords = self.mesh.get_coordinate()
        return "_".join(f"{dim}{c}" for dim, c in zip(self.mesh.mesh_dim_names, coords) if dim in ("pp", "tp"))

    def whole_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter's TP shards gathered over `tp` (collective within the TP group)."""
        if name not in self.tp_shard_dims:
            return tensor
        chunks = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(chunks, tensor.contiguous(), group=self.mesh["tp"].get_group())
        return torch.cat(chunks, dim=self.tp_shard_dims[name])

    # --- gradients: over exactly the dimensions that replicate each parameter ------------------
    def sum_partial_gradients(self, params) -> None:
        """SP: parameters applied to one sequence shard hold partial sums of their gradient; add them up."""
        if self.sp:
            with self.comm.blocked():
                all_reduce_gradients(params, self.mesh["tp"].get_group())

    def average_replica_gradients(self) -> None:
        """Average every gradient over the ranks that hold the same parameters: dp x cp."""
        mesh = self.replica_mesh
        if mesh.size() == 1:
            return
        with self.comm.blocked():
            all_reduce_gradients(self.model.parameters(), mesh.get_group(), divide_by=mesh.size())

    def mean_over_ranks_holding(self, losses: torch.Tensor, holders: int) -> torch.Tensor:
        """Global-batch mean losses from the ranks' local means: a sum over the world (ranks that hold no
        loss contribute zeros) divided by the number of ranks holding one per replica and shard."""
        dist.all_reduce(losses)
        return losses / holders


class ComposedPlan(Composition, Strategy):
    """A plan without pipeline stages: dp (replicas or FSDP2) x cp x tp (+sp)."""

    def wrap(self, model):
        model = self.compose(model)
        self.fsdp = self.options.get("dp_shard", "replicas") != "replicas"
        if self.fsdp:
            self._shard(model, reshard=self.options["dp_shard"] == "fsdp2_full")
        self.partial_sum_params = [p for n, p in model.named_parameters() if n in self.partial_sum_names]
        return model

    def _shard(self, model, reshard: bool) -> None:
        """FSDP2 over every rank that holds the same parameters, dp x cp (as the Plan's ZeRO group): each
        keeps 1/(dp·cp) of its tp shard, and FSDP2's reduce-scatter averages the gradients over them."""
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.training["dtype"] == "bf16" else MixedPrecisionPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mesh=self.replica_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=self.replica_mesh, reshard_after_forward=reshard, mp_policy=mp)

    def autocast(self):
        return contextlib.nullcontext() if self.fsdp else super().autocast()  # FSDP2 casts its gathered weights

    def accumulating(self, last: bool):
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)

    def position_ids(self, inputs):
        return None if self.shard_positions is None else self.shard_positions.expand(inputs.shape[0], -1)

    def sync_gradients(self) -> None:
        self.sum_partial_gradients(self.partial_sum_params)
        if not self.fsdp:  # FSDP2's reduce-scatter has averaged over dp x cp already
            self.average_replica_gradients()

    def reduce_losses(self, losses):
        return self.mean_over_ranks_holding(losses.detach().float().clone(), self.dp_size * self.cp_size * self.tp_size)

    def full_state_dict(self):
        """The whole model on the main rank: FSDP2 shards gathered over dp, then TP shards over tp."""
        state = {}
        for name, p in self.model.named_parameters():
            tensor = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            state[name] = self.whole_parameter(name, tensor).cpu().clone()
        return state if self.topo.is_main else None


class ComposedPipeline(Composition, PipelineProbe, GPipe):
    """A plan with pipeline stages: the TP/CP model cut into pp x v stages, each dp replica its own pipeline."""

    def wrap(self, model):
        model = self.compose(model)
        fields = get_spec(self.name).plan_fields(self.topo.world_size, self.options)
        self.schedule_class, self.virtual_stages = SCHEDULES[fields["schedule"]], fields["virtual_stages"]
        return super().wrap(model)

    def pipeline_group(self):
        pp = self.mesh["pp"]
        return pp.get_group(), pp.get_local_rank(), pp.size()

    def make_stage(self, model, units):
        return NeoXStage(model, units, sequence_shards=self.tp_size if self.sp else 1, position_ids=self.shard_positions)

    def build_schedule(self, stages):
        if self.schedule_class is ScheduleInterleaved1F1B:
            return ScheduleInterleaved1F1B(stages, self.n_microbatches, loss_fn=self.loss)
        return self.schedule_class(stages[0], self.n_microbatches, loss_fn=self.loss)

    def sync_gradients(self) -> None:
        self.sum_partial_gradients([p for p in self.model.parameters() if getattr(p, "sequence_parallel", False)])
        self.average_replica_gradients()

    def reduce_losses(self, losses):
        mine = losses.detach().float().clone() if self.holds_last else torch.zeros_like(losses, dtype=torch.float32)
        return self.mean_over_ranks_holding(mine, self.dp_size * self.cp_size * self.tp_size)


def composed_strategy(model, topo, training: dict, options: dict, name: str = "composed") -> Strategy:
    """The registry's entry point: a pipeline run when the plan has stages, otherwise a single-stage one."""
    cls = ComposedPipeline if options.get("pp", 1) > 1 else ComposedPlan
    return cls(model, topo, training, options, name=name)
