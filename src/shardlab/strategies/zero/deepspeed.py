"""The ZeRO ladder through DeepSpeed: stages 0-3, optimizer offload (stage 2) and full offload (stage 3).

DeepSpeed owns backward, gradient reduction and the optimizer step: following its idiom, every
micro-batch runs `engine.backward(loss)` then `engine.step()`, and the engine itself decides when a
gradient-accumulation boundary has been reached (it scales the loss by 1/accumulation steps and
reduces/partitions gradients there). The shared loop's `optimizer_step`/`zero_grad` are no-ops.

bf16 at stage 0 is DeepSpeed's FP16_UnfusedOptimizer (its "DDP_BFLOAT16" path; DeepSpeed 0.19 refuses
fp32 gradient accumulation there, so BF16_Optimizer is not an option). Its constructor runs one
optimizer step on zero gradients to create the optimizer's state, so AdamW starts counting at step 1:
every later update uses the bias corrections of the next step (the first is ~0.74x as large) and, with
weight decay, the master weights are decayed once before training. That, not precision, is why zero0
in bf16 ends at a different loss than the other rungs (measured: resetting the step count removes the
difference exactly); `adam_steps` in tests/test_cost_grid.py keeps it in view. Left as DeepSpeed does it.

Memory is counted from what the rank really holds: unique tensor storages (so padding of DeepSpeed's
flat, aligned buffers is included, and a buffer shared by two roles is counted once), under the
ZeRO paper's split: parameters, gradients, optimizer state (= fp32 master partition + moments).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from shardlab.strategies.base import Strategy, causal_lm_loss, build_optimizer
from shardlab.strategies.portable import Held, IncompatibleCheckpoint
from shardlab.strategies import get_spec
from shardlab.strategies.zero.settings import deepspeed_config, rung_settings


def _storages(tensors):
    """(key, nbytes) of each tensor's storage; empty/None tensors (e.g. released stage-3 params) skipped."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            yield t.untyped_storage()._cdata, t.untyped_storage().nbytes()


def count_unique(tensors, seen: set) -> int:
    total = 0
    for key, nbytes in _storages(tensors):
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def _flatten(obj):
    """Tensors inside nested lists/dicts (DeepSpeed keeps per-group lists and dicts of partitions)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


def device_memory_bytes(device: torch.device) -> int:
    """What a rank may fill: the accelerator's memory, or the host's RAM on CPU (the planner's budget)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class DeepSpeedZero(Strategy):
    """Any rung of the ladder: its stage and offload are the Plan fields of the registry entry that built it."""

    def wrap(self, model: nn.Module) -> nn.Module:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        plan = get_spec(self.name).plan_fields(self.topo.world_size, self.options)
        self.settings = rung_settings(plan, self.options)
        n_params = sum(p.numel() for p in model.parameters())
        self.ds_config = deepspeed_config(plan, self.training, self.options, self.dp_size, n_params)
        client = build_optimizer(model.parameters(), self.training)
        self.engine, self._ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client, config=self.ds_config, dist_init_required=False)
        self._grad_bytes = None
        return self.engine

    def make_optimizer(self):
        return self._ds_optimizer

    def artifacts(self) -> dict:
        return {"ds_config.json": self.ds_config}

    @property
    def stage(self) -> int:
        return self.ds_config["zero_optimization"]["stage"]

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()  # precision is DeepSpeed's (bf16 section of the JSON)

    def forward_backward(self, inputs, labels, scale):
        gas = self.ds_config["gradient_accumulation_steps"]
        assert abs(scale * gas - 1.0) < 1e-9, "the loop's micro-batches must match DeepSpeed's accumulation steps"
        loss = causal_lm_loss(self.engine(input_ids=inputs).logits, labels)
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        if self._grad_bytes is None and self.engine.is_gradient_accumulation_boundary():
            self._grad_bytes = self._count_grads()  # reduced gradients exist only until the step frees them
        self.engine.step()
        return loss.detach()

    def optimizer_step(self) -> None:
        pass  # engine.step() ran after each micro-batch; it steps at the accumulation boundary

    def zero_grad(self) -> None:
        pass  # the engine clears gradients inside step()

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        return causal_lm_loss(self.engine(input_ids=inputs).logits, labels)

    @property
    def probe_module(self):
        return self.engine.module

    # --- what this rank holds --------------------------------------------------------------
    def _param_tensors(self):
        params = list(self.engine.module.parameters())
        if self.stage == 3:
            return [p.ds_tensor for p in params]  # this rank's partition; p.data is empty between uses
        return params  # stages 1-2: views into DeepSpeed's flat (padded) buffers, counted whole

    def _count_grads(self) -> int:
        opt = self._ds_optimizer
        seen: set = set()
        count_unique(self._param_tensors(), seen)  # never count a parameter buffer as a gradient
        grads = [p.grad for p in self.engine.module.parameters()]
        for attr in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
            grads += list(_flatten(getattr(opt, attr, None)))
        grads += [t.grad for t in self._master_partitions()]  # with offload: the fp32 gradient partition on the host
        return count_unique(grads, seen)

    def _master_partitions(self) -> list:
        opt = self._ds_optimizer
        return [*_flatten(getattr(opt, "single_partition_of_fp32_groups", None)),  # stages 1-2
                *_flatten(getattr(opt, "fp32_partitioned_groups_flat", None)),  # stage 3
                # stage 0 in bf16/fp16: FP16_UnfusedOptimizer's per-tensor fp32 copies (FP16_Optimizer's flat one)
                *_flatten(getattr(opt, "fp32_groups", None)), *_flatten(getattr(opt, "fp32_groups_flat", None))]

    def state_bytes(self) -> dict[str, int]:
        opt = self._ds_optimizer
        seen: set = set()
        param_bytes = count_unique(self._param_tensors(), seen)
        master = self._master_partitions()
        inner = getattr(opt, "optimizer", opt)  # ZeRO wraps our torch optimizer; stage 0 may not
        moments = [t for state in inner.state.values() for t in state.values()]
        optimizer_bytes = count_unique(master + moments, seen)
        return {"param_bytes": param_bytes, "grad_bytes": self._grad_bytes or 0, "optimizer_bytes": optimizer_bytes,
                "device_memory_bytes": device_memory_bytes(self.topo.device),
                "zero_stage": self.stage, "offload_optimizer": self.settings["offload_optimizer"],
                "offload_param": self.settings["offload_param"]}

    # --- the whole training state, through DeepSpeed's own accessors -------------------------
    @property
    def _inner_optimizer(self):
        return getattr(self._ds_optimizer, "optimizer", self._ds_optimizer)  # ZeRO wraps our torch optimizer

    def _plain_optimizer(self, with_optimizer: bool = True) -> bool:
        """Stage 0: DeepSpeed steps the module's own parameters. In fp32 the optimizer is our torch one; in bf16
        DeepSpeed's FP16_UnfusedOptimizer keeps fp32 masters it has no whole-state accessors for, so its state
        cannot be written or read (its bf16 weights can be saved)."""
        if self.stage > 0:
            return False
        if with_optimizer and not isinstance(self._ds_optimizer, torch.optim.Optimizer):
            raise IncompatibleCheckpoint(f"{self.name} in {self.training['dtype']}: DeepSpeed's "
                                         f"{type(self._ds_optimizer).__name__} keeps the fp32 master weights, and "
                                         "it has no whole-state accessors (stages 1-3 do)")
        return True

    def held_parameters(self):
        """The module's parameters, whole or (stage 3) partitioned: then `ds_shape` is their whole shape."""
        return [Held(name, p, torch.Size(getattr(p, "ds_shape", p.shape)), cut=lambda w, p=p: w.to(p.device))
                for name, p in self.engine.module.named_parameters()]

    def whole_state(self, held, with_optimizer=True):
        """The fp32 master weights and the optimizer's states of each parameter, whole: DeepSpeed's
        safe_get_full_* accessors (stage 3 gathers: collective). AdamW's step count is the inner optimizer's."""
        if self._plain_optimizer(with_optimizer):
            return super().whole_state(held, with_optimizer)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        stepped = next(iter(self._inner_optimizer.state.values()), {}) if with_optimizer else {}
        out = []
        for h in held:
            states = {k: safe_get_full_optimizer_state(h.param, k) for k in stepped if k != "step"}
            out.append((safe_get_full_fp32_param(h.param), dict(states, step=stepped["step"]) if stepped else {}))
        return out

    def restore(self, held, read):
        """Master weights and optimizer states set through DeepSpeed's safe_set_full_* (each rank keeps its
        partition); the module's own parameters too (stage 3: gathered, set, partitioned again)."""
        if self._plain_optimizer():
            return super().restore(held, read)
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        wholes = [read(h.name) for h in held]
        states = wholes[0][1] if wholes else {}
        if states:
            self._create_optimizer_state(states)
        for h, (param, optimizer) in zip(held, wholes):
            param = param.to(self.topo.device)
            safe_set_full_fp32_param(h.param, param)
            with deepspeed.zero.GatheredParameters([h.param], modifier_rank=0, enabled=self.stage == 3):
                h.param.data.copy_(param)
            for key, value in optimizer.items():
                if key != "step":
                    safe_set_full_optimizer_state(h.param, value.to(self.topo.device), key)

    def _create_optimizer_state(self, like: dict) -> None:
        """DeepSpeed's optimizer creates its state in its first step: make it now (the keys of `like`, zeros to
        be overwritten, its step count), over the fp32 master partitions the inner optimizer steps, and link it to the
        parameters' fragments (stages 1-2) so that the setters find it."""
        inner = self._inner_optimizer
        for flat in self._master_partitions():
            inner.state[flat] = {k: v.clone() if k == "step" else torch.zeros_like(flat) for k, v in like.items()}
        if hasattr(self._ds_optimizer, "_lazy_init_hp_params_optimizer_state"):
            self._ds_optimizer._hp_optimizer_states_linked = False
            self._ds_optimizer._lazy_init_hp_params_optimizer_state()
