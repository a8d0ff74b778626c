"""RoPE as today's models run it: Llama 3's scaling, partial rotary and p-RoPE.

Each is checked against an independent computation: the released algorithm written out here the
way Hugging Face's ``transformers`` computes it (``_compute_llama3_parameters`` and the GPT-NeoX
style ``apply_rotary_pos_emb`` with ``partial_rotary_factor``), scalar by scalar or with plain
tensor code that shares nothing with the package, in float64.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc_lab import PosencError, make_encoding, rope
from posenc_lab.encodings import PRoPE, PartialRoPE


def released_llama3_inv_freq(dim, base, factor, low_freq_factor, high_freq_factor, original_len):
    """Llama 3.1's frequencies as Hugging Face's ``_compute_llama3_parameters`` computes them, one pair at a
    time: keep the pairs whose wavelength is below ``original / high``, divide by ``factor`` those above
    ``original / low``, and blend the others with ``smooth = (original / wavelength - low) / (high - low)``."""
    low_wavelen, high_wavelen = original_len / low_freq_factor, original_len / high_freq_factor
    out = []
    for i in range(0, dim, 2):
        theta = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / theta
        if wavelen < high_wavelen:
            out.append(theta)
        elif wavelen > low_wavelen:
            out.append(theta / factor)
        else:
            smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * theta / factor + smooth * theta)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dim,base,factor,low,high,original", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),   # Meta's released Llama 3.1 configuration
    (32, 10000.0, 4.0, 1.0, 4.0, 512),      # the article-cpu head at 4x
    (64, 10000.0, 16.0, 2.0, 8.0, 128),
    (16, 100.0, 2.0, 1.0, 4.0, 64),
])
def test_llama3_is_what_hugging_face_computes(dim, base, factor, low, high, original):
    got, attention_factor = rope.scaled_inv_freq("llama3", dim, base=base, train_len=original, factor=factor,
                                                 low_freq_factor=low, high_freq_factor=high)
    want = released_llama3_inv_freq(dim, base, factor, low, high, original)
    torch.testing.assert_close(got.double(), want, rtol=1e-12, atol=0)
    assert attention_factor == 1.0


def test_llama3_keeps_fast_pairs_and_interpolates_slow_ones():
    dim, L, s = 32, 512, 4.0
    plain = rope.inv_freq(dim)
    got, _ = rope.scaled_inv_freq("llama3", dim, train_len=L, factor=s)
    turns = L * plain / (2 * math.pi)
    fast, slow = turns > 4.0, turns < 1.0
    assert fast.any() and slow.any() and (~fast & ~slow).any()  # all three regimes occur at this shape
    torch.testing.assert_close(got[fast], plain[fast], rtol=0, atol=0)
    torch.testing.assert_close(got[slow], plain[slow] / s, rtol=1e-15, atol=0)
    assert (got[1:] < got[:-1]).all()  # still ordered from fast to slow
    # original_len decouples the thresholds from the training length
    other, _ = rope.scaled_inv_freq("llama3", dim, train_len=L, factor=s, original_len=8 * L)
    assert not torch.equal(other, got)


def test_llama3_options_are_checked():
    with pytest.raises(PosencError, match="high_freq_factor > low_freq_factor"):
        rope.scaled_inv_freq("llama3", 32, train_len=64, factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(PosencError, match="must be a positive number"):
        rope.scaled_inv_freq("llama3", 32, train_len=64, factor=2.0, low_freq_factor=-1.0)
    with pytest.raises(PosencError, match="unexpected option"):
        rope.scaled_inv_freq("llama3", 32, train_len=64, factor=2.0, low_freq=1.0)


def neox_partial_rotary(x, positions, head_dim, fraction, base=10000.0):
    """Hugging Face's GPT-NeoX / Phi rotary with ``partial_rotary_factor``: ``rot = int(head_dim * fraction)``
    coordinates rotated with ``rotate_half`` and frequencies ``base ** (-arange(0, rot, 2) / rot)``, the rest
    passed through, ``cat((x_rot * cos + rotate_half(x_rot) * sin), x_pass)``."""
    rot = int(head_dim * fraction)
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    freqs = positions.double()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated_half * sin, x_pass], dim=-1)


@pytest.mark.parametrize("head_dim,fraction", [(32, 0.25), (64, 0.25), (80, 0.4), (32, 0.5), (32, 1.0)])
def test_partial_rotary_is_what_hugging_face_computes(head_dim, fraction):
    """GPT-NeoX's rotary_pct 0.25 and Phi-2's partial_rotary_factor 0.4 (head 80, 32 rotated coordinates)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 50, head_dim, dtype=torch.float64, generator=g)
    positions = torch.arange(50) + 1000
    enc = make_encoding("rope-partial", d_model=3 * head_dim, num_heads=3, train_len=64, fraction=fraction)
    assert enc.rotary_dim == int(head_dim * fraction)
    got, _ = enc.rotate(q, q, positions)
    torch.testing.assert_close(got, neox_partial_rotary(q, positions, head_dim, fraction), rtol=0, atol=1e-12)


def test_full_fractions_are_plain_rope():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 40, 32, dtype=torch.float64, generator=g)
    positions = torch.arange(40)
    plain, _ = make_encoding("rope", d_model=64, num_heads=2, train_len=64).rotate(q, q, positions)
    for name, option in (("rope-partial", {"fraction": 1.0}), ("p-rope", {"p": 1.0})):
        got, _ = make_encoding(name, d_model=64, num_heads=2, train_len=64, **option).rotate(q, q, positions)
        assert torch.equal(got, plain), name


@pytest.mark.parametrize("layout", rope.LAYOUTS)
def test_p_rope_turns_only_its_fastest_pairs(layout):
    """p-RoPE keeps RoPE's k fastest pairs (the same frequencies) and leaves the slow pairs untouched."""
    d, p = 32, 0.75
    k = round(p * d / 2)
    enc = make_encoding("p-rope", d_model=2 * d, num_heads=2, train_len=64, p=p, layout=layout)
    plain = make_encoding("rope", d_model=2 * d, num_heads=2, train_len=64, layout=layout)
    q = torch.randn(1, 2, 30, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(30) + 7
    got, _ = enc.rotate(q, q, positions)
    want, _ = plain.rotate(q, q, positions)
    pair_index = torch.arange(d) % (d // 2) if layout == "half" else torch.arange(d) // 2
    fast = pair_index < k
    torch.testing.assert_close(got[..., fast], want[..., fast], rtol=0, atol=0)
    torch.testing.assert_close(got[..., ~fast], q[..., ~fast], rtol=0, atol=0)


def test_partial_and_p_rope_differ_as_the_book_says():
    """Partial rotary keeps the whole range of frequencies on fewer coordinates; p-RoPE removes the slow ones."""
    d, base = 32, 10000.0
    partial = make_encoding("rope-partial", d_model=2 * d, num_heads=2, train_len=64, fraction=0.5)
    p_rope = make_encoding("p-rope", d_model=2 * d, num_heads=2, train_len=64, p=0.5)
    positions = torch.tensor([1])
    partial_angles = torch.atan2(*reversed(partial.cos_sin(positions, torch.float64)))[0]
    p_angles = torch.atan2(*reversed(p_rope.cos_sin(positions, torch.float64)))[0]
    assert partial_angles.shape == (8,) and p_angles.shape == (16,)
    assert partial_angles.min().item() == pytest.approx(base ** (-14 / 16), rel=1e-12)  # the slowest of 8 pairs
    assert p_angles[:8].min().item() == pytest.approx(base ** (-14 / 32), rel=1e-12)  # 8 fastest of 16
    assert (p_angles[8:] == 0).all()


@settings(max_examples=30, deadline=None)
@given(shift=st.integers(0, 5000), name=st.sampled_from(["rope-partial", "p-rope"]))
def test_variants_scores_depend_on_distance_only(shift, name):
    d = 32
    enc = make_encoding(name, d_model=2 * d, num_heads=2, train_len=64)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 20, d, dtype=torch.float64, generator=g) for _ in range(2))
    positions = torch.arange(20)
    a = torch.einsum("bhid,bhjd->bhij", *enc.rotate(q, k, positions))
    b = torch.einsum("bhid,bhjd->bhij", *enc.rotate(q, k, positions + shift))
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_variants_take_scalings_on_their_rotated_dimensions():
    """A strategy on partial rotary is computed for the rotated coordinates (as Hugging Face does)."""
    enc = make_encoding("rope-partial", d_model=64, num_heads=2, train_len=64, fraction=0.5, scaling="yarn")
    cos, _ = enc.cos_sin(torch.arange(256), torch.float64)
    freqs, factor = rope.scaled_inv_freq("yarn", 16, train_len=64, seq_len=256)
    torch.testing.assert_close(cos, (torch.arange(256, dtype=torch.float64)[:, None] * freqs).cos() * factor)


@pytest.mark.parametrize("name,options,match", [
    ("rope-partial", {"fraction": 0.0}, r"in \(0, 1\]"),
    ("rope-partial", {"fraction": 1.5}, r"in \(0, 1\]"),
    ("rope-partial", {"fraction": 0.01}, "keeps nothing"),
    ("p-rope", {"p": -0.5}, r"in \(0, 1\]"),
    ("p-rope", {"p": True}, r"in \(0, 1\]"),
])
def test_bad_fractions_are_one_line_errors(name, options, match):
    with pytest.raises(PosencError, match=match):
        make_encoding(name, d_model=64, num_heads=2, train_len=64, **options)


def test_variants_are_registered_as_variants_of_rope():
    from posenc_lab.encodings import ENCODINGS, PRIMARY

    assert ENCODINGS["rope-partial"] is PartialRoPE and ENCODINGS["p-rope"] is PRoPE
    assert {"rope-partial", "p-rope"}.isdisjoint(PRIMARY)
    assert "llama3" in rope.ROPE_SCALINGS


def test_every_curve_has_its_own_colour_and_old_colours_stay():
    import matplotlib

    from posenc_lab.encodings import ENCODINGS
    from posenc_lab.lab.figures import plots

    names = [n for n in ENCODINGS if n != "rope"]
    names += [f"rope/{s}{ft}" for s in rope.ROPE_SCALINGS for ft in ("", "+ft")]
    colours = [plots.color(n) for n in names]
    assert len(set(colours)) == len(colours)
    tab20 = matplotlib.colormaps["tab20"].colors
    assert plots.color("nope") == tab20[0] and plots.color("fire") == tab20[8]  # as before the variants
    assert plots.color("rope/yarn") == tab20[13] and plots.color("rope/yarn+ft") == tab20[18]


@settings(max_examples=200, deadline=None)
@given(dim=st.sampled_from([16, 32, 64, 128]), base=st.floats(2.0, 1e7), train_len=st.integers(2, 100_000))
def test_critical_dimension_counts_the_pairs_that_turn_fully_in_training(dim, base, train_len):
    """Liu et al.'s 2 ceil((d/2) log_b(L/2pi)) against a direct count of the pairs whose wavelength is at most L."""
    wavelengths = 2 * math.pi / rope.inv_freq(dim, base)
    exact = (dim / 2) * math.log(train_len / (2 * math.pi)) / math.log(base)
    if abs(exact - round(exact)) < 1e-9:
        return  # a wavelength exactly L: the two counts differ by rounding only
    assert rope.critical_dimension(dim, base, train_len) == 2 * int((wavelengths <= train_len).sum())


def test_critical_dimension_of_the_article_cpu_head():
    """d = 32, L = 512: base 500, 10,000 and 500,000 (the bases chapter 12 compares)."""
    assert [rope.critical_dimension(32, b, 512) for b in (500, 10_000, 500_000)] == [24, 16, 12]
    with pytest.raises(PosencError, match="above 1"):
        rope.critical_dimension(32, 1.0, 512)


# --------------------------------------------------------------------------------------------- the base, NoPE layers, randomized positions


@pytest.mark.parametrize("name,base", [("rope-b500", 500.0), ("rope-b500k", 500_000.0)])
def test_base_variants_are_rope_with_that_base(name, base):
    enc = make_encoding(name, d_model=64, num_heads=2, train_len=64)
    plain = make_encoding("rope", d_model=64, num_heads=2, train_len=64, base=base)
    pos = torch.arange(100)
    for a, b in zip(enc.cos_sin(pos, torch.float64), plain.cos_sin(pos, torch.float64)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    theta = torch.tensor([base ** (-2 * i / 32) for i in range(16)], dtype=torch.float64)  # the formula, written out
    torch.testing.assert_close(enc.cos_sin(pos, torch.float64)[0], torch.cos(pos[:, None].double() * theta))


def _gpt(encoding, n_layer=4, **options):
    from posenc_lab.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(encoding=encoding, n_layer=n_layer, n_head=2, d_model=32, train_len=16,
                         encoding_options=options)).eval()


def test_nope_layers_are_nope_in_every_interval_th_layer_only():
    """Against a forward pass written out here: RoPE in layers 0-2, no position in layer 3."""
    from posenc_lab.encodings import NoPE

    model = _gpt("rope-nope")
    assert [type(model.encoding.for_layer(i, 4)).__name__ for i in range(4)] == ["RoPENoPELayers"] * 3 + ["NoPE"]
    idx = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(1))
    rope_enc = make_encoding("rope", d_model=32, num_heads=2, train_len=16)
    with torch.no_grad():
        pos = torch.arange(24)
        x = model.tok_emb(idx)
        for i, block in enumerate(model.blocks):
            x = block(x, NoPE() if i == 3 else rope_enc, pos)
        want = model.head(model.ln_f(x))
        torch.testing.assert_close(model(idx), want)
        every = _gpt("rope-nope", interval=1)  # every layer NoPE: the NoPE model with the same weights
        nope = _gpt("nope")
        nope.load_state_dict(every.state_dict())
        torch.testing.assert_close(every(idx), nope(idx))
        cached = model.generate(idx[:1, :5], 8, cache=True)
        torch.testing.assert_close(cached, model.generate(idx[:1, :5], 8, cache=False))
    with pytest.raises(PosencError, match="interval must be a positive integer"):
        _gpt("rope-nope", interval=0)


@pytest.mark.parametrize("name", ["rope-random", "learned-random"])
def test_randomized_positions_in_training_and_in_evaluation(name):
    model = _gpt(name, n_layer=2)
    enc = model.encoding
    assert enc.max_position == 16 * 16
    draws = [enc.forward_positions(torch.arange(16), True) for _ in range(3)]
    for p in draws:
        assert p.shape == (16,) and (p.diff() > 0).all() and 0 <= int(p.min()) and int(p.max()) < enc.max_position
    assert not torch.equal(draws[0], draws[1])
    state = {k: v.clone() for k, v in enc.state_dict().items()}
    following = enc.forward_positions(torch.arange(16), True)
    torch.manual_seed(123)  # the process's seed does not matter: the encoding keeps the one it was built under
    enc.load_state_dict(state)  # a resumed run draws what the uninterrupted one drew
    torch.testing.assert_close(enc.forward_positions(torch.arange(16), True), following)
    # evaluation: one fixed draw per length, spread over the whole range as in training (not 0 .. n-1)
    a, b = enc.forward_positions(torch.arange(40), False), enc.forward_positions(torch.arange(40), False)
    assert torch.equal(a, b) and (a.diff() > 0).all() and int(a[-1]) > 40
    assert not torch.equal(a[:16], enc.forward_positions(torch.arange(16), False))
    idx = torch.randint(256, (2, 40), generator=torch.Generator().manual_seed(2))
    seen = []
    original = model.encoding.embed
    model.encoding.embed = lambda x, positions: seen.append(positions) or original(x, positions)
    with torch.no_grad():
        model(idx)
    torch.testing.assert_close(seen[-1], a)
    model.train()
    model.loss(idx[:, :16], idx[:, 1:17])
    assert len(seen) == 2 and not torch.equal(seen[-1], a[:16]) and len(seen[-1]) == 16
    with pytest.raises(PosencError, match="max_position"):
        make_encoding(name, d_model=32, num_heads=2, train_len=16, max_position=8)
    model.eval()
    with pytest.raises(PosencError, match="cache"):
        model.generate(idx[:1, :4], 2, cache=True)
    assert model.generate(idx[:1, :4], 2).shape == (1, 6)  # recomputed at each step, without a cache


def test_randomized_rope_evaluates_at_its_drawn_positions():
    """Against plain RoPE given the same positions by hand: the variant changes positions, nothing else."""
    from posenc_lab.backends import attention

    enc = make_encoding("rope-random", d_model=32, num_heads=2, train_len=16)
    plain = make_encoding("rope", d_model=32, num_heads=2, train_len=16)
    q, k, v = (torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    p = enc.forward_positions(torch.arange(30), False)
    torch.testing.assert_close(attention(q, k, v, enc, positions=p), attention(q, k, v, plain, positions=p))


def test_new_variants_are_variants():
    from posenc_lab.encodings import ENCODINGS, PRIMARY

    for name, parent in [("rope-b500", "rope"), ("rope-b500k", "rope"), ("rope-nope", "rope"),
                         ("rope-random", "rope"), ("learned-random", "learned")]:
        assert ENCODINGS[name].variant_of == parent and name not in PRIMARY


def test_the_variants_preset_is_article_cpu_with_the_variants_and_llama3_on_every_rope_seed():
    from dataclasses import asdict

    from posenc_lab import encodings
    from posenc_lab.lab.experiments import language_model

    variants, article = language_model.preset("variants-cpu"), language_model.preset("article-cpu")
    assert (variants.model, variants.training, variants.seeds) == (article.model, article.training, article.seeds)
    same = ("eval_lengths", "eval_tokens", "stride", "sliding")
    assert {k: asdict(variants.evaluation)[k] for k in same} == {k: asdict(article.evaluation)[k] for k in same}
    assert "rope" in variants.encodings and "llama3" in variants.strategies and "none" in variants.strategies
    for name in variants.encodings:
        assert name in encodings.ENCODINGS, name
    assert not variants.finetuning.finetune  # nothing fine-tuned: the strategies are applied to the trained models
