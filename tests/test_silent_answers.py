"""Four answers that used to come back wrong without a word: each is now right, or refused in one sentence that names
the fix (:class:`PosencError`), never a traceback from inside torch."""

import pytest
import torch

import posenc_lab as pl
from posenc_lab import ALiBi, T5, Fire, FoX, Kerple, KVCache, PosencError, RoPE, SinkCache, SSMax, attention, rope
from posenc_lab import scaled_inv_freq

BACKENDS_HERE = ["reference", "sdpa"] + (["flex"] if pl.backends.flex_available(torch.device("cpu")) else [])


def qkv(heads=4, n=16, d=16, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    return (torch.randn(1, heads, n, d, generator=g), torch.randn(1, kv_heads, n, d, generator=g),
            torch.randn(1, kv_heads, n, d, generator=g))


# --------------------------------------------------------------------------------------------- 1. compile reads max(positions)


@pytest.mark.parametrize("scaling,options", [
    ("yarn", {}), ("pi", {}), ("ntk", {}), ("llama3", {}), ("dynamic-ntk", {"dynamic": "sequence"}),
], ids=["yarn", "pi", "ntk", "llama3", "dynamic-ntk-sequence"])
def test_a_factor_that_follows_the_length_reads_the_last_position_under_compile(scaling, options):
    """Positions 1000 .. 1255 with ``factor=None``: the factor is ``(max(positions) + 1) / train_len`` compiled as in
    eager, not ``n / train_len`` (which, below the training length, is plain RoPE)."""
    enc = RoPE(64, train_len=512, scaling=scaling, **options)
    q, k, v = qkv(heads=2, n=256, d=64)
    pos = torch.arange(1000, 1256)
    eager = attention(q, k, v, enc, positions=pos)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, p: attention(q, k, v, enc, positions=p), backend="eager")(q, k, v, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(eager, attention(q, k, v, RoPE(64, train_len=512), positions=pos), atol=1e-2)


def test_a_factor_that_follows_the_length_reads_each_row_under_compile():
    enc = RoPE(32, train_len=64, scaling="yarn")
    q, k, v = (torch.randn(2, 2, 8, 32) for _ in range(3))
    pos = torch.stack([torch.arange(8), torch.arange(200, 208)])
    eager = attention(q, k, v, enc, positions=pos)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, p: attention(q, k, v, enc, positions=p), backend="eager")(q, k, v, pos)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_plain_and_fixed_factor_rope_still_compile_into_one_graph():
    """Only a factor read from the positions leaves the graph: plain RoPE and a fixed factor need no value."""
    q, k, v = qkv(heads=2, n=32, d=32)
    pos = torch.arange(100, 132)
    for enc in (RoPE(32, train_len=64), RoPE(32, train_len=64, scaling="yarn", factor=4.0)):
        torch._dynamo.reset()
        step = torch.compile(lambda q, k, v, p: attention(q, k, v, enc, positions=p), backend="eager", fullgraph=True)
        torch.testing.assert_close(step(q, k, v, pos), attention(q, k, v, enc, positions=pos), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- 2. head counts


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("make", [ALiBi, T5], ids=["alibi", "t5"])
def test_a_bias_built_for_one_head_refuses_eight_query_heads(make, backend):
    q, k, v = qkv(heads=8, kv_heads=1)
    with pytest.raises(PosencError, match=r"^\w+ was built for 1 head but the queries have 8: build it with num_heads=8$"):
        attention(q, k, v, make(num_heads=1), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("make", [ALiBi, T5, Kerple, Fire, lambda num_heads: SSMax(num_heads, train_len=64)],
                         ids=["alibi", "t5", "kerple", "fire", "ssmax"])
def test_any_head_count_that_differs_from_the_queries_is_one_sentence(make, backend):
    q, k, v = qkv(heads=8, kv_heads=2)
    with pytest.raises(PosencError, match=r"built for 4 heads but the queries have 8: build it with num_heads=8$"):
        attention(q, k, v, make(num_heads=4), backend=backend)
    with pytest.raises(PosencError, match="built for 4 heads but the queries have 8"):  # through a cache too
        attention(q, k, v, make(num_heads=4), backend=backend, cache=KVCache())


def test_a_decay_gate_built_for_other_heads_is_one_sentence():
    fox = FoX(2, 32)
    x = torch.randn(1, 16, 32)
    q, k, v = qkv(heads=8, kv_heads=2)
    with pytest.raises(PosencError, match="FoX was built for 2 heads but the queries have 8: build it with num_heads=8"):
        attention(q, k, v, fox, decay=fox.decay(x))


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("make", [ALiBi, T5], ids=["alibi", "t5"])
def test_grouped_query_attention_with_a_bias_of_the_query_heads_still_works(make, backend):
    torch.manual_seed(3)
    q, k, v = qkv(heads=8, kv_heads=1)
    enc = make(num_heads=8)
    with torch.no_grad():
        grouped = attention(q, k, v, enc, backend=backend)
        repeated = attention(q, pl.repeat_kv(k, 8), pl.repeat_kv(v, 8), enc, backend="reference")
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_keys_of_another_head_count_in_one_sentence():
    q, k, v = qkv(heads=4, kv_heads=2, n=4)
    cache = KVCache()
    attention(q, k, v, cache=cache)
    q1, k1, v1 = qkv(heads=4, kv_heads=4, n=1)
    with pytest.raises(PosencError, match="cache holds keys and values of 2 heads .* the new ones have 4"):
        attention(q1, k1, v1, cache=cache)


# --------------------------------------------------------------------------------------------- 3. RoPE base above 1


@pytest.mark.parametrize("scaling", sorted(rope.ROPE_SCALINGS))
@pytest.mark.parametrize("base", [0.5, 1, 1.0, 0, -2.0])
def test_every_scaling_refuses_a_base_not_above_one_naming_it(scaling, base):
    factor = None if scaling == "dynamic-ntk" else 2
    with pytest.raises(PosencError, match=rf"^the RoPE base must be a number above 1 .*, got {base!r}$"):
        scaled_inv_freq(scaling, 64, base=base, train_len=512, factor=factor, seq_len=1024)
    with pytest.raises(PosencError, match=rf"got {base!r}$"):
        RoPE(64, train_len=512, base=base, scaling=scaling)


def test_pi_with_base_half_no_longer_returns_rising_frequencies():
    with pytest.raises(PosencError, match="above 1"):
        scaled_inv_freq("pi", 64, base=0.5, train_len=512, factor=2)
    freqs, _ = scaled_inv_freq("pi", 64, base=10000.0, train_len=512, factor=2)
    assert (freqs[1:] < freqs[:-1]).all()


def test_position_wise_dynamic_ntk_refuses_a_base_not_above_one():
    with pytest.raises(PosencError, match=r"got 0\.5$"):
        rope.dynamic_ntk_angles(torch.arange(8), 64, base=0.5, train_len=4)


# --------------------------------------------------------------------------------------------- 4. a cache's positions


def cached(n=10, heads=2, d=16, encoding=None, cache=None):
    cache = KVCache() if cache is None else cache
    attention(*qkv(heads=heads, n=n, d=d), encoding, cache=cache)
    return cache


@pytest.mark.parametrize("new", [[5], [9], [10, 10], [12, 11]], ids=["earlier", "repeated", "twice", "backwards"])
def test_a_cache_refuses_positions_that_do_not_continue_it(new):
    cache = cached()
    with pytest.raises(PosencError, match=r"^a KVCache holds positions up to 9: new positions must .*positions=None"):
        attention(*qkv(heads=2, n=len(new), d=16, seed=1), cache=cache, positions=torch.tensor(new))
    assert len(cache) == 10 and int(cache.positions[-1]) == 9  # nothing appended


def test_a_cache_refuses_a_prompt_that_is_not_increasing():
    with pytest.raises(PosencError, match="increasing"):
        attention(*qkv(heads=2, n=3, d=16), cache=KVCache(), positions=torch.tensor([0, 2, 1]))


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_a_cache_fed_consecutive_or_gapped_positions_matches_one_pass(name):
    """Positions that continue the cache, with or without gaps, attend as one pass over the same positions."""
    enc = pl.make_encoding(name, head_dim=16, num_heads=2, train_len=64)
    q, k, v = qkv(heads=2, n=12, d=16)
    for pos in (torch.arange(12), torch.arange(0, 36, 3)):
        cache = KVCache()
        with torch.no_grad():
            steps = [attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], enc, cache=cache, positions=pos[:8])]
            steps += [attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], enc, cache=cache,
                                positions=pos[i:i + 1]) for i in range(8, 12)]
            whole = attention(q, k, v, enc, positions=pos, backend="reference")
        torch.testing.assert_close(torch.cat(steps, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_a_sink_cache_refuses_positions_other_than_its_slots():
    """A sink cache numbers its tokens by their slots: positions it would ignore are refused, its slots accepted."""
    cache = SinkCache(window=4, sinks=1)
    attention(*qkv(heads=2, n=3, d=16), cache=cache, positions=torch.arange(3))
    with pytest.raises(PosencError, match="slots"):
        attention(*qkv(heads=2, n=1, d=16), cache=cache, positions=torch.tensor([100]))
    attention(*qkv(heads=2, n=1, d=16), cache=cache, positions=torch.tensor([3]))


@pytest.mark.skipif("flex" not in BACKENDS_HERE, reason="FlexAttention is not available")
@pytest.mark.parametrize("name", ["t5", "kerple"])
def test_a_distance_table_bias_under_compile_reads_spread_out_positions(name):
    """FlexAttention under compile sized the per-distance table as if the positions were ``0 .. n-1``: every third
    position fell off its end. The bias is now gathered pair by pair there, as the ``sdpa`` backend does."""
    enc = pl.make_encoding(name, num_heads=2)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    q, k, v = qkv(heads=2, n=64)
    pos = torch.arange(0, 192, 3)
    eager = attention(q, k, v, enc, positions=pos, backend="flex")
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, p: attention(q, k, v, enc, positions=p, backend="flex"), backend="eager")
    torch.testing.assert_close(step(q, k, v, pos), eager, rtol=1e-5, atol=1e-5)
