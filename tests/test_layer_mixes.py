"""The local/global layer mixes of 2025's models (Gemma 3, Llama 4's iRoPE and its attention temperature,
RNoPE-SWA), each checked against attention written out here in float64: an explicit masked softmax, RoPE rotated
by hand, chunks attended one at a time."""

import math

import pytest
import torch
from einops import einsum, rearrange

import posenc_lab as pl
from posenc_lab import PosencError, attention, make_encoding
from posenc_lab.backends import KVCache, SinkCache
from posenc_lab.encodings import PRIMARY, attn_temperature
from posenc_lab.model import GPT, GPTConfig
from helpers import same_with_and_without_cache

B, H, D, L = 2, 2, 16, 32  # L / 4 = 8: the default window, chunk and floor_scale
MIXES = ["gemma3", "irope", "rnope-swa", "nope-temp"]
BACKENDS = ["reference", "sdpa"] + (["flex"] if pl.backends.flex_available(torch.device("cpu")) else [])
POSITIONS = {"arange": lambda n: torch.arange(n), "offset": lambda n: torch.arange(n) + 1003,
             "strided": lambda n: torch.arange(0, 3 * n, 3)}


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for _ in range(3)]


def mix(name, **options):
    return make_encoding(name, d_model=H * D, num_heads=H, train_len=L, **options)


def rotated(x, positions, base):
    """RoPE by hand (the half layout: coordinate ``i`` turns with ``i + d/2``), float64."""
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # d/2
    angle = rearrange(positions.double(), "n -> n 1") * theta  # n d/2
    x1, x2 = x.double()[..., : D // 2], x.double()[..., D // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def explicit(q, k, v, keep):
    """``softmax(q k^T / sqrt(d)) v`` over the keys where ``keep`` (``n_q x n_k``) holds, in float64."""
    scores = einsum(q.double(), k.double(), "b h i d, b h j d -> b h i j") / math.sqrt(D)
    weights = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return einsum(weights, v.double(), "b h i j, b h j d -> b h i d")


def causal_within(positions, window):
    i, j = rearrange(positions, "n -> n 1"), rearrange(positions, "n -> 1 n")
    return (j <= i) & (i - j < window)


# --------------------------------------------------------------------------------------------- windows and chunks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reach", [None, 5, 20], ids=["no-reach", "reach-inside", "reach-outside"])
@pytest.mark.parametrize("pos", sorted(POSITIONS))
@pytest.mark.parametrize("name", ["gemma3", "rnope-swa"])
def test_a_windowed_layer_equals_full_attention_restricted_to_the_window(name, pos, reach, backend):
    """RoPE of base 10,000, each query on the keys less than W = 8 positions back; with the model's reach too, the
    smaller window wins."""
    enc, n = mix(name), 40
    assert enc.window == 8
    q, k, v = qkv(n)
    p = POSITIONS[pos](n)
    window = 8 if reach is None else min(8, reach)
    want = explicit(rotated(q, p, 10_000.0), rotated(k, p, 10_000.0), v, causal_within(p, window))
    with torch.no_grad():
        got = attention(q, k, v, enc, backend=backend, positions=p, reach=reach)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reach", [None, 3], ids=["no-reach", "reach-inside"])
@pytest.mark.parametrize("pos", sorted(POSITIONS))
def test_a_chunked_layer_equals_attention_computed_chunk_by_chunk(pos, reach, backend):
    """Llama 4's chunked RoPE layer: cut the sequence at every multiple of C = 8 positions and attend within each
    piece on its own (causal, and within the model's reach when given): the layer's output, piece by piece."""
    enc, n = mix("irope"), 45
    assert enc.chunk == 8 and enc.window is None
    q, k, v = qkv(n, seed=1)
    p = POSITIONS[pos](n)
    q, k = rotated(q, p, 10_000.0), rotated(k, p, 10_000.0)
    pieces, chunk_of = [], torch.div(p, 8, rounding_mode="floor")
    for c in chunk_of.unique():
        rows = (chunk_of == c).nonzero().squeeze(1)
        pp = p[rows]
        keep = causal_within(pp, math.inf if reach is None else reach)
        pieces.append(explicit(q[:, :, rows], k[:, :, rows], v[:, :, rows], keep))
    want = torch.cat(pieces, dim=2)
    q, k, v = qkv(n, seed=1)
    with torch.no_grad():
        got = attention(q, k, v, enc, backend=backend, positions=p, reach=reach)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the first token of every chunk sees itself alone: its output is its own value
    firsts = [int(r) for r in range(n) if r == 0 or chunk_of[r] != chunk_of[r - 1]]
    torch.testing.assert_close(got[:, :, firsts], v[:, :, firsts], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_chunk_option_restricts_any_encoding_and_leaves_noncausal_chunks_whole(backend):
    """``chunk=C`` on plain ALiBi equals ALiBi within chunks; non-causal, a query sees its whole chunk."""
    n, p = 30, torch.arange(30) + 5
    q, k, v = qkv(n, seed=2)
    alibi = make_encoding("alibi", num_heads=H)
    same_chunk = rearrange(p // 8, "n -> n 1") == rearrange(p // 8, "n -> 1 n")
    bias = alibi.bias(p, p).double()
    for causal in (True, False):
        keep = same_chunk & (causal_within(p, math.inf) if causal else True)
        scores = einsum(q.double(), k.double(), "b h i d, b h j d -> b h i j") / math.sqrt(D) + bias
        want = einsum(scores.masked_fill(~keep, float("-inf")).softmax(-1), v.double(), "b h i j, b h j d -> b h i d")
        with torch.no_grad():
            got = attention(q, k, v, alibi, backend=backend, positions=p, chunk=8, causal=causal)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_chunks_are_refused_where_they_have_no_meaning():
    q, k, v = qkv(4)
    with pytest.raises(PosencError, match="chunk must be a positive integer"):
        attention(q, k, v, chunk=0)
    with pytest.raises(PosencError, match="chunks of 8 positions"):
        attention(q, k, v, mix("irope"), chunk=4)
    with pytest.raises(PosencError, match="sink cache"):
        attention(q, k, v, mix("irope"), cache=SinkCache(window=8))
    torch.testing.assert_close(attention(q, k, v, mix("irope"), chunk=8), attention(q, k, v, mix("irope")))


# --------------------------------------------------------------------------------------------- Llama 4's temperature


def test_llama4_temperature_is_one_before_floor_scale_and_the_formula_after():
    """tau(p) = 1 + beta log(1 + floor((p + 1) / c)): exactly 1 while p + 1 < c, the formula in float64 elsewhere;
    at Llama 4's c = 8192, beta = 0.1 and at the scaled c = 128."""
    for c in (8192, 128, 8):
        p = torch.arange(0, 3 * c + 5)
        tau = attn_temperature(p, floor_scale=c, attn_scale=0.1)
        assert tau.dtype == torch.float64
        assert torch.equal(tau[: c - 1], torch.ones(c - 1, dtype=torch.float64))
        want = torch.tensor([1 + 0.1 * math.log(1 + math.floor((i + 1) / c)) for i in p.tolist()], dtype=torch.float64)
        torch.testing.assert_close(tau, want, rtol=0, atol=1e-15)
    assert float(attn_temperature(torch.tensor([8191]), floor_scale=8192, attn_scale=0.1)) == 1 + 0.1 * math.log(2)
    enc = make_encoding("nope-temp", train_len=512)
    assert (enc.floor_scale, enc.attn_scale) == (128, 0.1)
    assert math.isclose(float(enc.temperature(torch.tensor([511]))), 1 + 0.1 * math.log(5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos", sorted(POSITIONS))
def test_the_temperature_scales_the_queries_of_a_nope_layer_and_nothing_else(pos, backend):
    """NoPE attention with each query multiplied by tau(its position), keys untouched, over every key."""
    n = 40
    q, k, v = qkv(n, seed=3)
    p = POSITIONS[pos](n)
    tau = torch.tensor([1 + 0.1 * math.log(1 + math.floor((i + 1) / 8)) for i in p.tolist()], dtype=torch.float64)
    want = explicit(q.double() * rearrange(tau, "n -> n 1"), k, v, causal_within(p, math.inf))
    with torch.no_grad():
        got = attention(q, k, v, mix("nope-temp"), backend=backend, positions=p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, attention(q, k, v, None, positions=p))  # the temperature did something


# --------------------------------------------------------------------------------------------- the layers of a model


def test_each_layer_gets_the_documented_base_window_chunk_and_temperature():
    """At L = 512: windows, chunks and floor_scale 128; the global layer last in each group of four."""
    def layers(name, n_layer=8):
        enc = make_encoding(name, d_model=64, num_heads=2, train_len=512)
        return [enc.for_layer(i, n_layer) for i in range(n_layer)]

    for name, local_base, global_base in [("gemma3", 10_000.0, 1_000_000.0), ("rnope-swa", 10_000.0, None)]:
        for i, layer in enumerate(layers(name)):
            if i in (3, 7):
                assert layer.window is None and layer.chunk is None
                assert (layer.base == global_base) if global_base else type(layer) is pl.NoPE
            else:
                assert layer.window == 128 and layer.chunk is None and layer.base == local_base
    for i, layer in enumerate(layers("irope")):
        if i in (3, 7):
            assert type(layer) is pl.NoPETemperature and (layer.floor_scale, layer.attn_scale) == (128, 0.1)
            assert layer.window is None and layer.chunk is None
        else:
            assert isinstance(layer, pl.RoPE) and layer.chunk == 128 and layer.window is None and layer.base == 10_000.0
    assert all(type(layer) is pl.NoPETemperature and layer.window is None for layer in layers("nope-temp"))
    assert [layer.window for layer in layers("gemma3", 4)] == [128, 128, 128, None]
    six = make_encoding("gemma3", d_model=64, num_heads=2, train_len=512, sliding_window_pattern=6, sliding_window=64)
    assert [six.for_layer(i, 12).window for i in range(12)] == ([64] * 5 + [None]) * 2  # Gemma 3's own 5 : 1
    for name in MIXES:  # evaluated as trained: no RoPE strategies, not among the default encodings
        assert pl.ENCODINGS[name].variant_of in ("rope", "nope") and name not in PRIMARY
        assert not pl.ENCODINGS[name].has_strategies


def _gpt(name, n_layer=4, **options):
    torch.manual_seed(0)
    return GPT(GPTConfig(encoding=name, n_layer=n_layer, n_head=H, d_model=H * D, train_len=16,
                         encoding_options=options)).eval()


def test_a_mix_whose_span_covers_the_sequence_is_its_plain_counterpart():
    """With the window or chunk past the sequence (and no temperature), every mix is the model it restricts:
    rnope-swa and irope are rope-nope, gemma3 with one base is rope."""
    idx = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(1))
    pairs = [(("rnope-swa", {"sliding_window": 24}), ("rope-nope", {})),
             (("irope", {"attention_chunk_size": 64, "attn_scale": 0.0}), ("rope-nope", {})),
             (("gemma3", {"sliding_window": 24, "rope_theta": 10_000.0}), ("rope", {}))]
    with torch.no_grad():
        for (name, options), (plain, plain_options) in pairs:
            model, other = _gpt(name, **options), _gpt(plain, **plain_options)
            other.load_state_dict(model.state_dict())
            torch.testing.assert_close(model(idx), other(idx), rtol=1e-5, atol=1e-5)
            assert (model(idx[:, :20]) - _gpt(name)(idx[:, :20])).abs().max() > 1e-4  # the default span bites


@pytest.mark.parametrize("name", MIXES)
def test_cached_generation_equals_recomputing_everything_for_each_mix(name):
    """Four layers (the global one included), spans of 4 at L = 16, 6 prompt tokens and 30 new ones: the cache
    keeps every key and each layer masks by position, so a step sees exactly what a full pass sees."""
    model = _gpt(name)
    prompt = torch.randint(256, (2, 6), generator=torch.Generator().manual_seed(2))
    same_with_and_without_cache(model, prompt, 30)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MIXES)
def test_every_backend_and_the_cache_match_the_reference_at_every_layer(name, backend):
    """Each layer's encoding (local and global), fed 5 tokens then one at a time through a KVCache, and in one
    pass, through every backend, with and without the model's reach."""
    enc, n = mix(name), 21
    q, k, v = qkv(n, seed=4)
    for layer in {id(e): e for e in (enc.for_layer(i, 4) for i in range(4))}.values():
        for reach in (None, 6):
            with torch.no_grad():
                ref = attention(q, k, v, layer, backend="reference", reach=reach)
                torch.testing.assert_close(attention(q, k, v, layer, backend=backend, reach=reach), ref,
                                           rtol=1e-5, atol=1e-5)
                cache = KVCache()
                steps = [attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], layer, backend=backend, cache=cache,
                                   reach=reach)]
                steps += [attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], layer, backend=backend,
                                    cache=cache, reach=reach) for i in range(5, n)]
            torch.testing.assert_close(torch.cat(steps, dim=2), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MIXES)
def test_the_recomputed_attention_weights_are_each_layers_own(name):
    """The diagnostics' explicit weights, times the values, give each layer's attention (its window, chunk or
    temperature included); a local layer puts no weight outside its span."""
    from posenc_lab.lab.measure import diagnostics

    model, idx = _gpt(name), torch.randint(256, (2, 20), generator=torch.Generator().manual_seed(6))
    weights, inputs = diagnostics.attention_weights(model, idx), diagnostics._layer_inputs(model, idx)
    for i, (block, w, x) in enumerate(zip(model.blocks, weights, inputs)):
        layer = model.encoding.for_layer(i, 4)
        q, k, v = rearrange(block.attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=H)
        with torch.no_grad():
            want = attention(q, k, v, layer, backend="reference")
        torch.testing.assert_close(w @ v.detach(), want, rtol=1e-5, atol=1e-5)
        if layer.window is not None or layer.chunk is not None:
            p = torch.arange(20)
            outside = (p[:, None] - p[None] >= 4) if layer.window else (p[:, None] // 4 != p[None] // 4)
            assert (w[..., outside] == 0).all()


@pytest.mark.slow  # compiles a training step
@pytest.mark.parametrize("name", ["irope", "gemma3"])
def test_a_compiled_training_step_takes_the_same_loss_and_gradients(name):
    """Under ``torch.compile`` (which cannot read positions to cut chunks or windows) the masks cover every pair:
    the same loss and gradients as the eager step."""
    torch._dynamo.reset()
    model = _gpt(name).train()
    idx = torch.randint(256, (2, 21), generator=torch.Generator().manual_seed(5))
    results = []
    for loss_fn in (model.loss, torch.compile(model.loss, backend="eager")):
        model.zero_grad()
        loss = loss_fn(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_bad_spans_are_one_line_errors():
    for name, options, match in [("gemma3", {"sliding_window": 0}, "sliding_window"),
                                 ("rnope-swa", {"sliding_window": 2.5}, "sliding_window"),
                                 ("irope", {"attention_chunk_size": -1}, "attention_chunk_size"),
                                 ("irope", {"no_rope_layer_interval": 0}, "interval"),
                                 ("nope-temp", {"floor_scale": 0}, "floor_scale"),
                                 ("nope-temp", {"attn_scale": -0.1}, "attn_scale")]:
        with pytest.raises(PosencError, match=match):
            mix(name, **options)


@pytest.mark.parametrize("name", ["gemma3", "irope", "rnope-swa"])  # the three with a local span
def test_a_model_shallower_than_the_pattern_gets_its_last_layer_global(name):
    """Every 4th layer global would leave a 2-layer model local in every layer, no mix at all: its last layer is
    the global one, as the pattern option set to the depth makes it; from 4 layers on the rule is the paper's."""
    option = "no_rope_layer_interval" if name == "irope" else "sliding_window_pattern"
    for n_layer, pattern in ((1, None), (2, None), (3, None), (2, 2), (4, None), (8, None)):
        model = _gpt(name, n_layer=n_layer, **({option: pattern} if pattern else {}))
        kinds = ["global" if model.encoding.for_layer(i, n_layer) is model.encoding.global_layer else "local"
                 for i in range(n_layer)]
        expected = {1: ["global"], 2: ["local", "global"], 3: ["local", "local", "global"],
                    4: ["local"] * 3 + ["global"], 8: (["local"] * 3 + ["global"]) * 2}[n_layer]
        assert kinds == expected, (n_layer, pattern, kinds)
    local = _gpt(name, n_layer=2).encoding
    assert (local.window or local.chunk) == 4 and local.global_layer.window is None  # L / 4 at L = 16
    with pytest.raises(PosencError, match=f"{option} must be a positive integer"):
        _gpt(name, n_layer=2, **{option: 0})
