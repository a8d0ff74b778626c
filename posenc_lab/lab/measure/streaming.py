"""Attention sinks (StreamingLLM, Xiao et al. 2024): a stream of any length read through a rolling key/value cache
that keeps the first tokens and the last ``window``, scored token by token (chapter 12, and the context runs'
streams)."""

from __future__ import annotations

from posenc_lab.lab.extras import require

require("lab", "posenc_lab.lab.measure.streaming")

import torch
from tqdm import tqdm

from posenc_lab.lab.run.training import autocast, flush_denormals


@torch.no_grad()
def streaming_losses(model, tokens: torch.Tensor, *, window: int, sinks: int = 0, device="cpu",
                     progress: bool = False, desc: str = "stream") -> torch.Tensor:
    """The loss (nats, float64) of every next token of ``tokens`` (``n`` byte ids) read as one stream through a
    rolling :class:`~posenc_lab.backends.SinkCache` of the first ``sinks`` tokens and the last ``window``
    (StreamingLLM, Xiao et al. 2024): ``n - 1`` losses. The first ``sinks + window`` tokens go in one
    forward pass, the rest one at a time. Positions are the cache's slots, so a relative encoding
    (RoPE, ALiBi, T5, ...) never meets a distance beyond ``sinks + window``; an absolute one keeps the
    slot each token had when it entered."""
    device = torch.device(device)
    model.eval().to(device)
    tokens = tokens.long().to(device)
    caches = model.new_cache(window=window, sinks=sinks)
    first = min(sinks + window, len(tokens) - 1)
    out = []
    with flush_denormals(), autocast(device):
        logits = model(tokens[None, :first], cache=caches)[0].float()
        out.append(torch.nn.functional.cross_entropy(logits, tokens[1 : first + 1], reduction="none"))
        for t in tqdm(range(first, len(tokens) - 1), desc=desc, disable=not progress, leave=False):
            logits = model(tokens[None, t : t + 1], cache=caches)[0].float()
            out.append(torch.nn.functional.cross_entropy(logits, tokens[t + 1 : t + 2], reduction="none"))
    return torch.cat(out).double().cpu()
