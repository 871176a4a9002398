"""Mixture-of-experts training: unsharded (`moe_single`, the reference) and expert parallel (`ep_moe`).

`ep_moe`: every rank takes its own rows of the batch (data parallel for everything but the experts)
and holds num_experts / ranks experts; tokens travel to their experts' ranks and back by all-to-all.
Gradients: the replicated parameters (attention, norms, router, embeddings, head) are averaged over
ranks; an expert's gradient already sums every rank's tokens' contributions on its owner (they came
through the all-to-all backward), so it is only divided by the number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.strategies.base import Strategy, causal_lm_loss
from shardlab.strategies.data_parallel.comms import GradientBucket
from shardlab.strategies.expert_parallel.moe import MoEConfig, global_expert_name, install_moe
from shardlab.strategies.portable import as_held


class _MixtureOfExperts(Strategy):
    """The MoE model change and its loss (language-model loss + weighted load-balancing loss)."""

    def _install(self, model, group, rank: int, size: int):
        self.moe_cfg = MoEConfig.from_options({"seed": self.training["seed"], **self.options})
        self.moe_layers = install_moe(model, self.moe_cfg, group, rank, size)
        model.to(self.topo.device)
        for layer in self.moe_layers:
            layer.comm_timer = self.comm
        self._aux = []
        return model

    def forward_backward(self, inputs, labels, scale):
        with self.autocast():
            loss = causal_lm_loss(self.model(input_ids=inputs).logits, labels)
        aux = sum(layer.aux_loss for layer in self.moe_layers)
        ((loss + self.moe_cfg.aux_loss_coef * aux) * scale).backward()
        self._aux.append(float(aux))
        return loss.detach()  # the language-model loss, comparable with a dense model's

    def full_state_dict(self):
        raise NotImplementedError("mixture-of-experts runs do not save a Hugging Face model (the MoE MLP is ours)")

    def extra_metrics(self) -> dict:
        routed = torch.stack([layer.routed for layer in self.moe_layers])  # [layers, experts], whole group
        kept = torch.stack([layer.kept for layer in self.moe_layers])
        tokens = torch.tensor([[layer.local_tokens, layer.local_tokens_dropped] for layer in self.moe_layers])
        if dist.is_initialized() and self.topo.world_size > 1 and not self.spec_single_process:
            dist.all_reduce(tokens)  # per-rank token counts -> group totals
        expert_params = [p for layer in self.moe_layers for p in layer.experts.parameters()]
        return {
            "moe": dict(self.moe_cfg.as_dict(), experts_per_rank=self.moe_layers[0].per_rank,
                        first_expert=self.moe_layers[0].first_expert),
            "expert_routed": routed.tolist(),
            "expert_kept": kept.tolist(),
            "assignments": int(routed.sum()),
            "dropped_assignments": int((routed - kept).sum()),
            "tokens_routed": int(tokens[:, 0].sum()),
            "tokens_fully_dropped": int(tokens[:, 1].sum()),
            "aux_loss_mean": sum(self._aux) / max(1, len(self._aux)),
            "expert_param_bytes": sum(p.numel() * p.element_size() for p in expert_params),
        }


class MoESingle(_MixtureOfExperts):
    """The same MoE model in one process: every expert local, no communication."""

    spec_single_process = True

    def wrap(self, model):
        return self._install(model, None, 0, 1)

    # Every rank sees the whole global batch: no data-parallel split.
    dp_rank, dp_size = 0, 1


class ExpertParallelMoE(_MixtureOfExperts):
    measures_comm = True
    spec_single_process = False

    def wrap(self, model):
        group = self.topo.mesh(ep=self.topo.world_size).get_group("ep")
        model = self._install(model, group, self.topo.rank, self.topo.world_size)
        expert_ids = {id(p) for layer in self.moe_layers for p in layer.experts.parameters()}
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids]
        self._replicated = GradientBucket("replicated", [p for p in model.parameters()
                                                         if p.requires_grad and id(p) not in expert_ids])
        return model

    holds_every_parameter = False  # each rank its experts

    def held_parameters(self):
        first = self.moe_layers[0].first_expert
        return [as_held(global_expert_name(name, first), p) for name, p in self.model.named_parameters()]

    def sync_gradients(self):
        with self.comm.blocked():
            self._replicated.launch(async_op=False)
            self._replicated.finish(self.dp_size)
        for p in self.expert_params:
            if p.grad is not None:
                p.grad /= self.dp_size  # summed over every rank's tokens already: make it the mean
