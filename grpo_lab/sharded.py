from __future__ import annotations

import contextlib
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

# %%
def mixed_precision(args) -> str:
    "accelerate's mixed precision for a run's `bf16`/`fp16` flags."
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"


def make_accelerator(args) -> Accelerator:
    """The run's `Accelerator`. Launched for FSDP (`ACCELERATE_USE_FSDP=true`) on CPU processes, it shards like FSDP on
    GPUs: accelerate 1.15 chooses FSDP only on accelerators and runs CPU processes as DDP, so grpo-lab switches the
    distributed type to FSDP once accelerate has set up the gloo process group (`shard_on_cpu`)."""
    acc = Accelerator(mixed_precision=mixed_precision(args), cpu=args.use_cpu)
    if acc.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        shard_on_cpu(acc, FullyShardedDataParallelPlugin())
    return acc

# %%
def shard_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> Accelerator:
    "Make a MULTI_CPU `accelerator` prepare models with accelerate's own FSDP2 code (`fsdp2_prepare_model`) over gloo."
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(f"shard_on_cpu needs CPU processes (distributed type MULTI_CPU), not "
                         f"{accelerator.distributed_type}: on GPUs launch with accelerate's FSDP config instead.")
    if plugin.fsdp_version != 2:
        raise ValueError(f"fsdp_version={plugin.fsdp_version}: grpo-lab shards CPU processes with FSDP2 only "
                         "(fsdp_version: 2, as `grpo-lab export --strategy fsdp` writes).")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP       # AcceleratorState's and PartialState's shared value
    from accelerate.state import PartialState
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator

# %%
def is_sharded(accelerator) -> bool:
    "Whether each process holds only a shard of every weight (FSDP)."
    return accelerator.distributed_type == DistributedType.FSDP


def prepare_reference(accelerator, ref_model):
    "The frozen reference model placed like the policy: sharded the same way under FSDP, else moved to the device."
    if ref_model is None:
        return None
    if not is_sharded(accelerator):
        return ref_model.to(accelerator.device)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    return fsdp2_prepare_model(accelerator, ref_model.to(accelerator.device))

# %%
def _fsdp_units(*models) -> list:
    "Every FSDP2 module (each holds one group of sharded parameters) of `models`."
    from torch.distributed.fsdp import FSDPModule
    return [m for model in models if model is not None for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_weights(*models):
    """Inside: every FSDP unit of `models` holds its full weights and keeps them through forwards, so a process can
    run as many forwards as it likes (generate stops at different lengths on each) with no collective. After: the
    shards again, and each unit's reshard-after-forward setting as it was."""
    units = _fsdp_units(*models)
    saved = [(state, state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
             for state in (u._get_fsdp_state() for u in units)]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info

# %%
@contextlib.contextmanager
def gathered_for_generation(trainer):
    """The policy to generate with, unwrapped; under FSDP its weights (and the reference model's) gathered for the
    generation batch when `ds3_gather_for_generation` (TRL's field, the default), else left sharded: every decoded
    token then gathers each layer, and every process steps until all are done (transformers' `synced_gpus`)."""
    acc = trainer.accelerator
    policy = acc.unwrap_model(trainer.model)
    if not is_sharded(acc):
        yield policy
    elif trainer.args.ds3_gather_for_generation:
        with gathered_weights(policy, trainer.ref_model):
            yield policy
    else:
        flag = getattr(policy, "_is_fsdp_managed_module", False)
        policy._is_fsdp_managed_module = True       # transformers' FSDP2 flag: generate then keeps processes in step
        try:
            yield policy
        finally:
            policy._is_fsdp_managed_module = flag

# %%
def full_state_dict(trainer) -> dict | None:
    """The policy's whole state dict on the main process under FSDP (every process must call it: it gathers);
    None elsewhere or when nothing is sharded (`save_pretrained` then reads the model itself)."""
    acc = trainer.accelerator
    if not is_sharded(acc):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(trainer.model, options=options)     # {} on the other processes

# %%
class _GatheredPolicy:
    "The policy as a checkpoint reads and writes it under FSDP: whole weights saved, whole weights loaded into shards."
    def __init__(self, model, state_dict):
        self._model, self._state_dict = model, state_dict

    def __getattr__(self, name):
        return getattr(self._model, name)

    def save_pretrained(self, path, **kwargs):
        self._model.save_pretrained(path, state_dict=self._state_dict, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(self._model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))

    def tie_weights(self):
        "Tied weights are one parameter under FSDP: nothing to re-tie."


class _GatheredOptimizer:
    "The optimizer's whole state (keyed by parameter name) under FSDP, saved by the main process, loaded by each."
    def __init__(self, model, optimizer, state_dict=None):
        self._model, self._optimizer, self._state_dict = model, optimizer, state_dict

    def state_dict(self):
        return self._state_dict

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self._model, self._optimizer, state_dict,
                                 options=StateDictOptions(full_state_dict=True))


def checkpoint_parts(trainer) -> tuple:
    """The policy and optimizer as a checkpoint saves and loads them: as they are, or under FSDP gathered whole (every
    process must call it: it gathers) so that the checkpoint holds the model itself, as DDP's does."""
    acc = trainer.accelerator
    policy, optimizer = acc.unwrap_model(trainer.model), trainer.optimizer
    if not is_sharded(acc):
        return policy, optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    inner = getattr(optimizer, "optimizer", optimizer)         # accelerate's AcceleratedOptimizer wraps the torch one
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (_GatheredPolicy(policy, full_state_dict(trainer)),
            _GatheredOptimizer(policy, inner, get_optimizer_state_dict(policy, inner, options=options)))


def resume_parts(trainer) -> tuple:
    "The policy and optimizer as a checkpoint loads into them (under FSDP: whole tensors into each process's shards)."
    acc = trainer.accelerator
    policy, optimizer = acc.unwrap_model(trainer.model), trainer.optimizer
    if not is_sharded(acc):
        return policy, optimizer
    return _GatheredPolicy(policy, None), _GatheredOptimizer(policy, getattr(optimizer, "optimizer", optimizer))

# %%
def held_bytes(trainer) -> dict:
    "The bytes of parameters and optimizer states this process holds (its shards under FSDP)."
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = sum(local(p) for p in trainer.model.parameters())
    states = sum(local(v) for s in trainer.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    return {"parameters": params, "optimizer": states, "total": params + states}
