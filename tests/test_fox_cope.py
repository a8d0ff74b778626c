"""FoX (Lin et al. 2025) and CoPE (Golovneva et al. 2024): position signals that read the tokens, checked against
their papers' equations written out here in float64, on every backend, with caches and per-row positions."""

import copy
import math

import pytest
import torch

from posenc_lab import PosencError, attention, bias, make_encoding
from posenc_lab.backends import GRAD_BLOCK, KVCache, SinkCache
from posenc_lab.encodings.contextual import contextual_positions, interpolate
from posenc_lab.encodings.forgetting import decay_bias, forget_sums
from posenc_lab.model import GPT, GPTConfig
from helpers import qkv, same_with_and_without_cache

B, H, D = 2, 4, 8
BACKENDS = ["reference", "sdpa", "flex"]


def perturbed(name, seed=5, **options):
    """The encoding with its parameters moved away from their initialisation (CoPE's embeddings start at zero)."""
    torch.manual_seed(seed)
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=16, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return enc


def layer_input(n, seed=1, batch=B):
    return torch.randn(batch, n, H * D, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- the papers, in float64


def forgetting_attention(q, k, v, log_f, reach=None):
    """Lin et al. (2025), Forgetting Attention:
    o_i = sum_{j<=i} exp(q_i.k_j/sqrt(d) + sum_{l=j+1}^{i} log f_l) v_j / sum_{j<=i} exp(...),
    each sum written as a loop (no running sums)."""
    q, k, v, log_f = (t.double() for t in (q, k, v, log_f))
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = [j for j in range(i + 1) if reach is None or i - j < reach]
                logits = torch.stack([q[b, h, i] @ k[b, h, j] / math.sqrt(D) + log_f[b, h, j + 1:i + 1].sum()
                                      for j in keys])
                out[b, h, i] = logits.softmax(0) @ v[b, h, keys]
    return out


def contextual_attention(q, k, v, table):
    """Golovneva et al. (2024), eqs. 3-5: g_ij = sigmoid(q_i.k_j), p_ij = sum_{t=j}^{i} g_it (capped at P - 1),
    e[p] interpolated between e[floor p] and e[ceil p], logit q_i.k_j + q_i.e[p_ij] (q.k scaled by 1/sqrt(d), as the
    paper's code computes its gates from the attention logits)."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    cap = table.shape[0] - 1
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                scores = k[b, h, :i + 1] @ q[b, h, i] / math.sqrt(D)
                gates = torch.sigmoid(scores)
                logits = []
                for j in range(i + 1):
                    p = min(float(gates[j:].sum()), cap)
                    lo, hi, w = math.floor(p), math.ceil(p), p - math.floor(p)
                    e = (1 - w) * table[lo] + w * table[hi]
                    logits.append(scores[j] + q[b, h, i] @ e)
                out[b, h, i] = torch.stack(logits).softmax(0) @ v[b, h, :i + 1]
    return out


# --------------------------------------------------------------------------------------------- FoX


def test_fox_with_a_constant_gate_is_alibi_with_slope_minus_log_f():
    """A gate that ignores its input (w_f = 0) forgets by the same factor f_h at every token: D_ij = (i - j) log f_h,
    ALiBi's bias with slope m_h = -log f_h."""
    fox, alibi = make_encoding("fox", d_model=H * D, num_heads=H), make_encoding("alibi", num_heads=H)
    f = torch.tensor([0.5, 0.8, 0.95, 0.99])
    with torch.no_grad():
        fox.w_f.zero_()
        fox.b_f.copy_(torch.logit(f))
        alibi.slopes.copy_(-f.log())
    n = 40
    decay = fox.decay(layer_input(n))
    c = forget_sums(decay)
    positions = torch.arange(n)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    want = bias.alibi_bias(alibi.slopes, positions, positions)
    torch.testing.assert_close(decay_bias(c, c)[:, :, visible], want[:, visible].expand(B, H, -1), rtol=1e-5, atol=1e-5)
    q, k, v = qkv(n)
    for backend in BACKENDS:
        with torch.no_grad():
            torch.testing.assert_close(attention(q, k, v, fox, backend=backend, decay=decay),
                                       attention(q, k, v, alibi, backend=backend), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reach", [None, 5])
@pytest.mark.parametrize("pos", ["arange", "offset", "rows"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_forgetting_attention_as_the_paper_writes_it(backend, pos, reach):
    """At any positions (FoX reads none: the same answer), rows of their own (b, n) included, and within a window."""
    n = 24
    fox = perturbed("fox")
    q, k, v = qkv(n)
    x = layer_input(n)
    positions = {"arange": torch.arange(n), "offset": torch.arange(n) + 1000,
                 "rows": torch.stack([torch.arange(n), torch.arange(n) + 7])}[pos]
    with torch.no_grad():
        decay = fox.decay(x)
        got = attention(q, k, v, fox, backend=backend, positions=positions, decay=decay, reach=reach)
    torch.testing.assert_close(got.double(), forgetting_attention(q, k, v, decay, reach), rtol=1e-5, atol=1e-5)


def test_a_decay_works_with_grouped_query_heads():
    fox, n = perturbed("fox"), 20
    q, _, _ = qkv(n)
    _, k, v = qkv(n, seed=3, heads=2)
    with torch.no_grad():
        decay = fox.decay(layer_input(n))
        want = forgetting_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), decay)
        for backend in BACKENDS:
            torch.testing.assert_close(attention(q, k, v, fox, backend=backend, decay=decay).double(), want,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fox", "cope"])
def test_gradients_through_sdpa_equal_the_reference(name):
    """Past GRAD_BLOCK queries (the explicit softmax in blocks): every gradient, the gates' or embeddings' included."""
    n = GRAD_BLOCK + 21
    original, x = perturbed(name), layer_input(n)
    grads = {}
    for backend in ("reference", "sdpa"):
        enc = copy.deepcopy(original)
        q, k, v = (t.requires_grad_() for t in qkv(n))
        out = attention(q, k, v, enc, backend=backend, decay=enc.decay(x))
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad] + [p.grad for p in enc.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads["sdpa"])
    for got, want in zip(grads["sdpa"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_every_layer_has_its_own_gates_and_the_model_trains_them():
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="fox", n_layer=3, n_head=H, d_model=H * D, train_len=16))
    layers = [model.encoding.for_layer(i, 3) for i in range(3)]
    assert len({id(layer.w_f) for layer in layers}) == 3
    assert sum(p.numel() for p in model.encoding.parameters()) == 3 * (H * H * D + H)
    x = torch.randint(0, 256, (2, 17))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    assert all(layer.w_f.grad.abs().sum() > 0 and layer.b_f.grad.abs().sum() > 0 for layer in layers)
    with pytest.raises(PosencError, match="build it with n_layer=4"):
        model.encoding.for_layer(0, 4)


def test_fox_refuses_what_it_cannot_serve_in_one_line():
    fox, (q, k, v) = perturbed("fox"), qkv(8)
    decay = fox.decay(layer_input(8))
    for call, match in [(lambda: attention(q, k, v, fox), "pass decay=encoding.decay"),
                        (lambda: attention(q, k, v, fox, decay=decay, causal=False), "no non-causal form"),
                        (lambda: attention(q, k, v, fox, decay=decay, cache=SinkCache(4)), "decode a decay-gated"),
                        (lambda: attention(q, k, v, fox, decay=decay[:, :, :3]), "decay must hold")]:
        with pytest.raises(PosencError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------- CoPE


def test_cope_with_every_gate_open_counts_relative_positions():
    """g = 1 on every key a query sees: p_ij = i - j + 1 (capped), and the added term is q_i . e[i - j + 1], a
    relative-position term."""
    n, cap = 12, 7
    visible = torch.ones(n, n).tril()
    p = contextual_positions(visible, cap)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    torch.testing.assert_close(p[visible.bool()], (i - j + 1).clamp(max=cap).float()[visible.bool()])
    q, table = torch.randn(1, 1, n, D), torch.randn(cap + 1, D)
    term = interpolate(torch.einsum("bhid,pd->bhip", q, table), p.expand(1, 1, n, n))
    want = torch.einsum("bhid,ijd->bhij", q, table[(i - j + 1).clamp(0, cap)])
    torch.testing.assert_close(term[..., visible.bool()], want[..., visible.bool()])


def test_interpolation_at_an_integer_position_is_the_embedding():
    logits = torch.randn(1, 1, 1, 6)
    for p in range(6):
        assert torch.equal(interpolate(logits, torch.full((1, 1, 1, 1), float(p)))[0, 0, 0, 0], logits[0, 0, 0, p])
    half = interpolate(logits, torch.full((1, 1, 1, 1), 2.25))[0, 0, 0, 0]
    torch.testing.assert_close(half, 0.75 * logits[0, 0, 0, 2] + 0.25 * logits[0, 0, 0, 3])


@pytest.mark.parametrize("npos_max", [64, 4])
@pytest.mark.parametrize("pos", ["arange", "offset", "rows"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_cope_as_the_paper_writes_it(backend, pos, npos_max):
    """With a cap above every count and one that most pairs reach."""
    n = 20
    cope = perturbed("cope", npos_max=npos_max)
    q, k, v = (2 * t for t in qkv(n))  # sharper gates than at unit scale
    positions = {"arange": torch.arange(n), "offset": torch.arange(n) + 1000,
                 "rows": torch.stack([torch.arange(n), torch.arange(n) + 7])}[pos]
    with torch.no_grad():
        got = attention(q, k, v, cope, backend=backend, positions=positions)
    torch.testing.assert_close(got.double(), contextual_attention(q, k, v, cope.table), rtol=1e-5, atol=1e-5)


def test_cope_refuses_noncausal_attention_in_one_line():
    with pytest.raises(PosencError, match="no non-causal form"):
        attention(*qkv(8), perturbed("cope"), causal=False)
    with pytest.raises(PosencError, match="npos_max >= 2"):
        make_encoding("cope", head_dim=D, npos_max=1)


# --------------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["fox", "cope"])
def test_a_key_value_cache_token_by_token_equals_one_pass(name, backend):
    """The cache keeps every key (and FoX's running sum c_t of each token): feeding the prompt, then one token at a
    time, gives what one pass over the whole sequence gives."""
    n, start = 16, 5
    enc, (q, k, v), x = perturbed(name), qkv(n), layer_input(n)
    with torch.no_grad():
        decay = enc.decay(x)
        whole = attention(q, k, v, enc, backend=backend, decay=decay)
        cache, steps = KVCache(), [(0, start)] + [(t, t + 1) for t in range(start, n)]
        parts = [attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], enc, backend=backend, cache=cache,
                           decay=None if decay is None else decay[:, :, a:b]) for a, b in steps]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_cope_with_a_sink_cache_counts_the_keys_the_cache_holds():
    """Below its capacity a sink cache holds every key: the same answer as one pass."""
    cope, (q, k, v) = perturbed("cope"), qkv(10)
    with torch.no_grad():
        whole = attention(q, k, v, cope)
        cache = SinkCache(window=16, sinks=2)
        parts = [attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cope, cache=cache) for t in range(10)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fox", "cope"])
def test_cached_generation_equals_recomputing_everything(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=2, n_head=H, d_model=H * D, train_len=16)).eval()
    with torch.no_grad():
        for p in model.encoding.parameters():
            p.add_(0.5 * torch.randn(p.shape))
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    same_with_and_without_cache(model, prompt, 24)
