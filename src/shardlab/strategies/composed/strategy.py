"""A composed plan's run: one named mesh `(pp, dp, cp, tp)` from the Plan (tp innermost, so that a
tensor-parallel group sits inside a node), the model parallelized on it by `parallelize.parallelize`
(TP + SP, CP, pipeline stages or FSDP2, in that order), and the step the shared loop runs, top to
bottom in this file:

1. this rank's share of the batch: its dp rank's rows, and of them its cp rank's zig-zag shard;
2. forward and backward: plain autograd on the whole model, or one pipeline schedule step (which the
   pipeline probe wraps: bubble and per-stage memory measured on untimed steps);
3. gradient reduction over exactly the dimensions that replicate a parameter: SP's partial sums
   (LayerNorms and row-parallel biases applied to one sequence shard) over `tp`; every parameter's
   replicas over `dp` x `cp` (one flattened group, over which FSDP2, if used, has averaged already),
   all-reduced, or reduce-scattered into the distributed optimizer's shard (ZeRO-1);
4. the optimizer step on this rank's parameters (ZeRO-1: on its shard, then the parameters gathered).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from shardlab.strategies import get_spec
from shardlab.strategies.base import Strategy, build_optimizer
from shardlab.strategies.composed.distributed_optimizer import DistributedOptimizer
from shardlab.strategies.composed.parallelize import parallelize
from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies.expert_parallel.moe import MoEConfig, TokenRanks, global_expert_name, install_moe
from shardlab.strategies.mesh import all_reduce_gradients, average_gradients
from shardlab.strategies.pipeline_parallel.probe import PipelineProbe
from shardlab.strategies.portable import Held, as_held, chunked


class ComposedStrategy(Strategy):
    """A Plan's degrees composed on one mesh: dp (replicas, ZeRO-1 or FSDP2) x cp x tp (+sp), with or without
    pp stages."""

    distributed_optimizer: DistributedOptimizer | None = None
    moe_layers: list = []  # the mixture-of-experts model's MoE MLPs (composed_moe)
    expert_ids: frozenset = frozenset()

    def wrap(self, model):
        spec = get_spec(self.name)
        plan = spec.plan_fields(self.topo.world_size, self.options)
        self.tp_size, self.cp_size, self.sp = plan["tp"], plan["cp"], plan["sp"]
        self.zero1 = plan.get("framework") == "torch" and plan.get("zero") == 1
        self.lay_out(plan, experts=spec.model is not None)
        if spec.model:
            self.install_experts(model, plan["ep"])
        self.parts = parallelize(model, self.mesh, plan, replicas=self.replica_mesh, seq_len=self.training["seq_len"],
                                 dtype=self.training["dtype"], device=self.topo.device, comm=self.comm)
        self.pipeline = self.parts.pipeline
        self.probe = PipelineProbe(self.pipeline, self._schedule_step, self.training["warmup_steps"]) \
            if self.pipeline else None
        # The experts' parameters as parallelized (expert tensor parallelism replaces them).
        self.expert_ids = {id(p) for layer in self.moe_layers for p in layer.experts.parameters()}
        if self.moe_layers and self.pipeline:  # the schedule's loss is the last stage's: each layer adds its own
            for layer in self.moe_layers:
                layer.aux_grad_scale = self.moe_cfg.aux_loss_coef
        return self.parts.module

    def lay_out(self, plan: dict, experts: bool) -> None:
        """The mesh, its dp dimension and the ranks holding the same parameters (dp x cp); for a mixture of
        experts, dp carved into edp x ep, ep innermost (as Megatron-Core)."""
        pp, dp, cp, tp = plan["pp"], plan["dp"], plan["cp"], plan["tp"]
        if experts:
            self.mesh = self.topo.mesh(pp=pp, edp=dp // plan["ep"], ep=plan["ep"], cp=cp, tp=tp)
            self.dp_mesh = self.topo.flattened(self.mesh, "edp", "ep")
            self.replica_mesh = self.topo.flattened(self.mesh, "edp", "ep", "cp")
        else:
            self.mesh = self.topo.mesh(pp=pp, dp=dp, cp=cp, tp=tp)
            self.dp_mesh = self.mesh["dp"]
            self.replica_mesh = self.topo.flattened(self.mesh, "dp", "cp")

    def install_experts(self, model, ep: int) -> None:
        """Mixture-of-experts MLPs holding this rank's experts of its ep group; the queues of every expert
        span the whole dp group (all the ranks with different tokens), as on one device."""
        self.moe_cfg = MoEConfig.from_options({"seed": self.training["seed"], **self.options})
        dp_rank = self.dp_mesh.get_local_rank()
        members = tuple(range(dp_rank - dp_rank % ep, dp_rank - dp_rank % ep + ep))
        self.moe_layers = install_moe(model, self.moe_cfg, self.mesh["ep"].get_group(), dp_rank % ep, ep,
                                      TokenRanks(self.dp_mesh.get_group(), dp_rank, members))
        model.to(self.topo.device)
        for layer in self.moe_layers:
            layer.comm_timer = self.comm

    def make_optimizer(self):
        if not self.zero1:
            return super().make_optimizer()
        self.distributed_optimizer = DistributedOptimizer(
            self.model.parameters(), self.replica_mesh.get_group(), lambda shard: build_optimizer(shard, self.training),
            self.comm)
        return self.distributed_optimizer.optimizer  # the run's optimizer over this rank's shard

    @property
    def recompute(self) -> str:
        return self.options.get("recompute", super().recompute)

    # --- where this rank sits on the mesh -------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    @property
    def dp_group(self):
        return self.dp_mesh.get_group()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    # --- 1. this rank's share of the batch ------------------------------------------------
    def local_batch(self, inputs, labels):
        """This dp rank's rows, and of them this cp rank's zig-zag shard of each sequence."""
        inputs, labels = super().local_batch(inputs, labels)
        if self.cp_size == 1:
            return inputs, labels
        return zigzag.shard(inputs, self.cp_rank, self.cp_size), zigzag.shard(labels, self.cp_rank, self.cp_size)

    def micro_batches(self, inputs, labels):
        if self.pipeline:
            return [(inputs, labels)]  # the schedule cuts micro-batches itself
        return super().micro_batches(inputs, labels)

    def position_ids(self, inputs):
        shard = self.parts.shard_positions
        return None if shard is None else shard.expand(inputs.shape[0], -1)

    # --- 2. forward and backward ----------------------------------------------------------
    def autocast(self):
        return contextlib.nullcontext() if self.parts.fsdp else super().autocast()  # FSDP2 casts its gathered weights

    def accumulating(self, last: bool):
        if self.parts.fsdp and not self.pipeline:  # a pipeline's stages hold back their own reduce-scatters
            self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)

    def forward_backward(self, inputs, labels, scale):
        if self.pipeline:
            return self.probe.step(inputs, labels)  # the probe runs `_schedule_step`, measured or not
        for layer in self.moe_layers:  # the load-balancing loss, scaled as the language-model loss is
            layer.aux_grad_scale = self.moe_cfg.aux_loss_coef * scale
        loss = self.compute_loss(inputs, labels)
        (loss * scale).backward()
        return loss.detach()

    def _schedule_step(self, inputs, labels):
        return self.pipeline.step(inputs, labels, self.autocast())

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        if self.pipeline:
            self.probe.evaluated()
            return self.pipeline.evaluate(inputs, labels, self.autocast())
        return self.compute_loss(inputs, labels)

    # --- 3. gradients: over exactly the dimensions that replicate each parameter -------------
    def sync_gradients(self) -> None:
        self.sum_partial_gradients(self.parts.partial_sum_params)
        if not self.parts.fsdp:  # FSDP2's reduce-scatter has averaged over dp x cp already
            self.average_replica_gradients()
        if self.moe_layers:
            self.reduce_expert_gradients()

    def sum_partial_gradients(self, params) -> None:
        """SP: parameters applied to one sequence shard hold partial sums of their gradient; add them up."""
        if self.sp:
            with self.comm.blocked():
                all_reduce_gradients(params, self.mesh["tp"].get_group())

    def average_replica_gradients(self) -> None:
        """Average every gradient over the ranks that hold the same parameters, dp x cp: all of it on every
        replica, or (ZeRO-1) this rank's partition only."""
        if self.distributed_optimizer:
            self.distributed_optimizer.reduce_gradients()
        else:
            average_gradients(self.dense_parameters(), self.replica_mesh, self.comm)

    def dense_parameters(self):
        return [p for p in self.model.parameters() if id(p) not in self.expert_ids]

    def reduce_expert_gradients(self) -> None:
        """An expert's gradient sums the tokens of its ep group's ranks (they came back through the
        all-to-all); its copies in the other ep groups hold the rest: summed over edp, it is the whole
        batch's, divided by dp for the mean of the ranks' mean losses."""
        experts = [p for p in self.model.parameters() if id(p) in self.expert_ids]
        for p in experts:
            if p.grad is None:  # an expert no token reached on this rank: its copies' sum still needs it
                p.grad = torch.zeros_like(p)
        with self.comm.blocked():
            all_reduce_gradients(experts, self.mesh["edp"].get_group(), divide_by=self.dp_size)

    # --- 4. the optimizer step ---------------------------------------------------------------
    def optimizer_step(self) -> None:
        # every rank steps the parameters it holds (its TP shard, stages, FSDP2 shard, ZeRO-1 partition)
        (self.distributed_optimizer or self.optimizer).step()

    def zero_grad(self) -> None:
        if self.distributed_optimizer:
            self.distributed_optimizer.zero_grad()  # the gradients are views of its buffer: zeroed, kept
        else:
            super().zero_grad()

    # --- losses, checkpoints, results ----------------------------------------------------------
    def reduce_losses(self, losses):
        """Global-batch mean losses from the ranks' local means: a sum over the world (ranks that hold no
        loss, pipeline stages before the last, contribute zeros) divided by the number of ranks holding
        one per replica and shard."""
        holds_loss = self.pipeline is None or self.pipeline.holds_last
        mine = losses.detach().float().clone() if holds_loss else torch.zeros_like(losses, dtype=torch.float32)
        dist.all_reduce(mine)
        return mine / (self.dp_size * self.cp_size * self.tp_size)

    def resume_at(self, step):
        if self.probe:
            self.probe.resume_at(step)

    # --- the whole training state -----------------------------------------------------------
    @property
    def holds_every_parameter(self) -> bool:
        return self.pipeline is None and not self.moe_layers  # else each rank its stages and experts

    def held_parameters(self):
        """Each parameter under its whole model's name (a stage's under the unsplit model's, an expert under
        its global index), split by FSDP2 over dp x cp (a DTensor) and by hand over tp."""
        modules = self.pipeline.modules if self.pipeline else self.model
        names = self.pipeline.hf_names if self.pipeline else {id(p): n for n, p in self.model.named_parameters()}
        first = self.moe_layers[0].first_expert if self.moe_layers else 0
        return [self._held(global_expert_name(names[id(p)], first), names[id(p)], p) for p in modules.parameters()]

    def _held(self, name: str, local_name: str, param) -> Held:
        replicas = as_held(name, param)
        dim = self.parts.tp_shard_dims.get(local_name)
        if dim is None:
            return replicas
        tp = chunked(name, param, dim, self.mesh["tp"].get_group())
        return Held(name, param, tp.shape, whole=lambda t: tp.whole(replicas.whole(t)),
                    cut=lambda w: replicas.cut(tp.cut(w)))

    def optimizer_states(self, held):
        if not self.distributed_optimizer:
            return super().optimizer_states(held)
        optimizer = self.distributed_optimizer
        by_param = dict(zip(map(id, optimizer.params), optimizer.param_states()))
        return [by_param.get(id(h.param), {}) for h in held]

    def set_optimizer_states(self, held, states):
        if not self.distributed_optimizer:
            return super().set_optimizer_states(held, states)
        by_param = {id(h.param): state for h, state in zip(held, states)}
        self.distributed_optimizer.set_param_states([by_param[id(p)] for p in self.distributed_optimizer.params])

    def full_state_dict(self):
        if self.moe_layers:
            raise NotImplementedError("mixture-of-experts runs do not save a Hugging Face model (the MoE MLP is ours)")
        return super().full_state_dict()

    def extra_metrics(self) -> dict:
        if not self.pipeline:
            return {}
        self.probe.measure_after_training(self.zero_grad)
        return {**self.pipeline.metrics(), **self.probe.metrics()}


def composed_strategy(model, topo, training: dict, options: dict, name: str = "composed") -> Strategy:
    """The registry's entry point."""
    return ComposedStrategy(model, topo, training, options, name=name)
