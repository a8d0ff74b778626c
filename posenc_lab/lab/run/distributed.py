"""Everything about several processes, in one place: data-parallel training and sharded evaluation under ``torchrun``::

    torchrun --nproc_per_node 8 -m posenc_lab run --preset paper                    # one node, 8 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id posenc -m posenc_lab run --preset paper  # two nodes

``torchrun`` starts the processes and sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
:func:`init` joins them into a ``torch.distributed`` process group (NCCL on CUDA, Gloo on the CPU,
overridable) with a timeout, so that a process that dies makes the others stop with an error
instead of waiting for ever. Then:

* training: every process computes the same deterministic global batch of a step and keeps its
  own contiguous slice of rows (:func:`shard_rows`); ``DistributedDataParallel`` averages the
  gradients, so with equal slices the update is the single-process one: same global batch, same
  optimiser steps, same learning-rate schedule, whatever the number of processes;
* evaluation: the batches of windows are dealt out round-robin (:func:`my_share`), each process
  scores its own, and :func:`gather_in_order` puts the per-window results back in the
  single-process order, so sums come out bit for bit the same;
* only the main process (rank 0) writes checkpoints, unit files and tables (:func:`is_main`), and
  every process waits at a :func:`barrier` before reading what it wrote. Every process reads them
  back (to resume), so the output folder must be on a filesystem all nodes share; :func:`agree`
  stops the run with a clear error when processes see different files.

Without ``torchrun`` (no ``WORLD_SIZE`` above 1 in the environment) none of this runs: every
function here is a no-op on one process and ``torch.distributed`` is never initialised.
"""

from __future__ import annotations

import datetime
import os

import torch

from posenc_lab.errors import PosencError

_STATE = {"active": False, "rank": 0, "world": 1, "local_rank": 0}


def launched_by_torchrun() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` above 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, Gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init(device: torch.device | None = None, *, backend: str | None = None, timeout_s: float = 300.0) -> torch.device:
    """Join the process group ``torchrun`` set up (environment ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``...).

    Returns the device this process uses: ``cuda:LOCAL_RANK`` on GPUs, the CPU otherwise. A collective
    that waits longer than ``timeout_s`` (a peer died or hangs) raises instead of blocking for ever.
    """
    import torch.distributed as dist

    if not launched_by_torchrun():
        return device or torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or default_backend(device)
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        raise PosencError(f"unknown process-group backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _STATE.update(active=True, rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank)
    return device


def shutdown() -> None:
    """Leave the process group if one was joined; nothing otherwise."""
    if _STATE["active"]:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _STATE.update(active=False, rank=0, world=1, local_rank=0)


def active() -> bool:
    """Whether this process is part of a process group (after :func:`init`)."""
    return _STATE["active"]


def rank() -> int:
    """This process's rank; 0 when running alone."""
    return _STATE["rank"]


def world_size() -> int:
    """The number of processes; 1 when running alone."""
    return _STATE["world"]


def is_main() -> bool:
    """Whether this process writes files and prints (rank 0, or the only process)."""
    return _STATE["rank"] == 0


def barrier() -> None:
    """Wait until every process gets here; nothing when running alone."""
    if _STATE["active"]:
        import torch.distributed as dist

        dist.barrier()


def check_divisible(batch_size: int) -> None:
    """The global batch must split into equal slices, or the update would depend on the number of processes."""
    world = world_size()
    if batch_size % world:
        raise PosencError(f"the global batch size {batch_size} is not divisible by the number of processes {world}: "
                          f"choose a batch size that is a multiple of {world} (--batch-size) or another --nproc_per_node")


def shard_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This process's contiguous slice of the rows of each (global) batch tensor."""
    world, r = world_size(), rank()
    if world == 1:
        return tensors
    size = tensors[0].shape[0] // world
    return tuple(t[r * size : (r + 1) * size] for t in tensors)


def mean_over_processes(value: torch.Tensor) -> torch.Tensor:
    """The mean of a (scalar) tensor over the processes; the tensor itself on one process."""
    if not _STATE["active"]:
        return value
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total)
    return total / world_size()


def my_share(items: list) -> list[tuple[int, object]]:
    """``(index, item)`` for the items this process handles: every ``world``-th, starting at its rank."""
    return [(i, item) for i, item in enumerate(items) if i % world_size() == rank()]


def gather_in_order(results: list[tuple[int, object]]) -> list:
    """Every process's ``(index, result)`` pairs, merged and sorted by index (the single-process order)."""
    if not _STATE["active"]:
        return [r for _, r in sorted(results, key=lambda pair: pair[0])]
    import torch.distributed as dist

    everything = [None] * world_size()
    dist.all_gather_object(everything, results)
    merged = [pair for part in everything for pair in part]
    return [r for _, r in sorted(merged, key=lambda pair: pair[0])]


def agree(value, what: str):
    """``value``, checked to be the same on every process (e.g. whether a unit file or a checkpoint exists):
    processes that see different files would pair different steps in their collectives. One process: as is."""
    if not _STATE["active"]:
        return value
    import torch.distributed as dist

    everything = [None] * world_size()
    dist.all_gather_object(everything, value)
    if any(v != everything[0] for v in everything):
        raise PosencError(f"the processes disagree about {what} ({everything}): every process must see the same "
                          "--out folder (a filesystem shared by all nodes)")
    return value


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` when several processes run, the model itself otherwise."""
    if not _STATE["active"]:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
