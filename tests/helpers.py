"""Inputs and checks the encoding tests share."""

import torch


def qkv(n: int, seed: int = 0, heads: int = 4, batch: int = 2, dim: int = 8) -> list[torch.Tensor]:
    """Queries, keys and values ``batch heads n dim``, standard normal, from their own generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=g) for _ in range(3)]


def same_with_and_without_cache(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Generate ``new`` tokens after ``prompt`` (greedy) with a key/value cache and by recomputing every position;
    assert the tokens are equal and the logits that chose them agree to 1e-5; return the cached tokens."""
    cached, cached_logits = model.generate(prompt, new, cache=True, return_logits=True)
    full, full_logits = model.generate(prompt, new, cache=False, return_logits=True)
    assert torch.equal(cached, full)
    torch.testing.assert_close(cached_logits, full_logits, rtol=1e-5, atol=1e-5)
    return cached
