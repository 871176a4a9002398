"""A mixture-of-experts variant of the GPT-NeoX MLP, shared by the unsharded reference and expert parallelism.

Each token's router picks its top-k experts; the chosen experts' outputs are mixed with the
renormalised router probabilities. Experts are GPT-NeoX MLPs of `expert_intermediate_size`
(default: the dense size / top_k, so a token's active MLP parameters equal the dense model's).

Capacity: each expert takes at most floor(capacity_factor · tokens · k / experts) assignments per
forward; assignments queue in (choice slot, rank, token) order, i.e. first choices before second
choices and, within a slot, in the global batch order. Assignments past the capacity are dropped
(the token keeps only its residual path for that choice). The queue is computed from every rank's
routing counts (one small all-gather), so the sharded model drops exactly the tokens the unsharded
one does and the two stay numerically equal.

Load balancing (Switch Transformer): aux = E · Σ_e f_e · P_e, with f_e the fraction of assignments
routed to e over the whole batch (a constant) and P_e the mean router probability of e. Because f
is global and P a mean, each rank adds E · Σ_e f_e · P_e(local tokens); averaging ranks' gradients
gives exactly the full-batch gradient.

In a composed plan the ranks that hold different tokens (the data-parallel group, `count_group`) can
be more than the ranks that share one set of experts (an `ep` group carved from it, as Megatron-Core
and torchtitan carve it): the queue is still computed over every token-holding rank, so drops match
the unsharded model, and tokens travel only inside the ep group. There the load-balancing loss reaches
the router through `AuxLossScaler` (Megatron's MoEAuxLossAutoScaler): a pipeline's loss function sees
only the last stage's logits, so each layer adds its loss's gradient in its own backward.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from shardlab.strategies.expert_parallel.comms import all_to_all, gather_counts


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    expert_intermediate_size: int | None = None  # None: dense intermediate_size // top_k
    seed: int = 0  # experts and router are initialised from this seed, identically in every run

    @classmethod
    def from_options(cls, options: dict) -> "MoEConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)


MOE_OPTION_KEYS = tuple(f.name for f in fields(MoEConfig))


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    return max(1, math.floor(capacity_factor * tokens * top_k / num_experts))


def capacity_plan(all_counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's assignment counts [ranks, k, E]: each (rank, slot, expert)'s place in the expert's
    queue, and the assignments kept per (rank, slot, expert) under `capacity`."""
    per_slot = all_counts.sum(0)  # [k, E]
    earlier_slots = per_slot.cumsum(0) - per_slot
    earlier_ranks = all_counts.cumsum(0) - all_counts
    offsets = earlier_slots.unsqueeze(0) + earlier_ranks
    kept = (capacity - offsets).clamp(min=0).minimum(all_counts)
    return offsets, kept


class Expert(nn.Module):
    """One GPT-NeoX MLP (h -> ffn -> h)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, intermediate)
        self.act = ACT2FN[act]
        self.dense_4h_to_h = nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class AuxLossScaler(torch.autograd.Function):
    """Identity on a layer's output whose backward also starts the load-balancing loss's backward with
    gradient `scale` (the coefficient times the step's loss scale)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device), None


@dataclass(frozen=True)
class TokenRanks:
    """The ranks whose tokens share the experts' queues (`group`; None: the ep group alone), this rank's
    place among them, and the places of the ep group's members (in ep order)."""

    group: object = None
    rank: int = 0
    ep_members: tuple[int, ...] | None = None


class MoEMLP(nn.Module):
    """Top-k routed experts; this rank holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""

    def __init__(self, model_config, cfg: MoEConfig, layer: int, ep_group=None, ep_rank: int = 0, ep_size: int = 1,
                 tokens: TokenRanks | None = None):
        super().__init__()
        hidden, E = model_config.hidden_size, cfg.num_experts
        if E % ep_size:
            raise ValueError(f"{E} experts cannot be split evenly over {ep_size} expert-parallel ranks")
        self.cfg, self.group, self.ep_rank, self.ep_size = cfg, ep_group, ep_rank, ep_size
        self.tokens = tokens or TokenRanks(ep_group, ep_rank, tuple(range(ep_size)))
        self.aux_grad_scale: float | None = None  # set: the load-balancing loss's backward runs via AuxLossScaler
        self.per_rank = E // ep_size
        self.first_expert = ep_rank * self.per_rank
        ffn = cfg.expert_intermediate_size or model_config.intermediate_size // cfg.top_k
        std = model_config.initializer_range

        # Build every expert from one seeded generator, then keep this rank's: all runs start identical.
        gen = torch.Generator().manual_seed(cfg.seed * 1009 + layer)
        self.router = nn.Linear(hidden, E, bias=False)
        experts = [Expert(hidden, ffn, model_config.hidden_act) for _ in range(E)]
        with torch.no_grad():
            for module in [self.router, *experts]:
                for name, p in module.named_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * std if name.endswith("weight") else torch.zeros(p.shape))
        self.experts = nn.ModuleList(experts[self.first_expert:self.first_expert + self.per_rank])
        self.comm_timer = None
        self.aux_loss = None
        self.reset_stats()

    def reset_stats(self):
        E = self.cfg.num_experts
        self.routed = torch.zeros(E, dtype=torch.long)  # assignments routed to each expert (whole group)
        self.kept = torch.zeros(E, dtype=torch.long)  # of those, within capacity
        self.local_tokens_dropped = 0  # this rank's tokens that lost every choice
        self.local_tokens = 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        n, k, E = tokens.shape[0], self.cfg.top_k, self.cfg.num_experts

        probs = self.router(tokens).float().softmax(dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)  # [n, k]
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        onehot = F.one_hot(top_e, E)  # [n, k, E]
        all_counts = gather_counts(onehot.sum(0), self.tokens.group)  # [token ranks, k, E]
        total_tokens = int(all_counts[:, 0].sum())
        capacity = expert_capacity(self.cfg.capacity_factor, total_tokens, k, E)
        offsets, kept = capacity_plan(all_counts, capacity)

        # Each local assignment's place in its expert's queue; keep the ones within capacity.
        slots = torch.arange(k, device=tokens.device).expand(n, k)
        me = self.tokens.rank
        queue = (onehot.cumsum(0) - onehot).gather(-1, top_e.unsqueeze(-1)).squeeze(-1) + offsets[me][slots, top_e]
        keep = queue < capacity
        token_idx, slot_idx = keep.nonzero(as_tuple=True)
        expert_idx = top_e[token_idx, slot_idx]
        order = torch.argsort(expert_idx, stable=True)  # group by expert = group by destination rank
        token_idx, slot_idx = token_idx[order], slot_idx[order]

        kept_by_rank = kept.sum(1)  # [token ranks, E]
        mine = slice(self.first_expert, self.first_expert + self.per_rank)
        send = kept_by_rank[me].view(self.ep_size, self.per_rank).sum(1).tolist()
        from_members = kept_by_rank[list(self.tokens.ep_members), mine]  # [ep ranks, local experts]
        recv = from_members.sum(1).tolist()
        rows = tokens[token_idx]
        if self.ep_size > 1:
            rows = all_to_all(rows, send, recv, self.group, self.comm_timer)
        out = self._run_local_experts(rows, from_members)
        if self.ep_size > 1:
            out = all_to_all(out, recv, send, self.group, self.comm_timer)
        combined = torch.zeros_like(tokens).index_add(0, token_idx, (out * weights[token_idx, slot_idx].unsqueeze(-1)).to(tokens.dtype))

        self.aux_loss = E * (all_counts.sum((0, 1)).float() / (total_tokens * k) * probs.mean(0)).sum()
        if self.aux_grad_scale is not None and torch.is_grad_enabled():
            combined = AuxLossScaler.apply(combined, self.aux_loss, self.aux_grad_scale)
        if torch.is_grad_enabled():  # training forwards only, not evaluation
            self.routed += all_counts.sum((0, 1)).cpu()
            self.kept += kept.sum((0, 1)).cpu()
            self.local_tokens += n
            self.local_tokens_dropped += int((~keep).all(dim=1).sum())
        return combined.view(shape)

    def _run_local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows arrive as [source rank][local expert] blocks of `counts` [ranks, local experts]; run each
        expert on its rows and return the outputs in arrival order."""
        expert_of_row = torch.repeat_interleave(torch.arange(self.per_rank, device=rows.device).repeat(self.ep_size),
                                                counts.flatten().to(rows.device))
        order = torch.argsort(expert_of_row, stable=True)
        sizes = counts.sum(0).tolist()
        outputs = [expert(chunk) for expert, chunk in zip(self.experts, rows[order].split(sizes))]
        return torch.cat(outputs)[torch.argsort(order)]


def install_moe(model, cfg: MoEConfig, ep_group=None, ep_rank: int = 0, ep_size: int = 1,
                tokens: TokenRanks | None = None) -> list[MoEMLP]:
    """Replace every GPT-NeoX layer's MLP with a MoE MLP (this rank's experts only)."""
    layers = model.gpt_neox.layers
    moe_layers = []
    for i, layer in enumerate(layers):
        layer.mlp = MoEMLP(model.config, cfg, i, ep_group, ep_rank, ep_size, tokens)
        moe_layers.append(layer.mlp)
    return moe_layers


_LOCAL_EXPERT = re.compile(r"(\.experts\.)(\d+)(\.)")


def global_expert_name(name: str, first_expert: int) -> str:
    """A parameter's name in the whole mixture-of-experts model: this rank's local expert j is expert
    first_expert + j (every layer holds the same range); other names are unchanged."""
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + first_expert}{m[3]}", name)

