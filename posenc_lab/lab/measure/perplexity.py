"""Evaluation at any length: non-overlapping and sliding windows, per document and per position.

The scored text is the ``tokens`` bytes that follow ``lead_in`` bytes of lead-in: targets
``lead_in + 1 .. lead_in + tokens`` of the evaluation stream. Every length and encoding scores the
same targets, once each:

* ``nonoverlapping``: windows ``[c, c + L), [c + L, c + 2L), ...`` (``c = lead_in``); target ``t`` of a
  window sees ``t`` bytes of context, so the average mixes short and long contexts.
* ``sliding`` (stride ``S``), as Press et al. (2022) define it: each window of ``L`` bytes scores only
  its last ``S`` targets, so **every scored byte sees at least** ``L - S`` **bytes of context** and at
  most ``L - 1``. The window of the first ``S`` targets reaches ``L - S`` bytes back into the lead-in;
  with less lead-in than that (``lead_in < L - S``), the first targets, which would have less
  context, are not scored and the result says how many were left out (``unscored``). Press et al.
  use ``S = 1`` at great cost; ``S < L`` trades compute for context.

With a document index per byte (``documents``), the loss is also summed per document, so that the
spread over documents (a bootstrap in :mod:`~posenc_lab.lab.verdicts.tables`) can stand beside the spread over seeds.
``reach=W`` scores the same targets with every layer's attention limited to the last ``W`` keys (a
sliding-window mask, :func:`~posenc_lab.backends.attention`); ``per_target=True`` also returns each target's loss,
so that two evaluations of the same targets can be compared byte by byte (:mod:`posenc_lab.lab.experiments.context`).
"""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.perplexity")

import contextlib
import math
import time

import torch
from tqdm import tqdm

from posenc_lab.errors import PosencError, PositionOutOfRange, check_positive
from posenc_lab.lab.run import distributed
from posenc_lab.lab.run.training import autocast, clear_oom, flush_denormals

#: the evaluation modes (see above)
MODES = ("nonoverlapping", "sliding")


def window_plan(tokens: int, length: int, mode: str, stride: int | None = None, lead_in: int = 0) -> list[tuple[int, int]]:
    """``(start, first scored position)`` of each window of ``length`` covering the scored targets.

    The scored targets are ``lead_in + 1 .. lead_in + tokens``; see the module docstring for the two
    modes. In ``sliding`` mode with ``lead_in < length - stride``, the windows that would start before
    the stream are left out, and so are their targets (:func:`unscored` counts them).
    """
    check_positive("evaluation length", length)
    check_positive("evaluation tokens", tokens)
    if lead_in < 0:
        raise PosencError(f"the lead-in must be >= 0, got {lead_in}")
    if mode not in MODES:
        raise PosencError(f"unknown evaluation mode {mode!r}; valid modes: {', '.join(MODES)}")
    if tokens % length:
        raise PosencError(f"evaluation tokens ({tokens}) must be a multiple of every evaluation length ({length})")
    if mode == "nonoverlapping":
        return [(start, 0) for start in range(lead_in, lead_in + tokens, length)]
    if stride is None:
        raise PosencError("sliding-window evaluation needs a stride")
    check_positive("stride", stride)
    if stride > length or tokens % stride:
        raise PosencError(f"stride {stride} must be at most the length {length} and divide the evaluation tokens {tokens}")
    # window k scores targets end - S + 1 .. end with end = lead_in + k S; a window that would start before
    # the stream (too little lead-in) is left out, and so are its targets
    return [(end - length, length - stride) for end in range(lead_in + stride, lead_in + tokens + 1, stride)
            if end - length >= 0]


def unscored(tokens: int, length: int, mode: str, stride: int | None = None, lead_in: int = 0) -> int:
    """How many of the ``tokens`` targets a plan leaves out (sliding windows without enough lead-in)."""
    return tokens - sum(length - first for _, first in window_plan(tokens, length, mode, stride, lead_in))


def _cannot_extrapolate(reason: str, t0: float) -> dict:
    return {"status": "cannot extrapolate", "reason": reason, "loss": math.nan, "perplexity": math.nan,
            "bits_per_byte": math.nan, "tokens": 0, "unscored": 0, "seconds": time.perf_counter() - t0,
            "per_position": None, "per_document": None}


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, *, length: int, tokens: int, mode: str = "nonoverlapping",
             stride: int | None = None, lead_in: int = 0, documents: torch.Tensor | None = None, batch_size: int = 8,
             device: torch.device | str = "cpu", progress: bool = False, desc: str = "eval", reach: int | None = None,
             per_target: bool = False, full_precision: bool = False) -> dict:
    """Mean loss (nats), perplexity and bits per byte over targets ``lead_in + 1 .. lead_in + tokens`` of ``stream``.

    ``documents`` (optional, one integer per byte of ``stream``) names the document each byte belongs
    to; the result then holds ``per_document``: ``{document: [summed loss, scored targets]}``. Also
    returns ``per_position``: the mean loss at each position of the window, over the windows that
    score every position (non-overlapping windows; none for sliding ones, which score only their
    last ``stride`` positions), and ``unscored``: targets left out for lack of lead-in (sliding).
    A learned table asked past its end gives ``status="cannot extrapolate"`` instead of raising.
    ``reach``: attention limited to the last ``reach`` keys in every layer. ``per_target``: the result
    also holds ``per_target``, the loss of every target ``lead_in + 1 + i`` (float64, ``tokens`` of
    them; NaN where a target is not scored). ``full_precision``: float32 throughout, without the autocast
    that training uses on CUDA (the reference for a check of the bf16 evaluation; the same on the CPU).
    """
    device = torch.device(device)
    if len(stream) < lead_in + tokens + 1:
        raise PosencError(f"the evaluation text has {len(stream)} bytes; {lead_in + tokens + 1} are needed "
                          f"({lead_in} of lead-in, {tokens} scored, one more for the last target)")
    if documents is not None and len(documents) != len(stream):
        raise PosencError(f"documents has {len(documents)} entries for a stream of {len(stream)} bytes")
    plan = window_plan(tokens, length, mode, stride, lead_in)
    expected = tokens - unscored(tokens, length, mode, stride, lead_in)
    if not plan:
        raise PosencError(f"sliding windows of {length} with stride {stride} need at least {length - stride} bytes "
                          f"of lead-in before the scored text (lead_in={lead_in}); none can be scored")
    model.eval().to(device)
    t0 = time.perf_counter()
    limit = getattr(model.encoding, "max_positions", None)
    if limit is not None and length > limit:
        return _cannot_extrapolate(f"a learned position table of {limit} positions cannot score windows of {length}", t0)
    n_docs = int(documents.max()) + 1 if documents is not None and len(documents) else 0
    try:
        scored = _score_windows(model, stream, plan, length=length, lead_in=lead_in, documents=documents,
                                n_docs=n_docs, batch_size=batch_size, device=device, progress=progress, desc=desc,
                                reach=reach, per_target=per_target, full_precision=full_precision)
    except PositionOutOfRange as err:
        return _cannot_extrapolate(str(err), t0)
    return _summarise(scored, length=length, tokens=tokens, expected=expected, n_docs=n_docs,
                      by_document=documents is not None, per_target=per_target, t0=t0)


def _score_windows(model, stream, plan, *, length, lead_in, documents, n_docs, batch_size, device, progress, desc,
                   reach, per_target, full_precision=False) -> list:
    """The losses of every window of ``plan``, as ``(window index, (summed loss of its scored targets, their
    number, per-position losses, per-document sums, offset of its first scored target, per-target losses))``."""
    batches = [plan[i : i + batch_size] for i in range(0, len(plan), batch_size)]
    scored = []
    masks: dict = {}  # every window of this model at this length: the masks of its bias, built once
    with flush_denormals():
        # under torchrun each process scores every world-th batch; the same batches as on one process,
        # so every window's losses are bit for bit the single-process ones
        for b, batch in tqdm(distributed.my_share(batches), desc=desc, leave=False,
                             disable=not progress or not distributed.is_main()):
            windows = torch.stack([stream[s : s + length + 1] for s, _ in batch]).long().to(device)
            precision = contextlib.nullcontext() if full_precision else autocast(device)
            with clear_oom(f"evaluating at length {length} with batch size {batch_size}"), precision:
                losses = model.token_losses(windows[:, :-1], windows[:, 1:], reach=reach,
                                            masks=masks).double().cpu()  # b n
            for w, (row, (start, first)) in enumerate(zip(losses, batch)):
                per_position = row if first == 0 else None
                per_doc = None
                if documents is not None:  # the document of each scored target (stream index start + i + 1)
                    owners = documents[start + first + 1 : start + length + 1].long()
                    per_doc = (torch.bincount(owners, weights=row[first:], minlength=n_docs),
                               torch.bincount(owners, minlength=n_docs))
                targets = row[first:].clone() if per_target else None
                scored.append((b * batch_size + w, (row[first:].sum().item(), length - first, per_position, per_doc,
                                                    start + first - lead_in, targets)))
    return scored


def _summarise(scored: list, *, length: int, tokens: int, expected: int, n_docs: int, by_document: bool,
               per_target: bool, t0: float) -> dict:
    """The result of :func:`evaluate` from the windows' losses, gathered from every process in window order."""
    total, count = 0.0, 0
    position_sum = torch.zeros(length, dtype=torch.float64)
    position_windows = 0
    doc_sum = torch.zeros(n_docs, dtype=torch.float64)
    doc_count = torch.zeros(n_docs, dtype=torch.int64)
    each_target = torch.full((tokens,), math.nan, dtype=torch.float64) if per_target else None
    for summed, n, row, per_doc, offset, targets in distributed.gather_in_order(scored):  # the single-process order
        if targets is not None:
            each_target[offset : offset + n] = targets
        total += summed
        count += n
        if row is not None:
            position_sum += row
            position_windows += 1
        if per_doc is not None:
            doc_sum += per_doc[0]
            doc_count += per_doc[1]
    if count != expected:  # the plan's arithmetic, checked rather than trusted
        raise AssertionError(f"scored {count} tokens, expected {expected}")
    loss = total / count
    return {
        "status": "ok",
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": count,
        "unscored": tokens - count,
        "seconds": time.perf_counter() - t0,
        "per_position": (position_sum / position_windows).tolist() if position_windows else None,
        "per_document": ({d: [doc_sum[d].item(), int(doc_count[d])] for d in range(n_docs) if doc_count[d]}
                         if by_document else None),
        **({"per_target": each_target} if per_target else {}),
    }
