"""Inputs as Hugging Face hands them: ``position_ids`` of one row for the whole batch, a padding mask (its
``attention_mask``), and ALiBi on a subset of the heads."""

import pytest
import torch

import posenc_lab as pl
from posenc_lab import ENCODINGS, KVCache, PosencError, SinkCache, attention, bias, make_encoding, rope

H, HK, D, L = 4, 2, 8, 32
BACKENDS_HERE = ["reference", "sdpa"] + (["flex"] if pl.backends.flex_available(torch.device("cpu")) else [])


def _encoding(name, **options):
    torch.manual_seed(0)
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L if name != "learned" else 64, **options)
    return enc.eval()


def _qkv(b=3, n=7, heads=H, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, n, D, generator=g), torch.randn(b, kv_heads, n, D, generator=g),
            torch.randn(b, kv_heads, n, D, generator=g))


# --------------------------------------------------------------------------------------------- position_ids (1, n)


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_positions_of_one_row_serve_every_row_of_the_batch(name):
    """Hugging Face passes ``position_ids`` of shape ``(1, n)`` for a batch of ``b``: the same as positions ``(n,)``,
    in attention, in the rotation and in the embedding."""
    enc = _encoding(name)
    q, k, v = _qkv()
    positions = torch.arange(5, 12)
    with torch.no_grad():
        x = torch.randn(3, 7, H * D)
        inputs = {"decay": enc.decay(x), "householder": enc.householder(x)}  # FoX's, PaTH's; None for the others
        for backend in ("reference", "sdpa"):
            torch.testing.assert_close(attention(q, k, v, enc, backend=backend, positions=positions[None], **inputs),
                                       attention(q, k, v, enc, backend=backend, positions=positions, **inputs))
        for one, every in zip(enc.rotate(q, k, positions[None]), enc.rotate(q, k, positions)):
            torch.testing.assert_close(one, every)
        x = torch.randn(3, 7, H * D)
        torch.testing.assert_close(enc.embed(x, positions[None]), enc.embed(x, positions))


@pytest.mark.parametrize("scaling", ["yarn", "longrope", "dynamic-ntk"])
def test_one_row_of_positions_with_a_length_following_rope(scaling):
    options = {"longrope": {"short_factor": [1.0] * 4, "long_factor": [3.0] * 4, "factor": 4.0},
               "dynamic-ntk": {"dynamic": "sequence"}}.get(scaling, {})
    enc = make_encoding("rope", head_dim=D, train_len=4, scaling=scaling, **options)
    q, k, _ = _qkv()
    for one, every in zip(enc.rotate(q, k, torch.arange(7)[None]), enc.rotate(q, k, torch.arange(7))):
        torch.testing.assert_close(one, every)
    freqs = rope.inv_freq(D)
    torch.testing.assert_close(rope.apply_rope(q, torch.arange(7)[None], freqs), rope.apply_rope(q, torch.arange(7), freqs))


def test_one_row_of_positions_with_a_cache():
    enc = _encoding("rope")
    q, k, v = _qkv()
    cache = KVCache()
    first = attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], enc, cache=cache, positions=torch.arange(4)[None])
    second = attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], enc, cache=cache, positions=torch.arange(4, 7)[None])
    torch.testing.assert_close(torch.cat([first, second], dim=2), attention(q, k, v, enc, backend="sdpa"))


def test_a_batch_of_positions_of_another_size_is_refused():
    q, k, v = _qkv()
    with pytest.raises(PosencError, match=r"^positions must have shape \(7,\) or \(3, 7\) \(or \(1, 7\)"):
        attention(q, k, v, positions=torch.zeros(2, 7, dtype=torch.long))


# --------------------------------------------------------------------------------------------- a padding mask

# row 0 padded on the left (two pads), row 1 on the right (two pads), row 2 not at all
REAL = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1] * 7], dtype=torch.bool)
PADDED_ENCODINGS = ["nope", "rope", "alibi", "t5", "cope"]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("name", PADDED_ENCODINGS)
def test_padded_keys_get_zero_weight_on_every_backend(name, backend):
    """Grouped-query attention (2 key heads for 4 query heads) with a padding mask: every backend as the reference;
    the padded keys and values can be anything; a row without padding is as without a mask."""
    enc = _encoding(name)
    q, k, v = _qkv(kv_heads=HK)
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference", real_keys=REAL)
        out = attention(q, k, v, enc, backend=backend, real_keys=REAL)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        noise = torch.randn_like(k) * 100 * ~REAL[:, None, :, None]
        moved = attention(q, k + noise, v + noise, enc, backend=backend, real_keys=REAL)
        sees_a_real_key = REAL.cumsum(-1) > 0  # b n: the query rows that see some real key
        for row in range(3):
            rows = sees_a_real_key[row]
            torch.testing.assert_close(moved[row][:, rows], out[row][:, rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[2], attention(q, k, v, enc, backend=backend)[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", PADDED_ENCODINGS)
def test_the_padded_reference_is_attention_over_the_real_tokens_alone(name):
    """Left padding: the real queries attend as the real tokens alone would, at their own positions; the padded
    queries, which see no real key, get zeros. Right padding: the real queries are the unpadded prefix's."""
    enc = _encoding(name)
    q, k, v = _qkv(kv_heads=HK)
    with torch.no_grad():
        out = attention(q, k, v, enc, backend="reference", real_keys=REAL)
        alone = attention(q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], enc, backend="reference", positions=torch.arange(2, 7))
        prefix = attention(q[1:2, :, :5], k[1:2, :, :5], v[1:2, :, :5], enc, backend="reference")
    torch.testing.assert_close(out[0, :, 2:], alone[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    torch.testing.assert_close(out[1, :, :5], prefix[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_left_padding_with_hugging_faces_position_ids_and_a_bias(backend):
    """Hugging Face's left padding: ``position_ids = cumsum(attention_mask) - 1`` (pads at 1), rows of their own;
    ALiBi reads each row's positions, and each real token sees the real ones before it."""
    enc = _encoding("alibi")
    q, k, v = _qkv(kv_heads=HK)
    positions = (REAL.long().cumsum(-1) - 1).clamp(min=0)
    positions = positions.masked_fill(~REAL, 1)
    with torch.no_grad():
        out = attention(q, k, v, enc, backend=backend, positions=positions, real_keys=REAL)
        alone = attention(q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], enc, backend="reference")
    torch.testing.assert_close(out[0, :, 2:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("span", [{"reach": 3}, {"chunk": 4}])
def test_a_padding_mask_with_a_window_or_chunks(backend, span):
    enc = _encoding("rope")
    q, k, v = _qkv(kv_heads=HK)
    ref = attention(q, k, v, enc, backend="reference", real_keys=REAL, **span)
    torch.testing.assert_close(attention(q, k, v, enc, backend=backend, real_keys=REAL, **span), ref, rtol=1e-5,
                               atol=1e-5)
    plain = attention(q, k, v, enc, backend="reference", **span)
    torch.testing.assert_close(ref[2], plain[2])  # the unpadded row


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_a_padding_mask_with_fox_decays(backend):
    enc = _encoding("fox")
    q, k, v = _qkv()
    with torch.no_grad():
        decay = enc.decay(torch.randn(3, 7, H * D))
        ref = attention(q, k, v, enc, backend="reference", decay=decay, real_keys=REAL)
        out = attention(q, k, v, enc, backend=backend, decay=decay, real_keys=REAL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_decoding_a_padded_batch_with_a_cache_is_attention_over_the_whole(name):
    """A padded prompt, then one token at a time with a :class:`KVCache`: ``real_keys`` covers the cached keys and
    the new ones, and the outputs are those of one pass over the whole padded sequence."""
    enc = _encoding(name)
    q, k, v = _qkv(kv_heads=HK)
    whole = attention(q, k, v, enc, backend="reference", real_keys=REAL)
    cache = KVCache()
    steps = [attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], enc, cache=cache, real_keys=REAL[:, :4])]
    for t in range(4, 7):
        steps.append(attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], enc, cache=cache,
                               real_keys=REAL[:, :t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_a_bad_padding_mask_is_refused_in_one_line():
    q, k, v = _qkv()
    for mask, match in ((REAL.long(), r"real_keys must be a bool tensor of shape \(3, 7\) .*got torch.int64 \(3, 7\) "
                                      r"\(Hugging Face's attention_mask: pass attention_mask.bool\(\)\)$"),
                        (REAL[:, :5], r"got torch.bool \(3, 5\)")):
        with pytest.raises(PosencError, match=match) as err:
            attention(q, k, v, real_keys=mask)
        assert "\n" not in str(err.value)
    cache = KVCache()
    attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache=cache)
    with pytest.raises(PosencError, match=r"shape \(3, 5\) \(batch, keys attended: cached and new\)"):
        attention(q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5], cache=cache, real_keys=REAL[:, :4])
    assert len(cache) == 4  # nothing appended by the refused call
    with pytest.raises(PosencError, match=r"^a sink cache drops tokens and renumbers the rest: it cannot follow a "
                                          r"padding mask \(real_keys\); decode a padded batch with a KVCache$"):
        attention(q, k, v, cache=SinkCache(window=4, sinks=1), real_keys=REAL)


def test_a_length_following_rope_with_a_padding_mask_still_refuses_a_cache():
    enc = make_encoding("rope", head_dim=D, train_len=4, scaling="yarn")
    q, k, v = _qkv()
    with pytest.raises(PosencError, match="a key/value cache cannot serve"):
        attention(q, k, v, enc, cache=KVCache(), real_keys=REAL)


# --------------------------------------------------------------------------------------------- ALiBi on some heads


def test_alibi_on_a_subset_of_heads_gives_the_first_heads_the_slopes_of_that_many():
    slopes = bias.partial_alibi_slopes(8, 3)
    torch.testing.assert_close(slopes[:3], bias.alibi_slopes(3))
    assert slopes[3:].tolist() == [0.0] * 5
    torch.testing.assert_close(bias.partial_alibi_slopes(8, 8), bias.alibi_slopes(8))
    enc = make_encoding("alibi", num_heads=8, alibi_heads=4)
    torch.testing.assert_close(enc.slopes, bias.partial_alibi_slopes(8, 4).float())
    table = pl.bias_tensor(enc, torch.arange(6))
    assert torch.equal(table[4:], torch.zeros_like(table[4:])) and (table[:4].sum((1, 2)) < 0).all()


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_heads_without_a_slope_attend_as_nope_and_the_others_as_alibi(backend):
    partial, nope = _encoding("alibi", alibi_heads=2), _encoding("nope")
    q, k, v = _qkv()
    with torch.no_grad():
        out = attention(q, k, v, partial, backend=backend)
        torch.testing.assert_close(out[:, 2:], attention(q, k, v, nope, backend="reference")[:, 2:], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(out[:, :2], attention(q[:, :2], k[:, :2], v[:, :2], pl.ALiBi(2), backend="reference"),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [0, 5, 2.0, True])
def test_a_bad_count_of_alibi_heads_is_refused(heads):
    with pytest.raises(PosencError, match=r"^alibi_heads must be an integer from 1 to the number of heads \(4\)"):
        pl.ALiBi(4, alibi_heads=heads)
