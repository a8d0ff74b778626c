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
    total, count = 0.0, 0
    position_sum = torch.zeros(length, dtype=torch.float64)
    position_windows = 0
    t0 = time.perf_counter()
    batches = [plan[i : i + batch_size] for i in range(0, len(plan), batch_size)]
    try:
        with flush_denormals():
            for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
                windows = torch.stack([stream[s : s + length + 1] for s, _ in batch]).long().to(device)
                with clear_oom(f"evaluating at length {length} with batch size {batch_size}"), autocast(device):
                    losses = model.token_losses(windows[:, :-1], windows[:, 1:]).double().cpu()  # b n
                for row, (_, first) in zip(losses, batch):
                    total += row[first:].sum().item()
                    count += length - first
                    if first == 0:
                        position_sum += row
                        position_windows += 1
    except PositionOutOfRange as err:
        return {"status": "cannot extrapolate", "reason": str(err), "loss": math.nan, "perplexity": math.nan,
                "bits_per_byte": math.nan, "tokens": 0, "seconds": time.perf_counter() - t0, "per_position": None}
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
