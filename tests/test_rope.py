"""RoPE: each formula of chapters 3 and 4 against an independent computation or a property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc_lab import PosencError, make_encoding, rope, xpos

DIM = 16


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def score(q, k, m, n, freqs, layout="half"):
    qm = rope.apply_rope(q[None], torch.tensor([m]), freqs, layout=layout)[0]
    kn = rope.apply_rope(k[None], torch.tensor([n]), freqs, layout=layout)[0]
    return float(qm @ kn)


def test_inv_freq_is_the_papers_formula():
    expected = [10000.0 ** (-2 * i / DIM) for i in range(DIM // 2)]
    assert rope.inv_freq(DIM).tolist() == pytest.approx(expected, rel=1e-15)
    assert rope.inv_freq(8, base=500.0)[1].item() == pytest.approx(500.0 ** -0.25)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 50_000), n=st.integers(0, 50_000), shift=st.integers(-10_000, 10_000),
       seed=st.integers(0, 1000), layout=st.sampled_from(rope.LAYOUTS))
def test_rope_score_depends_only_on_relative_position(m, n, shift, seed, layout):
    q, k = rand(DIM, seed=seed), rand(DIM, seed=seed + 1)
    freqs = rope.inv_freq(DIM)
    shift = max(shift, -min(m, n))
    assert score(q, k, m, n, freqs, layout) == pytest.approx(score(q, k, m + shift, n + shift, freqs, layout), abs=1e-9)


def test_rope_is_complex_multiplication_by_unit_phasor():
    # independent computation: pair i is the complex number x[i] + 1j x[i + d/2] (half layout),
    # multiplied by exp(1j m theta_i)
    x, positions, freqs = rand(5, DIM), torch.arange(5) * 37, rope.inv_freq(DIM)
    z = torch.complex(x[:, : DIM // 2], x[:, DIM // 2 :]) * torch.polar(torch.ones(5, DIM // 2, dtype=torch.float64), positions[:, None] * freqs)
    got = rope.apply_rope(x, positions, freqs, layout="half")
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", rope.LAYOUTS)
def test_rotation_preserves_norms(layout):
    x = rand(3, 7, DIM)
    y = rope.apply_rope(x, torch.arange(7) * 1000, rope.inv_freq(DIM), layout=layout)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


def test_half_and_interleaved_layouts_agree_once_dimensions_are_permuted():
    # interleaved position 2i holds half position i, interleaved 2i+1 holds half position i + d/2
    perm = torch.tensor([j for i in range(DIM // 2) for j in (i, i + DIM // 2)])
    q, k, positions, freqs = rand(6, DIM), rand(6, DIM, seed=1), torch.arange(6) * 11, rope.inv_freq(DIM)
    qh, kh = (rope.apply_rope(t, positions, freqs, layout="half") for t in (q, k))
    qi, ki = (rope.apply_rope(t[:, perm], positions, freqs, layout="interleaved") for t in (q, k))
    torch.testing.assert_close(qi, qh[:, perm], rtol=0, atol=1e-12)
    torch.testing.assert_close(qi @ ki.T, qh @ kh.T, rtol=0, atol=1e-12)


def test_interleaved_rotates_adjacent_pairs_and_writes_them_back_in_place():
    # regression for the article: it split even/odd dimensions but wrote the result back as two halves
    x = torch.zeros(1, 4, dtype=torch.float64)
    x[0, 2] = 1.0  # pair 1 = (x[2], x[3]) = (1, 0)
    freqs = torch.tensor([0.0, 0.5], dtype=torch.float64)
    y = rope.apply_rope(x, torch.tensor([1]), freqs, layout="interleaved")
    assert y[0].tolist() == pytest.approx([0.0, 0.0, math.cos(0.5), math.sin(0.5)])
    for layout in rope.LAYOUTS:  # position 0 rotates by nothing
        z = rand(3, DIM)
        torch.testing.assert_close(rope.apply_rope(z, torch.zeros(3, dtype=torch.long), rope.inv_freq(DIM), layout=layout), z)


def test_cos_sin_are_float32_or_better_whatever_the_input_dtype():
    x = rand(1, 1, 4, DIM, dtype=torch.float64)
    far = torch.arange(30_000, 30_004)
    exact = rope.apply_rope(x, far, rope.inv_freq(DIM))
    enc = make_encoding("rope", d_model=DIM, num_heads=1, train_len=64)
    for got in (rope.apply_rope(x.to(torch.bfloat16), far, rope.inv_freq(DIM)), enc.rotate(x.bfloat16(), x.bfloat16(), far)[0]):
        # only the final rounding to bfloat16 is lost, not the angle (a bfloat16 angle near 30,000 is off by up to 64 rad)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=2e-2)


def test_pi_keeps_every_position_inside_the_training_range():
    train_len, seq_len = 512, 4096
    freqs, factor = rope.scaled_inv_freq("pi", DIM, train_len=train_len, seq_len=seq_len)
    assert factor == 1.0
    max_angle = (seq_len - 1) * freqs
    assert torch.all(max_angle < train_len * rope.inv_freq(DIM))
    # and it is exactly plain RoPE at positions p / s
    positions = torch.arange(0, seq_len, 97)
    torch.testing.assert_close(rope.rope_angles(positions, freqs), rope.rope_angles(positions / 8, rope.inv_freq(DIM)))


def test_pi_encoding_computes_its_rotation():
    # regression for the article: its PI branch never computed cos/sin
    enc = make_encoding("rope", d_model=DIM * 2, num_heads=2, train_len=128, scaling="pi")
    q = rand(1, 2, 512, DIM, dtype=torch.float32)
    positions = torch.arange(512)
    got, _ = enc.rotate(q, q, positions)
    want = rope.apply_rope(q, positions / 4, rope.inv_freq(DIM))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, q)


@pytest.mark.parametrize("method", ["ntk", "dynamic-ntk", "yarn"])
def test_ntk_family_keeps_the_highest_frequency_and_slows_the_lowest(method):
    s = 8.0
    freqs, _ = rope.scaled_inv_freq(method, DIM, train_len=512, seq_len=int(512 * s))
    plain = rope.inv_freq(DIM)
    assert freqs[0].item() == pytest.approx(plain[0].item(), rel=1e-12)
    assert freqs[-1].item() == pytest.approx(plain[-1].item() / s, rel=1e-9)
    assert torch.all(freqs <= plain * (1 + 1e-12)) and torch.all(freqs >= plain / s * (1 - 1e-12))


def test_ntk_base_formula():
    s, d = 4.0, 64
    freqs, _ = rope.scaled_inv_freq("ntk", d, train_len=512, factor=s)
    torch.testing.assert_close(freqs, rope.inv_freq(d, 10000.0 * s ** (d / (d - 2))))


@pytest.mark.parametrize("seq_len", [1, 100, 511, 512])
def test_dynamic_ntk_is_plain_rope_at_or_below_training_length(seq_len):
    freqs, factor = rope.scaled_inv_freq("dynamic-ntk", DIM, train_len=512, seq_len=seq_len)
    torch.testing.assert_close(freqs, rope.inv_freq(DIM), rtol=0, atol=0)
    assert factor == 1.0
    positions = torch.arange(512)
    torch.testing.assert_close(rope.dynamic_ntk_angles(positions, DIM, train_len=512), rope.rope_angles(positions, rope.inv_freq(DIM)))


def test_positionwise_dynamic_ntk_uses_the_base_of_each_prefix_length():
    p = torch.tensor([2047])
    angles = rope.dynamic_ntk_angles(p, DIM, train_len=512)
    freqs, _ = rope.scaled_inv_freq("dynamic-ntk", DIM, train_len=512, seq_len=2048)
    torch.testing.assert_close(angles[0], 2047 * freqs)


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
def test_sequences_shorter_than_training_never_shrink_the_scale(method):
    # regression for the article: its PI and NTK branches used seq_len / train_len < 1 as the scale
    freqs, factor = rope.scaled_inv_freq(method, DIM, train_len=512, seq_len=128)
    torch.testing.assert_close(freqs, rope.inv_freq(DIM), rtol=0, atol=0)
    assert factor == 1.0


def test_no_length_cap_far_past_training():
    # regression for the article: its cos/sin cache raised past 4x the training length
    enc = make_encoding("rope", d_model=DIM, num_heads=1, train_len=64, scaling="yarn")
    q = rand(1, 1, 64 * 64, DIM, dtype=torch.float32)
    rq, rk = enc.rotate(q, q, torch.arange(64 * 64))
    assert rq.shape == q.shape and torch.isfinite(rq).all()


@pytest.mark.parametrize("s", [1.0, 2.0, 4.0, 16.0])
def test_yarn_attention_factor(s):
    _, factor = rope.scaled_inv_freq("yarn", DIM, train_len=512, factor=s)
    assert factor == pytest.approx(0.1 * math.log(s) + 1)
    assert rope.yarn_attention_factor(4.0) == pytest.approx(1.1386294361)


def test_yarn_ramp_by_rotations_follows_the_papers_piecewise_formula():
    d, L, base = 64, 512, 10000.0
    gamma = rope.yarn_ramp(d, base, L, ramp="rotations")
    for i in range(d // 2):
        r = L / (2 * math.pi * base ** (2 * i / d))
        want = 0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / 31
        assert gamma[i].item() == pytest.approx(want, abs=1e-12)


def test_yarn_ramps_agree_outside_the_transition_band():
    d, L = 128, 4096
    by_turns = rope.yarn_ramp(d, 10000.0, L, ramp="rotations")
    by_index = rope.yarn_ramp(d, 10000.0, L, ramp="index")
    outside = (by_turns == 0) | (by_turns == 1)
    assert outside.sum() > d // 4
    torch.testing.assert_close(by_index[outside], by_turns[outside])


def test_yarn_scaled_frequencies_interpolate_between_pi_and_plain():
    s = 4.0
    freqs, _ = rope.scaled_inv_freq("yarn", DIM, train_len=512, factor=s)
    gamma = rope.yarn_ramp(DIM, 10000.0, 512)
    plain = rope.inv_freq(DIM)
    torch.testing.assert_close(freqs, gamma * plain + (1 - gamma) * plain / s)


@pytest.mark.parametrize("layout", rope.LAYOUTS)
def test_xpos_score_is_relative_and_decays_by_zeta_power(layout):
    q, k, freqs, scale_base = rand(DIM), rand(DIM, seed=1), rope.inv_freq(DIM), 64.0
    zeta = xpos.xpos_zeta(DIM)
    perm = torch.arange(DIM) if layout == "half" else torch.tensor([j for i in range(DIM // 2) for j in (i, i + DIM // 2)])

    def xscore(m, n, length):
        positions = torch.arange(length)
        qx, kx = xpos.apply_xpos(q.expand(length, DIM)[:, perm], k.expand(length, DIM)[:, perm], positions, freqs,
                                 scale_base=scale_base, layout=layout)
        return float(qx[m] @ kx[n])

    assert xscore(90, 30, 100) == pytest.approx(xscore(160, 100, 300), rel=1e-9)
    # independent formula: plain RoPE with query pair i scaled by zeta_i ** ((m - n) / scale_base)
    m, n = 90, 30
    qs = q * torch.cat([zeta, zeta]) ** ((m - n) / scale_base)
    assert xscore(m, n, 100) == pytest.approx(score(qs, k, m, n, freqs), rel=1e-9)


@pytest.mark.parametrize("bad,match", [
    (dict(method="linear"), "valid RoPE scalings: dynamic-ntk, llama3, longrope, none, ntk, pi, yarn"),
    (dict(dim=15), "even"),
    (dict(factor=0.5), ">= 1"),
    (dict(factor=float("nan")), ">= 1"),
    (dict(train_len=0), "positive"),
    (dict(beta_fast=3, method="ntk"), "unexpected option"),
])
def test_bad_scaling_arguments_name_the_problem(bad, match):
    args = dict(method="yarn", dim=DIM, train_len=512, seq_len=2048) | bad
    with pytest.raises(PosencError, match=match):
        rope.scaled_inv_freq(args.pop("method"), args.pop("dim"), **args)


def test_bad_layout_and_odd_head_dimension():
    with pytest.raises(PosencError, match="valid RoPE layouts: half, interleaved"):
        rope.apply_rope(rand(2, DIM), torch.arange(2), rope.inv_freq(DIM), layout="neox")
    with pytest.raises(PosencError, match="even"):
        make_encoding("rope", d_model=30, num_heads=2, train_len=8)
    with pytest.raises(PosencError, match="even"):
        rope.apply_rope(rand(2, 7), torch.arange(2), rope.inv_freq(8))


def released_yarn_inv_freq(dim, base, L, s, beta_fast=32.0, beta_slow=1.0):
    """YaRN's frequencies as the released models compute them (the authors' code and Hugging Face's),
    written out here scalar by scalar, independently of the package: the pairs between the one making
    ``beta_fast`` turns (rounded down) and the one making ``beta_slow`` turns (rounded up, capped at
    ``dim - 1``) ramp linearly in the index from extrapolated to interpolated."""
    def pair(turns):
        return dim * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair(beta_fast)), 0)
    high = min(math.ceil(pair(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(theta / s * (1 - keep) + theta * keep)
    return out


@pytest.mark.parametrize("dim,L,s", [(128, 4096, 8.0), (64, 2048, 4.0), (32, 512, 16.0), (32, 128, 4.0), (16, 64, 2.0)])
def test_yarn_default_is_what_released_models_compute(dim, L, s):
    """The default ramp is the released models' (linear in the pair index), not the paper's (linear in turns)."""
    freqs, factor = rope.scaled_inv_freq("yarn", dim, train_len=L, factor=s)
    want = torch.tensor(released_yarn_inv_freq(dim, 10000.0, L, s), dtype=torch.float64)
    torch.testing.assert_close(freqs.double(), want, rtol=1e-12, atol=0)
    assert factor == pytest.approx(0.1 * math.log(s) + 1)


def test_yarn_ramp_pair_making_r_turns_makes_r_turns():
    d, L, base = 64, 512, 10000.0
    for turns in (1.0, 32.0, 3.5):
        i = rope.yarn_pair_making(turns, d, base, L)
        assert L * base ** (-2 * i / d) / (2 * math.pi) == pytest.approx(turns, rel=1e-12)


@pytest.mark.parametrize("layout", rope.LAYOUTS)
def test_rope_object_rotates_float64_to_float64_precision(layout):
    """The RoPE object's tables follow the input's precision: float64 in, float64 out."""
    d, n = 32, 300
    enc = make_encoding("rope", d_model=d * 2, num_heads=2, train_len=64, layout=layout)
    q = torch.randn(1, 2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rq, _ = enc.rotate(q, q, torch.arange(n))
    angle = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if layout == "half":
        a, b = q[..., : d // 2], q[..., d // 2 :]
    else:
        a, b = q[..., 0::2], q[..., 1::2]
    ra, rb = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    want = torch.cat([ra, rb], -1) if layout == "half" else torch.stack([ra, rb], -1).flatten(-2)
    assert rq.dtype == torch.float64
    torch.testing.assert_close(rq, want, rtol=0, atol=1e-12)


def test_rope_attention_in_float64_matches_hand_rotation():
    d, n = 16, 50
    enc = make_encoding("rope", d_model=d, num_heads=1, train_len=64)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64, generator=g) for _ in range(3))
    freqs = rope.inv_freq(d)
    rq, rk = (rope.apply_rope(t, torch.arange(n), freqs) for t in (q, k))
    scores = (rq @ rk.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    from posenc_lab import attention

    torch.testing.assert_close(attention(q, k, v, enc, backend="reference"), scores.softmax(-1) @ v, rtol=0, atol=1e-12)
