"""Training on several processes (torchrun): DDP replicas or FSDP2 shards, and their state as one file.

    fwd = wrap(model, "fsdp", world, device)   # FSDP2 over each transformer block, then the root: parameters,
                                               # gradients and optimizer state sharded over the processes
    with no_sync(fwd, sync=False): ...         # a micro-batch whose gradients are not reduced yet
    model_state(model), optimizer_state(model, optimizer)   # every rank calls them; rank 0 holds the whole state

A sharded run's checkpoint is the same single-file model directory as a DDP run's (the full state gathered on
rank 0), its optimizer state keyed by parameter name, so it resumes at any number of processes and under either
kind; a DDP or one-process checkpoint (optimizer state keyed by position) resumes under FSDP too.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

PARALLEL = ("ddp", "fsdp")


def wrap(model: nn.Module, parallel: str, world: int, device: torch.device) -> nn.Module:
    """The module the training steps run: `model` itself in one process; DDP replicas; or `model` sharded in
    place by FSDP2, each transformer block a unit and the root (embeddings, final norm, heads) the last. FSDP's
    gradient reduction averages over the processes, as DDP's does."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL}")
    if world == 1:
        return model
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.backbone.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def no_sync(fwd: nn.Module, sync: bool):
    """The backward passes inside reduce their gradients over the processes only when `sync` (the last
    micro-batch of a step); in one process there is nothing to reduce."""
    if sync or not isinstance(fwd, (nn.parallel.DistributedDataParallel, FSDPModule)):
        yield
    elif isinstance(fwd, FSDPModule):
        fwd.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fwd.set_requires_gradient_sync(True)
    else:
        with fwd.no_sync():
            yield


def sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def _gathered() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())


def model_state(model: nn.Module) -> dict | None:
    """A sharded model's state dict gathered whole on rank 0 (the other ranks get an empty dict; every rank must
    call it); None for a plain model, whose own state_dict() is whole."""
    return get_model_state_dict(model, options=_gathered()) if sharded(model) else None


def optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimizer's state dict: a sharded model's gathered whole on rank 0 and keyed by parameter name (every
    rank must call it), a plain model's as the optimizer gives it (keyed by position)."""
    return get_optimizer_state_dict(model, optimizer, options=_gathered()) if sharded(model) else optimizer.state_dict()


def load_model_state(model: nn.Module, state: dict) -> None:
    """A whole model state dict (each rank passes the one it read) into a plain or sharded `model`."""
    if sharded(model):
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
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
