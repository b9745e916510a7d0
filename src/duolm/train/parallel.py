"""Training on several processes (torchrun): DDP replicas or FSDP2 shards, and their state on disk.

    with process_group(device) as (dev, rank): ...   # under torchrun, in its process group (gloo or NCCL)
    fwd = wrap(model, "fsdp", world, device, precision)   # FSDP2 over each transformer block, then the root:
                                               # parameters, gradients and optimizer state sharded over the processes
    with activation_checkpointing(model): ...  # each block's activations recomputed in the backward pass
    with no_sync(fwd, sync=False): ...         # a micro-batch whose gradients are not reduced yet
    save_shards(model, optimizer, folder)      # every rank writes its shards (DCP), nothing gathered
    load_shards(model, optimizer, folder)      # at any number of processes, sharded or not (DCP reshards)
    model_state(model)                         # every rank calls it; rank 0 holds the whole state (RUN/best/)

A sharded run's checkpoint holds its model and optimizer state as DCP shards (duolm.dcp), keyed by parameter name,
so it resumes at any number of processes and under either kind, and duolm.load reads it in one process; a DDP or
one-process checkpoint (one file, optimizer state keyed by position) resumes under FSDP too.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

PARALLEL = ("ddp", "fsdp")
# FSDP2, its state dicts and DCP take ~1 s to import: a run imports them when it shards or touches shards (every
# command and program that never does starts without them); a model is FSDP's only after fully_shard, imported here.
FSDP = "torch.distributed.fsdp"


def setup_distributed(device: str | None = None, env=os.environ):
    """-> (device, rank). Under torchrun (WORLD_SIZE > 1) joins the process group: NCCL on GPUs, gloo on CPU."""
    world = int(env.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    dev = torch.device(device or ("cuda" if cuda else "cpu"))
    if world > 1:
        if cuda:
            dev = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
    return dev, (dist.get_rank() if world > 1 else 0)


def rank_world() -> tuple[int, int]:
    """(this process's rank, the number of processes): (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def process_group(device: str | None = None, env=os.environ):
    """setup_distributed() for the block inside, which gets (device, rank); the process group it joined is left on
    exit (one joined already, by an enclosing block, is left to that block)."""
    joined = dist.is_available() and dist.is_initialized()
    try:
        yield setup_distributed(device, env)
    finally:
        if not joined and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def wrap(model: nn.Module, parallel: str, world: int, device: torch.device, precision: str = "fp32") -> nn.Module:
    """The module the training steps run: `model` itself in one process; DDP replicas; or `model` sharded in
    place by FSDP2, each transformer block a unit and the root (embeddings, final norm, heads) the last. FSDP's
    gradient reduction averages over the processes, as DDP's does. Under FSDP, precision "bf16" (resolved:
    duolm.precision.resolve) gathers the parameters in bf16 for the forward and backward and reduces the gradients
    in fp32 into the fp32 shards the optimizer updates."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL}")
    if world == 1:
        return model
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    return shard(model, init_device_mesh(device.type, (world,)), precision)


def shard(model: nn.Module, mesh, precision: str = "fp32") -> nn.Module:
    """FSDP2 over `mesh`, in place: each transformer block a unit, then the root. precision "bf16": the parameters
    gathered in bf16, the gradients reduced in fp32 (MixedPrecisionPolicy); otherwise all in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else \
        MixedPrecisionPolicy()
    for block in model.backbone.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
        if hasattr(block, "cls"):       # BERT's last block at [CLS] alone (Bert.pooled): gathered as for forward
            register_fsdp_forward_method(block, "cls")
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, on: bool = True):
    """Inside (when `on`), each transformer block keeps only its input for the backward pass and recomputes the rest
    there (torch.utils.checkpoint, non-reentrant; dropout's random state saved and replayed, so the gradients are
    the same): one block's activations held at a time instead of all, for one more forward. Restored on exit."""
    blocks = list(model.backbone.h) if on else []
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward                 # the class's forward again


@contextlib.contextmanager
def no_sync(fwd: nn.Module, sync: bool):
    """The backward passes inside reduce their gradients over the processes only when `sync` (the last
    micro-batch of a step); in one process there is nothing to reduce."""
    if sync or not (isinstance(fwd, nn.parallel.DistributedDataParallel) or sharded(fwd)):
        yield
    elif sharded(fwd):
        fwd.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fwd.set_requires_gradient_sync(True)
    else:
        with fwd.no_sync():
            yield


def sharded(model: nn.Module) -> bool:
    return FSDP in sys.modules and isinstance(model, sys.modules[FSDP].FSDPModule)


def _gathered():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())


def model_state(model: nn.Module) -> dict | None:
    """A sharded model's state dict gathered whole on rank 0 (the other ranks get an empty dict; every rank must
    call it); None for a plain model, whose own state_dict() is whole."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_gathered()) if sharded(model) else None


def _states(model: nn.Module, optimizer) -> dict:
    """This rank's state of the model and (unless None) the optimizer, keyed by parameter name: shards of a sharded
    model, whole tensors of a plain one (a fresh optimizer's state made first, by a step of lr 0)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_shards(model: nn.Module, optimizer, folder) -> None:
    """Every rank writes its shards of the model's and the optimizer's state into `folder` (duolm.dcp), at once."""
    from duolm import dcp
    dcp.write(_states(model, optimizer), folder)


def load_shards(model: nn.Module, optimizer, folder) -> None:
    """The state save_shards wrote, at any number of processes, into a sharded or plain `model` (and `optimizer`,
    unless None); every rank of the process group calls it, or one process alone."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from duolm import dcp
    state = _states(model, optimizer)
    dcp.read(state, folder, collective=dist.is_available() and dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_model_state(model: nn.Module, state: dict) -> None:
    """A whole model state dict (each rank passes the one it read) into a plain or sharded `model`."""
    if sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """A whole optimizer state dict of any kind of run into `optimizer` of `model` (plain or sharded). A state keyed
    by position (a DDP or one-process run's) loads as it is into a plain model's optimizer; otherwise it is keyed
    by name first, the positions being those of the optimizer's parameter groups (duolm.train.optim's order, the
    same under every kind of run)."""
    by_position = all(isinstance(k, int) for k in state["state"])
    if by_position and not sharded(model):
        return optimizer.load_state_dict(state)
    if by_position:
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        state = {"state": {order[i]: s for i, s in state["state"].items()},
                 "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
