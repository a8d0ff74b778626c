"""Evaluation at any length: non-overlapping and sliding windows, and the loss at each position.

Both modes score exactly the same target tokens, the bytes ``1 .. tokens`` of the evaluation
stream, once each, so every length, mode and encoding is measured on the same text:

* ``nonoverlapping``: windows ``[0, L), [L, 2L), ...``; token ``t`` of a window sees ``t`` tokens
  of context, so the average mixes short and long contexts.
* ``sliding`` (stride ``S``): the first window scores all its ``L`` targets; each next window moves
  ``S`` tokens and scores only its last ``S``, so every later token sees at least ``L - S``
  tokens of context (Press et al. 2022 evaluate with ``S = 1`` at great cost; ``S < L`` trades
  compute for context).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from .errors import PosencError, PositionOutOfRange, check_positive
from . import distributed
from .train import autocast, clear_oom, flush_denormals

MODES = ("nonoverlapping", "sliding")


def window_plan(tokens: int, length: int, mode: str, stride: int | None = None) -> list[tuple[int, int]]:
    """``(start, first scored position)`` of each window of ``length`` covering targets ``1 .. tokens``."""
    check_positive("evaluation length", length)
    check_positive("evaluation tokens", tokens)
    if mode not in MODES:
        raise PosencError(f"unknown evaluation mode {mode!r}; valid modes: {', '.join(MODES)}")
    if tokens % length:
        raise PosencError(f"evaluation tokens ({tokens}) must be a multiple of every evaluation length ({length})")
    if mode == "nonoverlapping":
        return [(start, 0) for start in range(0, tokens, length)]
    if stride is None:
        raise PosencError("sliding-window evaluation needs a stride")
    check_positive("stride", stride)
    if stride > length or (tokens - length) % stride:
        raise PosencError(f"stride {stride} must be at most the length {length} and divide tokens - length = {tokens - length}")
    return [(0, 0)] + [(end - length, length - stride) for end in range(length + stride, tokens + 1, stride)]


def _cannot_extrapolate(reason: str, t0: float) -> dict:
    return {"status": "cannot extrapolate", "reason": reason, "loss": math.nan, "perplexity": math.nan,
            "bits_per_byte": math.nan, "tokens": 0, "seconds": time.perf_counter() - t0, "per_position": None}


@torch.no_grad()
def evaluate(
    model,
    stream: torch.Tensor,
    *,
    length: int,
    tokens: int,
    mode: str = "nonoverlapping",
    stride: int | None = None,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    progress: bool = False,
    desc: str = "eval",
) -> dict:
    """Mean loss (nats), perplexity and bits per byte over targets ``1 .. tokens`` of ``stream``.

    Also returns ``per_position``: the mean loss at each position of the window, over the windows
    that score every position (all of them for non-overlapping windows; the first for sliding).
    A learned table asked past its end gives ``status="cannot extrapolate"`` instead of raising.
    """
    device = torch.device(device)
    if len(stream) < tokens + 1:
        raise PosencError(f"the evaluation text has {len(stream)} bytes; {tokens + 1} are needed")
    plan = window_plan(tokens, length, mode, stride)
    model.eval().to(device)
    t0 = time.perf_counter()
    limit = getattr(model.encoding, "max_positions", None)
    if limit is not None and length > limit:
        return _cannot_extrapolate(f"a learned position table of {limit} positions cannot score windows of {length}", t0)
    batches = [plan[i : i + batch_size] for i in range(0, len(plan), batch_size)]
    scored = []  # (window index, summed loss of its scored targets, its per-position losses or None)
    try:
        with flush_denormals():
            # under torchrun each process scores every world-th batch; the same batches as on one process,
            # so every window's losses are bit for bit the single-process ones
            for b, batch in tqdm(distributed.my_share(batches), desc=desc, leave=False,
                                 disable=not progress or not distributed.is_main()):
                windows = torch.stack([stream[s : s + length + 1] for s, _ in batch]).long().to(device)
                with clear_oom(f"evaluating at length {length} with batch size {batch_size}"), autocast(device):
                    losses = model.token_losses(windows[:, :-1], windows[:, 1:]).double().cpu()  # b n
                for w, (row, (_, first)) in enumerate(zip(losses, batch)):
                    per_position = row if first == 0 else None
                    scored.append((b * batch_size + w, (row[first:].sum().item(), length - first, per_position)))
    except PositionOutOfRange as err:
        return _cannot_extrapolate(str(err), t0)
    total, count = 0.0, 0
    position_sum = torch.zeros(length, dtype=torch.float64)
    position_windows = 0
    for summed, n, row in distributed.gather_in_order(scored):  # summed in the single-process order
        total += summed
        count += n
        if row is not None:
            position_sum += row
            position_windows += 1
    if count != tokens:  # the plan's arithmetic, checked rather than trusted
        raise AssertionError(f"scored {count} tokens, expected {tokens}")
    loss = total / count
    return {
        "status": "ok",
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": count,
        "seconds": time.perf_counter() - t0,
        "per_position": (position_sum / position_windows).tolist(),
    }
