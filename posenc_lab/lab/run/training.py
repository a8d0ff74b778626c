"""Training: AdamW, warm-up then cosine decay, gradient clipping, checkpoints that survive ``kill -9``.

* Precision: bf16 autocast on CUDA where supported, fp16 with a gradient scaler on other CUDA
  GPUs (Colab's T4), fp32 on the CPU.
* Every batch is a pure function of ``(seed, step)`` (:func:`~posenc_lab.lab.data.corpora.batch_at`), and a checkpoint holds
  the model, the optimizer, the scaler and the loss history: a run resumed from its last checkpoint
  ends exactly where an uninterrupted one does (on the CPU, same seed).
* Checkpoints are written to a temporary file and renamed, so a kill leaves the previous one whole.
* A NaN or infinite loss stops the run with :class:`TrainingDiverged` before anything is saved:
  the last good checkpoint stays.
* On CUDA the losses stay on the device and are read every :func:`default_sync_every` steps (and before
  every checkpoint): a read makes the host wait for the GPU, so reading every step would leave the GPU
  idle between steps. AdamW runs fused where the parameters are on CUDA.
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.run.training")

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from posenc_lab.errors import PosencError, TrainingDiverged, check_positive
from posenc_lab.lab.data.corpora import batch_at
from posenc_lab.lab.run import distributed


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "lr", "checkpoint_every"):
            check_positive(name, getattr(self, name))

    def to_dict(self) -> dict:
        """The configuration as a plain dict."""
        return asdict(self)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


def default_compile(device: torch.device) -> bool:
    """Whether to ``torch.compile`` the training step by default: on CUDA, not on the CPU."""
    return device.type == "cuda"


def default_sync_every(device: torch.device) -> int:
    """Steps between reads of the training loss: every step on the CPU (a read costs nothing there), every 25
    on CUDA (each read waits for the GPU's queue to empty)."""
    return 25 if device.type == "cuda" else 1


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 on CUDA where supported, fp16 on other CUDA GPUs, None (fp32) on the CPU."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def autocast(device: torch.device):
    """The autocast context of :func:`autocast_dtype` on ``device``, or one that does nothing (fp32)."""
    dtype = autocast_dtype(device)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


_FLUSH = {"depth": 0}


@contextlib.contextmanager
def flush_denormals():
    """Flush subnormal floats to zero on the CPU while the block runs (restored afterwards).

    A softmax over a bias that grows with distance (ALiBi's steepest heads) produces many
    subnormal intermediates, which x86 processors handle tens of times slower than normal floats;
    flushing them changes no result beyond float32's resolution (they are below ``1.2e-38``).
    Measured in ``benchmarks/long_eval.py``.
    """
    _FLUSH["depth"] += 1
    if _FLUSH["depth"] == 1:
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        _FLUSH["depth"] -= 1
        if _FLUSH["depth"] == 0:  # only the outermost block switches it back (blocks nest: a probe inside training)
            torch.set_flush_denormal(False)


def decay_groups(model: torch.nn.Module) -> tuple[list, list]:
    """The parameters AdamW decays, and those it does not.

    Decayed: the matrices of the Transformer (embeddings, projections, MLP), as in GPT-2. Not decayed:
    biases, LayerNorm gains and every parameter of the position encoding (``model.encoding``: the T5
    bucket table, the learned absolute table, KERPLE's and FIRE's parameters), whatever its shape. The
    papers trained them without weight decay (T5: Raffel et al. 2020 use AdaFactor with no decay;
    KERPLE and FIRE train their few position parameters as plain parameters), and decay would pull a
    learned bias table towards zero, i.e. towards NoPE, by a different amount for each encoding.
    """
    encoding = getattr(model, "encoding", None)
    exempt = {id(p) for p in encoding.parameters()} if isinstance(encoding, torch.nn.Module) else set()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in exempt]
    rest = [p for p in params if not (p.dim() >= 2 and id(p) not in exempt)]
    return decay, rest


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the Transformer's matrices only (see :func:`decay_groups`); fused (one kernel for
    every parameter) when the parameters are on CUDA."""
    decay, rest = decay_groups(model)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + rest)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def replace_atomically(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file in ``path``'s folder, then rename it over ``path``:
    a reader (or a run killed half-way) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` of ``obj`` to ``path``, atomically."""
    replace_atomically(path, lambda tmp: torch.save(obj, tmp))


@contextlib.contextmanager
def clear_oom(what: str):
    """Turn CUDA's out-of-memory error into one sentence that says what ran out and what to change."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise PosencError(f"out of GPU memory {what}: lower the batch size (--batch-size) or the length") from None


class _Loss(torch.nn.Module):
    """The model's training loss as a module's forward, for ``DistributedDataParallel`` to wrap."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model.loss(x, y)


def train(model, stream: torch.Tensor | None, cfg: TrainConfig, *, length: int | None = None,
          checkpoint: Path | None = None, device: torch.device | str = "cpu", progress: bool = True,
          desc: str = "train", compile: bool = False,
          batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
          on_step: Callable[[int], None] | None = None, extra_state: list | None = None,
          sync_every: int | None = None) -> dict:
    """Train ``model`` on windows of ``length`` (default: its training length) drawn from ``stream``.

    With ``checkpoint`` set, resumes from it when it exists and saves to it every
    ``checkpoint_every`` steps and at the end. ``compile`` runs the forward and backward through
    ``torch.compile``. ``batches(step) -> (inputs, targets)`` replaces the windows of ``stream`` (a
    synthetic task; targets ``IGNORE`` carry no loss); it must be a pure function of ``step``, as
    :func:`~posenc_lab.lab.data.corpora.batch_at` is, for a resumed run to equal an uninterrupted one. ``on_step(step)`` is
    called before the first step of a fresh run and after every step (a probe of the model);
    ``extra_state``, a list it may fill, is saved in the checkpoint and restored on resume. The losses are read
    from the device every ``sync_every`` steps (default :func:`default_sync_every`; every step when ``on_step`` is
    given), before every checkpoint and at the end; a non-finite loss stops the run at that read, before the next
    checkpoint is written.
    Returns the loss history and throughput; ``resumed_seconds`` is the training time that a checkpoint it
    resumed from carried (0 for a fresh run), so that a unit's wall time can count what earlier processes spent.
    """
    device = torch.device(device)
    length = length or model.cfg.train_len
    model.to(device)
    opt = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype(device) == torch.float16)
    state = _resume(checkpoint, model, opt, scaler, device, extra_state)
    distributed.agree(state["step"], f"the step to resume {desc} from")
    resumed_seconds = state["seconds"]  # the training time of earlier processes, carried by the checkpoint

    def save():
        if checkpoint is not None and distributed.is_main():
            save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                         "state": state, "train_config": cfg.to_dict(), "model_config": model.cfg.to_dict(),
                         "extra": list(extra_state or [])}, checkpoint)

    model.train()
    distributed.check_divisible(cfg.batch_size)
    loss_fn = _loss_fn(model, device, compile)
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps, desc=desc,
               disable=not progress or not distributed.is_main(), dynamic_ncols=True, mininterval=1.0)
    tokens_per_step = cfg.batch_size * length
    if batches is None:
        batches = _windows(stream, cfg, length)
    if on_step is not None and state["step"] == 0:
        on_step(0)
    every = 1 if on_step is not None else (sync_every or default_sync_every(device))
    pending: list[torch.Tensor] = []  # this window's losses, still on the device

    def read(step: int) -> None:
        """Read the window's losses (one wait for the device), stop if one is not finite, and count its time."""
        values = torch.stack(pending).float().tolist()
        first = step + 1 - len(values)
        for i, value in enumerate(values):
            if not math.isfinite(value):
                where = (f"; the last good checkpoint {checkpoint} is kept"
                         if checkpoint is not None and checkpoint.exists() else "")
                raise TrainingDiverged(f"training loss became {value} at step {first + i} ({desc}){where}. "
                                       "Try a lower learning rate (--lr) or more warm-up.")
        dt = time.perf_counter() - clock[0]
        state["step"], state["seconds"] = step + 1, state["seconds"] + dt
        state["losses"].extend(values)
        pending.clear()
        bar.set_postfix(loss=f"{values[-1]:.3f}", tok_s=f"{tokens_per_step * len(values) / dt:,.0f}", refresh=False)

    clock = [time.perf_counter()]  # when the current window of steps began (probes and saves are not counted)
    with flush_denormals():
        for step in bar:
            pending.append(_step(model, opt, scaler, loss_fn, batches, step, cfg, device, length))
            ends = (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps
            if len(pending) >= every or ends:
                read(step)
                if on_step is not None:
                    on_step(step + 1)
                if ends:
                    save()
                clock[0] = time.perf_counter()
    bar.close()
    model.eval()
    return _summary(state, cfg, tokens_per_step, resumed_seconds)


def _loss_fn(model, device: torch.device, compile: bool):
    """The training loss ``loss_fn(x, y)``: under torchrun through DistributedDataParallel, which averages the
    gradients over processes; with ``compile``, through ``torch.compile``."""
    loss_fn = distributed.wrap(_Loss(model), device) if distributed.active() else model.loss
    return torch.compile(loss_fn) if compile else loss_fn


def _resume(checkpoint: Path | None, model, opt, scaler, device: torch.device, extra_state: list | None) -> dict:
    """The training state (step, losses, seconds) of ``checkpoint``, with the model, optimizer, scaler and
    ``extra_state`` restored from it; a fresh state when there is none."""
    if checkpoint is None or not checkpoint.exists():
        return {"step": 0, "losses": [], "seconds": 0.0}
    saved = torch.load(checkpoint, map_location=device, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    if extra_state is not None:
        extra_state[:] = saved.get("extra", [])
    return saved["state"]


def _windows(stream: torch.Tensor | None, cfg: TrainConfig, length: int) -> Callable[[int], tuple]:
    """``batches(step)``: the windows of ``stream`` that step ``step`` trains on (:func:`~posenc_lab.lab.data.corpora.batch_at`)."""
    if stream is None:
        raise PosencError("train() needs a token stream or a batches(step) function")

    def batches(step):
        return batch_at(stream, step, batch_size=cfg.batch_size, length=length, seed=cfg.seed)

    return batches


def _step(model, opt, scaler, loss_fn, batches, step: int, cfg: TrainConfig, device: torch.device,
          length: int) -> torch.Tensor:
    """One optimizer step at the learning rate of ``step``; returns its loss (the mean over processes) as a tensor
    on the device, unread (the caller reads a window of them at once)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    x, y = (_to_device(t, device) for t in distributed.shard_rows(*batches(step)))
    with clear_oom(f"training at batch size {cfg.batch_size} and length {length}"):
        with autocast(device):
            loss = loss_fn(x, y)
        value = distributed.mean_over_processes(loss.detach())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return value


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to CUDA through pinned memory without waiting (a copy from pageable memory may make the
    host wait for the GPU)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _summary(state: dict, cfg: TrainConfig, tokens_per_step: int, resumed_seconds: float) -> dict:
    """What :func:`train` returns: the final loss (mean of the last 5% of steps), the history and throughput."""
    tail = state["losses"][-max(1, len(state["losses"]) // 20):]
    return {
        "train_loss": sum(tail) / len(tail),
        "losses": state["losses"],
        "train_steps": cfg.steps,
        "train_tokens": cfg.steps * tokens_per_step,
        "train_seconds": state["seconds"],
        "train_tokens_per_s": cfg.steps * tokens_per_step / max(state["seconds"], 1e-9),
        "resumed_seconds": resumed_seconds,
    }
