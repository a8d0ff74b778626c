"""Stick-breaking attention (Tan et al. 2025): the weights against the paper's equation written out in float64, their
properties (at least 0, at most 1 in all, a geometric fall with equal logits, no position signal), every backend and
the key/value cache against the reference."""

import math

import pytest
import torch

from posenc_lab import KVCache, PosencError, SinkCache, StickBreaking, attention, make_encoding
from posenc_lab.encodings.stickbreaking import stick_breaking_weights
from posenc_lab.model import GPT, GPTConfig
from helpers import same_with_and_without_cache

B, H, N, D = 2, 3, 12, 8


def qkv(n=N, seed=0, scale=1.0, dtype=torch.float64, heads=H):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(B, heads, n, D, generator=g, dtype=dtype) for _ in range(3)]


def paper_weights(q, k, attend_current=False):
    """The paper's equation, one pair at a time: ``A_ij = sigmoid(z_ij) prod_{j<k<i} (1 - sigmoid(z_ik))`` for
    ``j < i`` (``j <= i`` with ``attend_current``, the query's own key first in line), ``z = q . k / sqrt(d)``."""
    b, h, n, d = q.shape
    A = torch.zeros(b, h, n, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                last = i if attend_current else i - 1
                beta = [1 / (1 + math.exp(-float(q[bi, hi, i] @ k[bi, hi, m]) / math.sqrt(d))) for m in range(n)]
                for j in range(last + 1):
                    weight = beta[j]
                    for m in range(j + 1, last + 1):
                        weight *= 1 - beta[m]
                    A[bi, hi, i, j] = weight
    return A


@pytest.mark.parametrize("attend_current", [False, True])
def test_weights_are_the_papers_product_written_out(attend_current):
    q, k, v = qkv()
    expected = paper_weights(q, k, attend_current)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1),
                                                                   float("-inf"))
    got = stick_breaking_weights(logits, 0, attend_current=attend_current)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    enc = StickBreaking(attend_current=attend_current)
    torch.testing.assert_close(attention(q, k, v, enc, backend="reference"), expected @ v, rtol=1e-12, atol=1e-12)


def test_weights_are_at_least_zero_and_sum_to_at_most_one_what_is_left_being_the_unbroken_stick():
    """``1 - sum_j A_ij = prod_{j<i} (1 - beta_ij)``: the stick is what no key took (an independent formula), between 0
    and 1, at logits as large as +-60 too (float32, no NaN)."""
    for scale in (1.0, 30.0):
        q, k, _ = qkv(n=40, scale=scale ** 0.5 * 2, dtype=torch.float32, seed=3)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1),
                                                                       float("-inf"))
        A = stick_breaking_weights(logits, 0)
        assert torch.isfinite(A).all() and (A >= 0).all()
        total = A.sum(-1)
        assert (total <= 1 + 1e-6).all()
        z = logits.double().masked_fill(torch.eye(40, dtype=torch.bool), float("-inf"))  # the query's own key: none
        unbroken = torch.exp(-torch.nn.functional.softplus(z).sum(-1))
        torch.testing.assert_close(1 - total.double(), unbroken, rtol=1e-4, atol=1e-5)


def test_equal_logits_give_weights_that_fall_geometrically_with_distance_and_no_position_enters():
    """All logits ``z``: ``A_ij = beta (1 - beta)^(i - j - 1)`` with ``beta = sigmoid(z)``, whatever the absolute
    positions: the recency bias comes from the process, not from a position encoding."""
    n, z = 16, 0.7
    beta = 1 / (1 + math.exp(-z))
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    expected = torch.where(d >= 1, beta * (1 - beta) ** (d - 1).clamp(min=0).double(),
                           torch.zeros((), dtype=torch.float64))
    q = torch.zeros(1, 1, n, D, dtype=torch.float64)
    q[..., 0] = z * math.sqrt(D)
    k = torch.zeros_like(q)
    k[..., 0] = 1.0
    enc = StickBreaking()
    for positions in (torch.arange(n), torch.arange(n) + 1000, torch.arange(0, 3 * n, 3)):
        out = attention(q, k, torch.eye(n, dtype=torch.float64)[None, None], enc, backend="reference",
                        positions=positions)  # the values pick out each key's weight
        torch.testing.assert_close(out[0, 0], expected, rtol=1e-12, atol=1e-15)
    # each weight is (1 - beta) times the one nearer the query: a geometric fall
    row = expected[-1, :-1]
    torch.testing.assert_close(row[:-1] / row[1:], torch.full((n - 2,), 1 - beta, dtype=torch.float64))


@pytest.mark.parametrize("attend_current", [False, True])
def test_the_first_query_attends_to_nothing_unless_it_sees_itself(attend_current):
    q, k, v = qkv()
    out = attention(q, k, v, StickBreaking(attend_current=attend_current), backend="reference")
    first = v[:, :, 0] / (1 + torch.exp(-(q[:, :, 0] * k[:, :, 0]).sum(-1, keepdim=True) / math.sqrt(D)))
    torch.testing.assert_close(out[:, :, 0], first if attend_current else torch.zeros_like(first))


@pytest.mark.parametrize("options", [{}, {"reach": 5}, {"chunk": 4}, {"positions": torch.arange(N) + 77},
                                     {"grouped": True}, {"real_keys": True}, {"attend_current": True}],
                         ids=["plain", "reach", "chunk", "offset", "grouped", "padded", "attend-current"])
def test_sdpa_backend_equals_reference(options):
    options = dict(options)
    enc = StickBreaking(attend_current=options.pop("attend_current", False))
    q, k, v = qkv(dtype=torch.float32, seed=5)
    if options.pop("grouped", False):
        k, v = k[:, :1], v[:, :1]
    if options.pop("real_keys", False):
        options["real_keys"] = torch.ones(B, N, dtype=torch.bool)
        options["real_keys"][0, :3] = False
    ref = attention(q, k, v, enc, backend="reference", **options)
    got = attention(q, k, v, enc, backend="sdpa", **options)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert attention(q, k, v, enc, **options).shape == ref.shape  # auto: sdpa


def test_sdpa_in_blocks_past_one_block_and_gradients_match_the_reference():
    from posenc_lab.backends import kernels

    enc = StickBreaking()
    q, k, v = (t.requires_grad_() for t in qkv(n=kernels.GRAD_BLOCK + 37, dtype=torch.float32, seed=2))
    out = attention(q, k, v, enc, backend="sdpa")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, enc, backend="reference")
    ref_grads = torch.autograd.grad(ref.square().sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_flex_and_noncausal_attention_are_refused_in_one_sentence():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(PosencError, match=r"^FlexAttention computes a softmax, and 'stick-breaking' weighs the keys "
                                          r"by stick-breaking: use backend='sdpa'"):
        attention(q, k, v, StickBreaking(), backend="flex")
    with pytest.raises(PosencError, match="no non-causal form"):
        attention(q, k, v, StickBreaking(), causal=False)


@pytest.mark.parametrize("cache_kind", ["kv", "sink"])
def test_a_cache_token_by_token_equals_one_pass(cache_kind):
    """Each query's weights read only its own row of logits: a cache that feeds one token at a time gives the
    whole pass's answer (a sink cache too, while the stream fits in it)."""
    q, k, v = qkv(dtype=torch.float32, seed=4)
    enc = StickBreaking()
    cache = KVCache() if cache_kind == "kv" else SinkCache(window=N, sinks=2)
    steps = [attention(q[:, :, [i]], k[:, :, [i]], v[:, :, [i]], enc, cache=cache) for i in range(N)]
    torch.testing.assert_close(torch.cat(steps, dim=2), attention(q, k, v, enc, backend="reference"),
                               rtol=1e-5, atol=1e-6)


def test_the_model_generates_the_same_with_and_without_a_cache_and_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="stick-breaking", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    same_with_and_without_cache(model, prompt, 20)
    assert sum(p.numel() for p in model.encoding.parameters()) == 0


def test_registered_with_its_option_and_not_among_the_primary_encodings():
    from posenc_lab.encodings import ENCODINGS, PRIMARY

    assert ENCODINGS["stick-breaking"] is StickBreaking and "stick-breaking" not in PRIMARY
    assert make_encoding("stick-breaking", attend_current=True).attend_current
    with pytest.raises(PosencError, match="attend_current must be True or False"):
        StickBreaking(attend_current=1)


def test_the_diagnostics_recompute_each_layers_stick_breaking_weights():
    """:func:`diagnostics.attention_weights` gives the stick-breaking weights (rows summing to less than one), whose
    product with the values is the layer's attention."""
    from einops import rearrange

    from posenc_lab.lab.measure import diagnostics

    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="stick-breaking", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    for block, w, x in zip(model.blocks, diagnostics.attention_weights(model, idx),
                           diagnostics._layer_inputs(model, idx)):
        assert (w.sum(-1) < 1).all() and (w.triu(0) == 0).all()  # the query's own key and later ones: nothing
        q, k, v = rearrange(block.attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=2)
        with torch.no_grad():
            want = attention(q, k, v, model.encoding, backend="reference")
        torch.testing.assert_close(w @ v.detach(), want, rtol=1e-5, atol=1e-5)
