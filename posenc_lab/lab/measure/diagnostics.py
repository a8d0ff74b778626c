"""Why extrapolation breaks, read off a trained model: attention maps, attention entropy, logits by distance,
FoX's forget gates.

Pure functions over a model and a batch of tokens (the chapters draw them with :mod:`plots`). The
attention weights are recomputed explicitly from each layer's input, with the encoding's own
rotation and bias (and the terms of an encoding that reads the tokens: FoX's decay, CoPE's bias, PaTH's transforms in
place of ``q . k``), the causal mask and a local layer's window or chunk, ``softmax(q k^T / sqrt(d) + b)`` (or the
encoding's own weights: stick-breaking's): the formula every backend is tested against, written out because the fast
backends never form the weights.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange

from posenc_lab.backends import future_mask, other_chunk, out_of_reach
from posenc_lab.backends.tokens import logits, token_mask
from posenc_lab.encodings.forgetting import forget_sums


def _layer_inputs(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """The input of every layer's attention (after its LayerNorm), from one forward pass."""
    captured = []
    hooks = [block.attn.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
             for block in model.blocks]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def log_forget_values(model, idx: torch.Tensor) -> list[torch.Tensor | None]:
    """Each layer's log forget values ``log f`` (``b h n``, FoX's gates,
    :class:`~posenc_lab.encodings.forgetting.FoXLayer`) as the model computes them from the layer's input;
    ``None`` for a layer whose encoding has no gates. :func:`~posenc_lab.encodings.forgetting.forget_sums` turns them
    into the bias ``D_ij``."""
    n_layer = len(model.blocks)
    with torch.no_grad():
        return [model.encoding.for_layer(layer, n_layer).decay(x) for layer, x in enumerate(_layer_inputs(model, idx))]


def attention_logits(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """``q_m . k_n / sqrt(d) + b[h, m, n]`` of every layer (``b h n n``, float32), future keys (and those outside a
    local layer's window or chunk) at ``-inf``, as the model computes them in evaluation mode (the mode is restored
    afterwards)."""
    was_training = model.training
    model.eval()
    try:
        return _attention_logits(model, idx)
    finally:
        model.train(was_training)


def _attention_logits(model, idx):
    positions = model.encoding.forward_positions(torch.arange(idx.shape[1], device=idx.device), False)
    out = []
    for layer, (block, x) in enumerate(zip(model.blocks, _layer_inputs(model, idx))):
        attn = block.attn
        encoding = model.encoding.for_layer(layer, len(model.blocks))
        with torch.no_grad():
            q, k, _ = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.n_head)
            q, k = encoding.rotate(q, k, positions)
            householder = encoding.householder(x)  # PaTH's transforms: its logits in place of q . k
            if householder is None:
                scores = einsum(q.float(), k.float(), "b h i d, b h j d -> b h i j") / math.sqrt(q.shape[-1])
            else:
                scores = logits(q.float(), k.float(), householder)
            bias = encoding.bias(positions, positions)
            if bias is not None:
                scores = scores + bias.float()
            if encoding.reads_tokens:  # FoX's decay from the layer's input, CoPE's term from the queries and keys
                log_f = encoding.decay(x)
                sums = None if log_f is None else forget_sums(log_f)
                scores = scores + token_mask(encoding, q.float(), k.float(), sums, sums, positions, positions,
                                             causal=True)
            out.append(scores.masked_fill(_unseen(encoding, positions), float("-inf")))
    return out


def _unseen(encoding, positions: torch.Tensor) -> torch.Tensor:
    """``True`` (``n x n``) on the keys a query of the layer does not see: after it, or outside its window or chunk."""
    unseen = future_mask(len(positions), len(positions), positions.device)
    if encoding.window is not None:
        unseen = unseen | out_of_reach(positions, positions, encoding.window, True)
    if encoding.chunk is not None:
        unseen = unseen | other_chunk(positions, positions, encoding.chunk)
    return unseen


def attention_weights(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """The attention weights ``softmax(logits)`` of every layer (the layer's encoding's own
    :meth:`~posenc_lab.encodings.Encoding.weights` where they are not a softmax: stick-breaking's): a list of
    ``b h n n`` tensors."""
    n_layer = len(model.blocks)
    return [model.encoding.for_layer(layer, n_layer).weights(scores, 0)
            for layer, scores in enumerate(attention_logits(model, idx))]


def entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each query's attention distribution: ``... n n -> ... n``; 0 for a one-hot row."""
    return -(weights * weights.clamp_min(1e-30).log()).sum(dim=-1)


def mean_by_distance(values: torch.Tensor, *, min_query: int = 0) -> torch.Tensor:
    """The mean of ``values[..., m, n]`` over the pairs at each distance ``m - n = 0 .. n-1``, for queries
    ``m >= min_query``: ``... n n -> ... n`` (NaN where no pair counts)."""
    n = values.shape[-1]
    m = torch.arange(n)[:, None]
    distance = (m - torch.arange(n)[None]).expand(n, n)
    keep = (distance >= 0) & (m >= min_query)
    flat = values.reshape(-1, n, n)
    sums = torch.zeros(flat.shape[0], n, dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.float64)
    d = distance[keep]
    counts.index_add_(0, d, torch.ones_like(d, dtype=torch.float64))
    sums.index_add_(1, d, flat[:, keep].double())
    return (sums / counts).reshape(*values.shape[:-2], n)


def first_token_mass(model, idx: torch.Tensor, *, min_query: int = 1) -> torch.Tensor:
    """The attention weight on the first token (key 0), averaged over the batch and the queries at positions
    ``>= min_query``: one value per layer and head (``n_layer x heads``). StreamingLLM (Xiao et al. 2024)
    calls a first token that draws much of the weight whatever its content an *attention sink*."""
    return torch.stack([w[:, :, min_query:, 0].mean(dim=(0, 2)) for w in attention_weights(model, idx)])
