"""What 2024-26 added: Scalable-Softmax (Nakanishi 2025) and FoPE (Hua et al. 2024), each checked against a float64
computation written from the paper's equations, independently of the package's code."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc_lab as pl
from posenc_lab import KVCache, PosencError, attention, make_encoding
from posenc_lab.encodings import PRIMARY, strategies_of
from posenc_lab.encodings.fourier import floor_frequency
from posenc_lab.encodings.scaled import ssmax_factor
from posenc_lab.model import GPT, GPTConfig

B, H, D, L = 2, 4, 16, 32
BACKENDS = ["reference", "sdpa"] + (["flex"] if pl.backends.flex_available(torch.device("cpu")) else [])
POSITIONS = {"arange": lambda n: torch.arange(n), "offset": lambda n: torch.arange(n) + 1000}


def qkv(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(3)]


def rope_by_hand(x, positions, base=10000.0):
    """RoPE as complex numbers: pair ``j = (x[j], x[j + d/2])`` times ``e^(i m theta_j)``, float64."""
    d = x.shape[-1]
    theta = base ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones((), dtype=torch.float64), positions[:, None] * theta)  # e^(i m theta_j): m j
    turned = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * turn
    return torch.cat([turned.real, turned.imag], dim=-1)


def causal_softmax_attention(logits, v):
    """``softmax(logits) v`` over the keys ``j <= i``, float64."""
    n = logits.shape[-1]
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1) @ v


# --------------------------------------------------------------------------------------------- Scalable-Softmax


def ssmax(name, **options):
    return make_encoding(name, d_model=H * D, num_heads=H, train_len=L, **options)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 100_000), name=st.sampled_from(["ssmax", "ssmax-rope"]))
def test_ssmax_logits_equal_plain_at_n_equal_e_to_one_over_s(n, name):
    """With ``s = 1 / log n`` the factor ``s log n`` is 1: the query at position ``n - 1`` (which sees ``n`` keys) has
    the base encoding's logits; the query before it, fewer keys, smaller ones (s is a float32 parameter)."""
    enc = ssmax(name)
    with torch.no_grad():
        enc.s.fill_(1 / math.log(n))
    positions = torch.tensor([n - 2, n - 1])
    q, k, _ = qkv(2)
    scaled = torch.einsum("bhid,bhjd->bhij", *enc.rotate(q, k, positions))
    plain = torch.einsum("bhid,bhjd->bhij", *enc.inner.rotate(q, k, positions))
    torch.testing.assert_close(scaled[:, :, 1], plain[:, :, 1], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(scaled[:, :, 0], plain[:, :, 0] * math.log(n - 1) / math.log(n), rtol=1e-6, atol=1e-9)


def test_ssmax_starts_as_plain_softmax_at_the_training_length():
    """``s`` starts at ``1 / log L``: the factor is 1 for the query that sees ``L`` keys, below 1 before, above past."""
    enc = ssmax("ssmax")
    factor = ssmax_factor(enc.s.detach(), torch.tensor([L // 2, L - 1, 4 * L]))
    torch.testing.assert_close(factor[:, 1], torch.ones(H))
    assert (factor[:, 0] < 1).all() and (factor[:, 2] > 1).all()


def test_ssmax_keeps_the_top_weight_from_fading_as_n_grows():
    """The paper's Figure 1: one logit of 3 among logits of -2. Softmax's top weight fades towards 0 as ``n`` grows;
    SSMax's (``s = 0.43``) stays near 1."""
    plain, scaled = [], []
    for n in (10, 1_000, 100_000):
        z = torch.full((n,), -2.0, dtype=torch.float64)
        z[-1] = 3.0
        factor = ssmax_factor(torch.tensor([0.43], dtype=torch.float64), torch.tensor([n - 1]))[0, 0]
        plain.append(z.softmax(-1)[-1].item())
        scaled.append((factor * z).softmax(-1)[-1].item())
    assert plain[0] > plain[1] > plain[2] and plain[2] < 0.01
    assert min(scaled) > 0.9


@pytest.mark.parametrize("pos", sorted(POSITIONS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["ssmax", "ssmax-rope"])
def test_ssmax_attention_is_softmax_of_s_log_n_times_z_on_every_backend(name, backend, pos):
    """``softmax((s_h log n) z) v`` with ``z = q_i . k_j / sqrt(d)`` (RoPE-rotated for ``ssmax-rope``) and
    ``n = p_i + 1``, the keys the query at position ``p_i`` sees, written out in float64."""
    enc, n = ssmax(name), 40
    with torch.no_grad():
        enc.s.copy_(torch.tensor([0.2, 0.5, 1.0, 1.7]))
    q, k, v = qkv(n)
    p = POSITIONS[pos](n)
    if name == "ssmax-rope":
        qr, kr = rope_by_hand(q, p.double()), rope_by_hand(k, p.double())
    else:
        qr, kr = q, k
    z = qr @ kr.transpose(-1, -2) / math.sqrt(D)  # b h i j
    scale = enc.s.detach().double()[:, None, None] * torch.log(p.double() + 1)[:, None]  # h i 1
    want = causal_softmax_attention(scale * z, v)
    with torch.no_grad():
        got = attention(q.float(), k.float(), v.float(), enc, backend=backend, positions=p)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def keys_seen_by_hand(p, reach=None, chunk=None):
    """How many keys ``j <= p_i`` the query at ``p_i`` may attend to, counted one by one over the positions."""
    counts = []
    for i, pi in enumerate(p.tolist()):
        counts.append(sum(1 for pj in p[: i + 1].tolist()
                          if (reach is None or pi - pj < reach) and (chunk is None or pi // chunk == pj // chunk)))
    return torch.tensor(counts, dtype=torch.float64)


@pytest.mark.parametrize("reach, chunk", [(8, None), (None, 16), (5, 16), (100, None)])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["ssmax", "ssmax-rope"])
def test_ssmax_counts_only_the_keys_a_window_or_chunk_leaves(name, backend, reach, chunk):
    """Under a sliding window (``reach=W``) or chunks the query sees fewer keys than ``p + 1``; ``n`` in ``s log n``
    is the number it sees, counted by hand, and the softmax runs over those keys alone, written out in float64."""
    enc, n = ssmax(name), 40
    with torch.no_grad():
        enc.s.copy_(torch.tensor([0.2, 0.5, 1.0, 1.7]))
    q, k, v = qkv(n)
    p = torch.arange(n)
    qr, kr = (rope_by_hand(q, p.double()), rope_by_hand(k, p.double())) if name == "ssmax-rope" else (q, k)
    z = qr @ kr.transpose(-1, -2) / math.sqrt(D)
    seen = keys_seen_by_hand(p, reach, chunk)
    scale = enc.s.detach().double()[:, None, None] * torch.log(seen)[:, None]
    i, j = p[:, None], p[None, :]
    hidden = (j > i) | ((i - j >= reach) if reach else False) | ((i // chunk != j // chunk) if chunk else False)
    want = (scale * z).masked_fill(hidden, float("-inf")).softmax(-1) @ v
    with torch.no_grad():
        got = attention(q.float(), k.float(), v.float(), enc, backend=backend, reach=reach, chunk=chunk)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_ssmax_under_a_window_through_a_cache_and_a_model_equals_one_pass():
    """The count reaches the factor through every path: a key/value cache with ``reach``, and a model's
    ``forward(reach=W)``, whose queries past ``W`` are scaled by ``s log W`` (not ``s log(p + 1)``)."""
    enc, n, w = ssmax("ssmax-rope"), 3 * L, L
    q, k, v = qkv(n, dtype=torch.float32)
    cache = KVCache()
    with torch.no_grad():
        whole = attention(q, k, v, enc, backend="sdpa", reach=w)
        parts = [attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], enc, cache=cache, reach=w)
                 for i in range(n)]
        uncounted = attention(q, k, v, enc.inner, backend="sdpa", reach=w)
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)
    factor = ssmax_factor(enc.s.detach(), torch.arange(n), reach=w)
    torch.testing.assert_close(factor[:, w:], factor[:, w - 1:w].expand(H, n - w))
    assert not torch.allclose(whole, uncounted)
    # one layer of SSMax on NoPE: the last query's logits read only the keys it sees and how many there are, so with
    # reach=W it attends as the same model run on its last W bytes alone, where that query sees W keys causally
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="ssmax", n_layer=1, n_head=H, d_model=H * D, train_len=L, vocab_size=32)).eval()
    with torch.no_grad():
        model.encoding.s.copy_(torch.tensor([0.2, 0.5, 1.0, 1.7]))
        idx = torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(1))
        windowed, full, last_w = model(idx, reach=w), model(idx), model(idx[:, -w:])
    torch.testing.assert_close(windowed[:, -1], last_w[:, -1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(windowed[:, -1], full[:, -1], atol=1e-3)


@pytest.mark.parametrize("name", ["ssmax", "ssmax-rope"])
def test_ssmax_through_a_cache_token_by_token_equals_one_pass(name):
    """The factor belongs to the query: keys enter the cache as the base encoding rotates them, unscaled."""
    enc, n = ssmax(name), 3 * L
    q, k, v = qkv(n, dtype=torch.float32)
    cache = KVCache()
    with torch.no_grad():
        whole = attention(q, k, v, enc, backend="sdpa")
        parts = [attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], enc, cache=cache) for i in range(n)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ssmax", "ssmax-rope"])
def test_ssmax_s_is_learned_one_per_head(name):
    enc = ssmax(name)
    q, k, v = qkv(L, dtype=torch.float32)
    attention(q, k, v, enc, backend="sdpa").pow(2).sum().backward()
    assert enc.s.shape == (H,) and (enc.s.grad.abs() > 0).all()


def test_ssmax_refuses_non_causal_attention_in_one_sentence():
    q, k, v = qkv(8, dtype=torch.float32)
    with pytest.raises(PosencError, match="no non-causal form .*p \\+ 1"):
        attention(q, k, v, ssmax("ssmax"), causal=False)


def test_ssmax_variants_are_registered_next_to_their_base_and_evaluated_as_trained():
    for name, parent in [("ssmax", "nope"), ("ssmax-rope", "rope"), ("fope", "rope")]:
        assert pl.ENCODINGS[name].variant_of == parent and name not in PRIMARY
        assert strategies_of(name, ("none", "pi", "yarn")) == ("-",)
    assert isinstance(ssmax("ssmax-rope").inner, pl.RoPE) and isinstance(ssmax("ssmax").inner, pl.NoPE)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("name", ["ssmax", "ssmax-rope", "fope"])
def test_grouped_query_attention_equals_repeated_keys_and_values(name, kv_heads):
    """SSMax scales the queries only and FoPE's series is shared by the heads: grouped keys are served as they are."""
    torch.manual_seed(1)
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L)
    q, k, v = torch.randn(2, H, 10, D), torch.randn(2, kv_heads, 10, D), torch.randn(2, kv_heads, 10, D)
    with torch.no_grad():
        grouped = attention(q, k, v, enc, backend="sdpa")
        repeated = attention(q, pl.repeat_kv(k, H), pl.repeat_kv(v, H), enc, backend="sdpa")
    torch.testing.assert_close(grouped, repeated)


# --------------------------------------------------------------------------------------------- FoPE


def fope(train_len=L, **options):
    return make_encoding("fope", d_model=H * D, num_heads=H, train_len=train_len, **options)


@settings(max_examples=25, deadline=None)
@given(pairs=st.integers(1, 32), train_len=st.integers(2, 4096), start=st.integers(0, 10_000),
       layout=st.sampled_from(["half", "interleaved"]))
def test_fope_without_extra_coefficients_or_clipping_is_rope(pairs, train_len, start, layout):
    d = 2 * pairs
    enc = make_encoding("fope", head_dim=d, train_len=train_len, sigma=0.0, clip=False, layout=layout)
    plain = make_encoding("rope", head_dim=d, train_len=train_len, layout=layout)
    x = torch.randn(1, 2, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(pairs))
    positions = torch.arange(start, start + 5)
    torch.testing.assert_close(enc.rotate_one(x, positions, "q"), plain.rotate_one(x, positions, "q"))


@settings(max_examples=25, deadline=None)
@given(train_len=st.integers(2, 4096), sigma=st.floats(0.0, 2.0), start=st.integers(0, 10_000))
def test_fope_clipped_pairs_are_nopes_identity_and_the_kept_ones_turn_within_training(train_len, sigma, start):
    """A pair whose frequency is below ``2 pi / L`` is left as it is; every kept pair completes a turn in ``L``."""
    enc = make_encoding("fope", head_dim=D, train_len=train_len, sigma=sigma)
    theta = 10000.0 ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    kept = int((2 * math.pi / theta <= train_len).sum())
    assert enc.kept_pairs == kept and (theta[:kept] >= floor_frequency(train_len)).all()
    x = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = enc.rotate_one(x, torch.arange(start, start + 3), "k")
    clipped = [j for j in range(D // 2) if j >= kept] + [D // 2 + j for j in range(D // 2) if j >= kept]
    torch.testing.assert_close(y[:, clipped], x[:, clipped], rtol=0, atol=0)


def test_fope_with_clipping_and_no_extra_coefficients_is_p_rope_with_the_kept_pairs():
    enc = make_encoding("fope", head_dim=64, train_len=512, sigma=0.0)
    p_rope = make_encoding("rope", head_dim=64, train_len=512, kept_pairs=enc.kept_pairs)
    assert 0 < enc.kept_pairs < 32
    x, positions = torch.randn(2, 4, 9, 64, dtype=torch.float64), torch.arange(700, 709)
    torch.testing.assert_close(enc.rotate_one(x, positions, "q"), p_rope.rotate_one(x, positions, "q"))


def fope_by_hand(x, positions, enc):
    """The paper's series, float64: pair ``j < K`` times
    ``sum_k A[k, j] cos(theta_k m) + i sum_k B[k, j] sin(theta_k m)`` over the kept frequencies ``theta_k``
    (``theta_k >= 2 pi / L``); the clipped pairs unchanged."""
    d = x.shape[-1]
    theta = 10000.0 ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    kept = theta[theta >= 2 * math.pi / enc.train_len]
    a, b = enc.cos_coef.double(), enc.sin_coef.double()
    m = positions.double()[:, None, None]  # m 1 1
    real = (a * torch.cos(m * kept[:, None])).sum(1)  # m j: sum over k
    imag = (b * torch.sin(m * kept[:, None])).sum(1)
    z = torch.ones(len(positions), d // 2, dtype=torch.complex128)
    z[:, : len(kept)] = torch.complex(real, imag)
    turned = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * z
    return torch.cat([turned.real, turned.imag], dim=-1)


@pytest.mark.parametrize("pos", sorted(POSITIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fope_attention_is_the_papers_fourier_series_on_every_backend(backend, pos):
    torch.manual_seed(0)
    enc, n = fope(train_len=512, sigma=0.5), 40
    assert enc.kept_pairs == 4 and (enc.cos_coef != torch.eye(enc.kept_pairs)).all()
    q, k, v = qkv(n)
    p = POSITIONS[pos](n)
    z = fope_by_hand(q, p, enc) @ fope_by_hand(k, p, enc).transpose(-1, -2) / math.sqrt(D)
    want = causal_softmax_attention(z, v)
    with torch.no_grad():
        got = attention(q.float(), k.float(), v.float(), enc, backend=backend, positions=p)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_fope_scores_are_not_a_function_of_distance_alone_once_the_series_has_extra_terms():
    """RoPE's scores shift with the positions; FoPE's extra coefficients break that (the paper's trade)."""
    torch.manual_seed(0)
    enc = fope(sigma=0.5)
    q, k, _ = qkv(6)
    scores = [torch.einsum("bhid,bhjd->bhij", *enc.rotate(q, k, torch.arange(6) + shift)) for shift in (0, 37)]
    assert (scores[0] - scores[1]).abs().max() > 1e-3


def test_fope_series_is_saved_with_the_model():
    from posenc_lab.model import GPT, GPTConfig

    config = GPTConfig(encoding="fope", n_layer=1, n_head=H, d_model=H * D, train_len=L)
    torch.manual_seed(0)
    first = GPT(config)
    torch.manual_seed(1)
    second = GPT(config)
    assert not torch.equal(first.encoding.cos_coef, second.encoding.cos_coef)
    second.load_state_dict(first.state_dict())
    x = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        torch.testing.assert_close(second(x), first(x))


@pytest.mark.parametrize("options,match", [({"sigma": -1.0}, "sigma"), ({"clip": "yes"}, "clip"),
                                           ({"layout": "paired"}, "layout")])
def test_fope_bad_options_are_one_line_errors(options, match):
    with pytest.raises(PosencError, match=match):
        fope(**options)


def test_the_power_the_declared_analysis_plans_for_the_methods_past_the_softmax():
    """book/analysis.md plans the past-softmax runs with the power three seeds had in recent-cpu: the median over its
    methods of the smallest ratio a paired t-test resolves with 80 % power, recomputed here with statsmodels."""
    import numpy as np
    from statsmodels.stats.power import TTestPower

    from posenc_lab.lab import results
    from posenc_lab.lab.verdicts.statistics import frame, label

    recent, _, config = results.load("recent-cpu")
    df = frame(recent + [r for r in results.rows("article-cpu") if label(r) in ("alibi", "rope/yarn")])
    effect = TTestPower().solve_power(nobs=3, alpha=0.05, power=0.8)
    loss = df.set_index(["label", "eval_mode", "eval_len", "seed"])["loss"]

    def median_ratio(base, mode, length):
        sds = [(loss[(m, mode, length)] - loss[(base, mode, length)]).std(ddof=1) for m in config["spec"]["encodings"]]
        return float(np.exp(effect * np.median(sds)))

    alibi = [median_ratio("alibi", mode, n) for mode in ("nonoverlapping", "sliding") for n in (512, 1024, 2048)]
    alibi.append(median_ratio("alibi", "nonoverlapping", 8192))
    assert 1.055 <= min(alibi) and max(alibi) < 1.085  # "about 1.06 to 1.08"
    assert round(median_ratio("rope/yarn", "sliding", 512), 2) == 1.02
    assert round(median_ratio("rope/yarn", "nonoverlapping", 8192), 1) == 1.3
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "book" / "analysis.md").read_text().split())
    assert "a ratio of about 1.06 to 1.08 against ALiBi" in text and "1.02 at 512 and 1.3 at 8,192" in text
