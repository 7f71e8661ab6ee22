"""Data parallelism for the smoke run: DDP (sharding none), DDP + ZeRO-1, or FSDP2 (zero2/zero3).

FSDP2's `fully_shard` goes on every block and then on the root, with the MixedPrecisionPolicy
checks/memory.py assumes (gather in the compute dtype, reduce in fp32) and CPUOffloadPolicy for
offload. On CPU everything runs over gloo, which is how the suite tests it.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from podkit.checks.errors import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_world(device_type: str) -> World:
    """Join the process group torchrun set up (nccl on CUDA, gloo on CPU); a single process otherwise."""
    if not under_torchrun():
        return World()
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return World(dist.get_rank(), local_rank, dist.get_world_size())


def shutdown(sync: bool = False) -> None:
    """Leave the process group. sync: every rank ran every step (SmokeRun.in_lockstep), so wait for all of
    them before tearing down: a rank that destroys its group, or whose process and torchrun agent exit (node 0's
    agent hosts the rendezvous store), while a peer is still in its last collective or its own teardown aborts
    that peer (seen across two nodes: "terminate called without an active exception", exit -6). Not after an
    error or a signal, where a peer may never arrive or may wait in another collective (a barrier there hung
    a stopped two-rank smoke until its SIGKILL)."""
    if dist.is_available() and dist.is_initialized():
        if sync and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def fsdp_api():
    """fully_shard and its policies, or one clear line when this torch predates FSDP2."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise ConfigError("cluster.sharding", f"zero2/zero3 use FSDP2 (fully_shard), which torch "
                          f"{torch.__version__} lacks", "use torch >= 2.6, or sharding = 'none' / 'zero1'") from None
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def shard(model: torch.nn.Module, sharding: str, offload: str, mixed_dtype: torch.dtype | None) -> torch.nn.Module:
    """fully_shard every block, then the root (embeddings, final norm, head), on the meta model."""
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = fsdp_api()
    kwargs = {}
    if mixed_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_dtype, reduce_dtype=torch.float32)
    if offload != "none":
        # FSDP2 offloads parameters, gradients and the optimizer step together.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # zero2: keep each block gathered from its forward to its backward; zero3: reshard after forward.
    reshard = sharding == "zero3"
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Rank 0's replica, broadcast tensor by tensor in place. DDP's own init sync packs them into a
    # coalesced buffer that the communication thread frees a moment after the collective completes,
    # so an allocator reading right after wrapping sometimes still held it: the smoke then measured
    # DDP's buckets twice their size and the optimizer states at half (the split is what it reports).
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=0)
    # init_sync (torch >= 2.4) skips the coalesced broadcast; older torch repeats it, harmlessly.
    sync = {"init_sync": False} if "init_sync" in inspect.signature(DDP.__init__).parameters else {}
    # Gradients are views into DDP's buckets: one copy of the gradients, not two.
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True, **sync)


def grad_sync(model: torch.nn.Module, sync: bool):
    """Context for one micro-step's backward: skip DDP's all-reduce on all but the last.

    FSDP2 reduce-scatters every micro-step on purpose: skipping it would keep unsharded
    gradients alive between micro-steps, which is the memory sharding exists to save.
    """
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_mean(value: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def all_reduce_max(value: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
