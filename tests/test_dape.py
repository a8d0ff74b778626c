"""DAPE (Zheng et al. 2024) and its convolutional form (DAPE v2): the paper's logits written out here in float64, pair
by pair, against every backend; the network zeroed gives the base bias back; no key after a query reaches it; a
key/value cache gives what one pass gives."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from posenc_lab import PosencError, attention, make_encoding
from posenc_lab.backends import GRAD_BLOCK, KVCache, SinkCache
from posenc_lab.model import GPT, GPTConfig
from helpers import qkv, same_with_and_without_cache

B, H, D = 2, 4, 8
BACKENDS = ["reference", "sdpa", "flex"]
NAMES = ["dape-alibi", "dape-kerple", "dape-fire"]


def perturbed(name, seed=5, **options):
    """The encoding with every learned parameter moved away from its initialisation (the base's too)."""
    torch.manual_seed(seed)
    enc = make_encoding(name, num_heads=H, train_len=16, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return enc


# --------------------------------------------------------------------------------------------- the paper, in float64


def base_bias(enc, i, j):
    """The base bias of every head at query position ``i`` and key position ``j <= i``: ALiBi's ``-m_h (i - j)`` with
    the slopes ``2^(-8 h / H)``, KERPLE-log's ``-r1_h ln(1 + r2_h (i - j))``, and FIRE's (the package's FIRE, tested
    against its paper in its own tests)."""
    base = enc.base
    if base.name == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        return -slopes * (i - j)
    if base.name == "kerple":
        r1, r2 = (t.double() for t in base.kernel.params())
        return -r1 * torch.log(1 + r2 * (i - j))
    return base.bias(torch.tensor([i]), torch.tensor([j]))[:, 0, 0].double()


def leaky(x):
    return torch.where(x > 0, x, 0.01 * x)


def dape_attention(q, k, v, enc):
    """Zheng et al. (2024), A = S + B + f(S, B), with f two maps of the 2H numbers of a pair and LeakyReLU between;
    DAPE v2 (kernel t > 1): each map a convolution along the keys of the query's row, the keys after the query
    counted as zero. Written pair by pair, each sum a loop."""
    q, k, v = (t.double() for t in (q, k, v))
    w1, c1 = enc.inner.weight.double()[:, :, 0, :], enc.inner.bias.double()  # D 2H t, D
    w2, c2 = enc.outer.weight.double()[:, :, 0, :], enc.outer.bias.double()  # H D t, H
    t, half = w1.shape[-1], w1.shape[-1] // 2
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            scores = torch.stack([torch.stack([q[b, h, i] @ k[b, h, j] / math.sqrt(D) for h in range(H)])
                                  for j in range(i + 1)])  # j h
            bias = torch.stack([base_bias(enc, i, j) for j in range(i + 1)])  # j h
            x = torch.cat([scores, bias], dim=1)  # j 2H: the features of the keys the query sees

            def at(rows, j):  # a seen key's row, zero outside 0 .. i
                return rows[j] if 0 <= j <= i else torch.zeros_like(rows[0])

            middle = torch.stack([leaky(c1 + sum(w1[:, :, s] @ at(x, j + s - half) for s in range(t)))
                                  for j in range(i + 1)])  # j D
            f = torch.stack([c2 + sum(w2[:, :, s] @ at(middle, j + s - half) for s in range(t))
                             for j in range(i + 1)])  # j h
            logits = scores + bias + f
            for h in range(H):
                out[b, h, i] = logits[:, h].softmax(0) @ v[b, h, :i + 1]
    return out


# --------------------------------------------------------------------------------------------- the formula


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_dape_as_the_paper_writes_it(backend, name, kernel):
    n = 12
    enc = perturbed(name, kernel=kernel)
    q, k, v = qkv(n)
    with torch.no_grad():
        got = attention(q, k, v, enc, backend=backend)
    torch.testing.assert_close(got.double(), dape_attention(q, k, v, enc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_dape_with_its_network_zeroed_is_its_base_bias(name):
    """W_2 = 0, c_2 = 0: f vanishes and DAPE is its base encoding exactly, logit for logit, in every backend."""
    n = 20
    enc = perturbed(name)
    with torch.no_grad():
        enc.outer.weight.zero_()
        enc.outer.bias.zero_()
    q, k, v = qkv(n)
    positions = torch.arange(n) + 3
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
    got = enc.token_bias(q.double(), k.double(), hidden, positions, positions)
    want = enc.base.bias(positions, positions).double()
    assert torch.equal(got, want.expand(B, -1, -1, -1))
    with torch.no_grad():
        for backend in BACKENDS:
            torch.testing.assert_close(attention(q, k, v, enc, backend=backend, positions=positions),
                                       attention(q, k, v, enc.base, backend=backend, positions=positions),
                                       rtol=1e-6, atol=1e-6)


def test_a_model_with_the_network_zeroed_is_the_base_model():
    """The whole GPT: dape-kerple with W_2 = c_2 = 0 and kerple, given the same weights, give the same logits."""
    torch.manual_seed(0)
    kerple = GPT(GPTConfig(encoding="kerple", n_layer=2, n_head=H, d_model=H * D, train_len=16)).eval()
    dape = GPT(GPTConfig(encoding="dape-kerple", n_layer=2, n_head=H, d_model=H * D, train_len=16)).eval()
    state = {("encoding.base." + key[len("encoding."):] if key.startswith("encoding.") else key): value
             for key, value in kerple.state_dict().items()}
    missing, unexpected = dape.load_state_dict(state, strict=False)
    assert not unexpected and all(".inner." in key or ".outer." in key or key.startswith("encoding.later.")
                                  for key in missing)
    with torch.no_grad():
        for layer in range(2):
            net = dape.encoding.for_layer(layer, 2)
            net.outer.weight.zero_()
            net.outer.bias.zero_()
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(dape(idx), kerple(idx), rtol=1e-5, atol=1e-5)


def test_dape_reads_one_pair_and_v2_its_neighbours_along_the_keys():
    """Moving key 3 changes query 9's bias on key 3 only under DAPE; under DAPE v2 (kernel 3) on keys 2 to 4 too,
    and on no other key (two maps of width 3 reach two keys each way)."""
    n = 10
    q, k, _ = qkv(n)
    moved = k.clone()
    moved[:, :, 3] += 1.0
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
    positions = torch.arange(n)
    for kernel, reached in [(1, {3}), (3, {1, 2, 3, 4, 5})]:
        enc = perturbed("dape-alibi", kernel=kernel)
        with torch.no_grad():
            a = enc.token_bias(q, k, hidden, positions, positions)[:, :, 9]
            b = enc.token_bias(q, moved, hidden, positions, positions)[:, :, 9]
        changed = {j for j in range(n) if (a[..., j] - b[..., j]).abs().max() > 1e-6}
        assert changed == reached, (kernel, changed)


def test_v2_differs_from_the_released_form_only_at_the_querys_own_key():
    """The released DAPE v2 zeroes the unseen keys before its first convolution only; the package zeroes them before
    the second too (for the key/value cache). With kernel 3, the two forms, written here with plain convolutions in
    float64, give the same f on every seen pair but the query's own key, and differ there (but for the last query,
    which has no unseen key next to its own)."""
    from posenc_lab.encodings.adaptive import dape_term

    n = 9
    enc = perturbed("dape-kerple", kernel=3).double()
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(B, H, n, n, generator=g, dtype=torch.float64)
    base = torch.randn(H, n, n, generator=g, dtype=torch.float64)
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1)

    def conv(x, layer):  # a width-3 convolution along the keys, one zero of padding each side
        return F.conv2d(x, layer.weight, layer.bias, padding=(0, 1))

    features = torch.cat([scores, base.expand(scores.shape)], dim=1).masked_fill(hidden, 0.0)
    released = conv(F.leaky_relu(conv(features, enc.inner), 0.01), enc.outer)
    with torch.no_grad():
        ours = dape_term(scores, base, hidden, enc.inner, enc.outer)
    diagonal = torch.eye(n, dtype=torch.bool)
    off = ~hidden & ~diagonal
    own = diagonal.clone()
    own[-1, -1] = False  # the last query's row ends at its own key in both forms
    torch.testing.assert_close(ours[..., off], released[..., off], rtol=0, atol=1e-12)
    assert (ours[..., own] - released[..., own]).abs().min() > 1e-6
    torch.testing.assert_close(ours[..., -1, -1], released[..., -1, -1], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- causality


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_key_after_a_query_changes_its_output(backend, kernel):
    """Keys and values from position 8 on replaced: the outputs of queries 0 .. 7 do not move, bit for bit in the
    reference."""
    n, t = 16, 8
    enc = perturbed("dape-kerple", kernel=kernel)
    q, k, v = qkv(n)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] = 5 * torch.randn_like(k2[:, :, t:])
    v2[:, :, t:] = 5 * torch.randn_like(v2[:, :, t:])
    with torch.no_grad():
        a = attention(q, k, v, enc, backend=backend)
        b = attention(q, k2, v2, enc, backend=backend)
    if backend == "reference":
        assert torch.equal(a[:, :, :t], b[:, :, :t])
    torch.testing.assert_close(a[:, :, :t], b[:, :, :t], rtol=0, atol=1e-6)
    assert (a[:, :, t:] - b[:, :, t:]).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", [1, 3])
def test_no_gradient_reaches_a_key_after_the_query(kernel):
    n, t = 12, 6
    enc = perturbed("dape-alibi", kernel=kernel)
    q, k, v = (x.requires_grad_() for x in qkv(n))
    attention(q, k, v, enc, backend="sdpa")[:, :, :t].pow(2).sum().backward()
    assert k.grad[:, :, t:].abs().max() == 0 and v.grad[:, :, t:].abs().max() == 0
    assert k.grad[:, :, :t].abs().max() > 0


# --------------------------------------------------------------------------------------------- backends, caches


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("pos", ["offset", "rows"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_every_backend_equals_the_reference(backend, pos, kernel):
    """At positions far from 0 and at rows of their own (b, n), within a window too: the base bias reads them."""
    n = 20
    enc = perturbed("dape-fire", kernel=kernel)
    q, k, v = qkv(n)
    positions = {"offset": torch.arange(n) + 1000, "rows": torch.stack([torch.arange(n), torch.arange(n) + 7])}[pos]
    with torch.no_grad():
        for reach in (None, 6):
            torch.testing.assert_close(attention(q, k, v, enc, backend=backend, positions=positions, reach=reach),
                                       attention(q, k, v, enc, backend="reference", positions=positions, reach=reach),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [1, 3])
def test_gradients_through_sdpa_equal_the_reference(kernel):
    """Past GRAD_BLOCK queries (the explicit softmax in blocks): every gradient, the network's and the base's too."""
    n = GRAD_BLOCK + 21
    original = perturbed("dape-kerple", kernel=kernel)
    grads = {}
    for backend in ("reference", "sdpa"):
        enc = copy.deepcopy(original)
        q, k, v = (t.requires_grad_() for t in qkv(n, batch=1))
        out = attention(q, k, v, enc, backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad] + [p.grad for p in enc.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads["sdpa"])
    for got, want in zip(grads["sdpa"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_value_cache_token_by_token_equals_one_pass(backend, kernel):
    n, start = 16, 5
    enc, (q, k, v) = perturbed("dape-kerple", kernel=kernel), qkv(n)
    with torch.no_grad():
        whole = attention(q, k, v, enc, backend=backend)
        cache, steps = KVCache(), [(0, start)] + [(t, t + 1) for t in range(start, n)]
        parts = [attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], enc, backend=backend, cache=cache)
                 for a, b in steps]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_a_sink_cache_below_its_capacity_equals_one_pass():
    enc, (q, k, v) = perturbed("dape-alibi", kernel=3), qkv(10)
    with torch.no_grad():
        whole = attention(q, k, v, enc)
        cache = SinkCache(window=16, sinks=2)
        parts = [attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], enc, cache=cache) for t in range(10)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_cached_generation_equals_recomputing_everything(name, kernel):
    """Past the training length: 6 prompt tokens and 20 new ones, trained at 16."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=2, n_head=H, d_model=H * D, train_len=16,
                          encoding_options={"kernel": kernel})).eval()
    with torch.no_grad():
        for p in model.encoding.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    same_with_and_without_cache(model, prompt, 20)


# --------------------------------------------------------------------------------------------- the model, refusals


def test_every_layer_has_its_own_network_and_shares_the_base():
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="dape-kerple", n_layer=3, n_head=H, d_model=H * D, train_len=16,
                          encoding_options={"width": 16}))
    layers = [model.encoding.for_layer(i, 3) for i in range(3)]
    assert len({id(layer.inner.weight) for layer in layers}) == 3 and len({id(layer.base) for layer in layers}) == 1
    # three networks (2H -> 16 -> H, with biases) and one KERPLE (r1, r2 per head)
    assert sum(p.numel() for p in model.encoding.parameters()) == 3 * (2 * H * 16 + 16 + 16 * H + H) + 2 * H
    x = torch.randint(0, 256, (2, 17))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoding.parameters())
    with pytest.raises(PosencError, match="build it with n_layer=4"):
        model.encoding.for_layer(0, 4)


def test_the_network_is_the_papers_width_and_activation():
    """D_DAPE = 32 by default; LeakyReLU's negative side passes 0.01 of its input (checked through the formula
    test above; here the shapes)."""
    enc = make_encoding("dape-alibi", num_heads=H)
    assert enc.inner.weight.shape == (32, 2 * H, 1, 1) and enc.outer.weight.shape == (H, 32, 1, 1)
    assert make_encoding("dape-alibi", num_heads=H, kernel=3).inner.weight.shape == (32, 2 * H, 1, 3)
    assert F.leaky_relu(torch.tensor(-1.0)).item() == pytest.approx(-0.01)


def test_dape_refuses_what_it_cannot_serve_in_one_line():
    q, k, v = qkv(8)
    for call, match in [(lambda: attention(q, k, v, perturbed("dape-fire"), causal=False), "no non-causal form"),
                        (lambda: make_encoding("dape-kerple", num_heads=H, kernel=2), "kernel must be odd"),
                        (lambda: make_encoding("dape-kerple", num_heads=H, width=0), "width must be a positive"),
                        (lambda: make_encoding("dape-alibi", num_heads=H, n_layer=0), "positive number of layers"),
                        (lambda: attention(q[:, :2], k[:, :2], v[:, :2], perturbed("dape-alibi")), "num_heads=2"),
                        (lambda: perturbed("dape-alibi").token_bias(q, k, torch.zeros(8, 8, dtype=torch.bool)),
                         "pass q_pos and k_pos")]:
        with pytest.raises(PosencError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_dape_on_alibi_attends_both_ways_where_its_base_does():
    """f reads a pair (or its row's neighbours): non-causal attention is defined as for ALiBi, and every backend
    agrees."""
    enc, (q, k, v) = perturbed("dape-alibi", kernel=3), qkv(10)
    with torch.no_grad():
        want = attention(q, k, v, enc, backend="reference", causal=False)
        for backend in ("sdpa", "flex"):
            torch.testing.assert_close(attention(q, k, v, enc, backend=backend, causal=False), want,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [1, 3])
def test_query_rows_taken_a_few_at_a_time_give_the_same_attention(kernel, monkeypatch):
    """A long window's hidden activations are computed a few query rows at a time: the paper's logits still."""
    enc, (q, k, v) = perturbed("dape-kerple", kernel=kernel), qkv(14)
    monkeypatch.setattr(type(enc), "CHUNK", B * 32 * 14 * 3)  # 3 query rows at a time
    with torch.no_grad():
        got = attention(q, k, v, enc, backend="sdpa")
    torch.testing.assert_close(got.double(), dape_attention(q, k, v, enc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["causal", "reach", "chunk", "padding", "both ways", "blind rows"])
def test_one_key_maps_run_unmasked_give_every_entry_of_the_masked_network(pattern):
    """DAPE's maps of one key run over every pair unmasked, the unseen pairs then set to the outer bias: every entry,
    the unseen ones included, equals the network over features zeroed on the unseen keys before and after LeakyReLU,
    and so do the gradients of a loss on the seen pairs (inputs and every weight), in float64."""
    from posenc_lab.backends.tokens import _hidden
    from posenc_lab.encodings.adaptive import LEAKY_SLOPE, conv_keys, dape_pairwise

    enc = perturbed("dape-alibi" if pattern == "both ways" else "dape-kerple")
    g = torch.Generator().manual_seed(3)
    scores, base = torch.randn(B, H, 20, 20, generator=g), torch.randn(H, 20, 20, generator=g)
    pos, keep = torch.arange(20), torch.ones(B, 20, dtype=torch.bool)
    keep[0, :7], keep[1, 15:] = False, False
    hidden = _hidden(pos, pos, 20, 20, pattern != "both ways", 5 if pattern == "reach" else None, 0, "cpu",
                     6 if pattern == "chunk" else None, keep if pattern == "padding" else None)
    if pattern == "blind rows":
        hidden = hidden.clone()
        hidden[:8] = True
    enc = enc.double()
    scores, base = scores.double().requires_grad_(), base.double().requires_grad_()
    weight = torch.randn(B, H, 20, 20, generator=g, dtype=torch.float64).masked_fill(hidden, 0.0)  # seen pairs only

    def run(form):
        enc.zero_grad()
        scores.grad = base.grad = None
        out = form()
        (out * weight).sum().backward()
        return out.detach(), [t.grad.clone() for t in (scores, base, *enc.inner.parameters(), *enc.outer.parameters())]

    def masked():
        features = torch.cat([scores, base.expand(scores.shape)], dim=1).masked_fill(hidden, 0.0)
        middle = F.leaky_relu(conv_keys(features, enc.inner), LEAKY_SLOPE).masked_fill(hidden, 0.0)
        return conv_keys(middle, enc.outer)

    want, want_grads = run(masked)
    got, got_grads = run(lambda: dape_pairwise(scores, base, hidden, enc.inner, enc.outer))
    assert got.shape == want.shape == (B, H, 20, 20)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):  # the gradients of what the seen pairs feed: the same
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
