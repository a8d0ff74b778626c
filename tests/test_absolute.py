"""Absolute encodings (chapter 2)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc_lab import PositionOutOfRange, absolute, make_encoding


def test_sinusoidal_table_is_the_papers_formula():
    table = absolute.sinusoidal_table(50, 12, base=10000.0)
    for p in (0, 1, 7, 49):
        for i in range(6):
            w = 1 / 10000 ** (2 * i / 12)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(p * w), abs=1e-12)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p * w), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(-1000, 1000), p0=st.integers(0, 5000))
def test_pe_of_p_plus_k_is_a_fixed_linear_map_of_pe_of_p(k, p0):
    d = 16
    positions = torch.arange(p0, p0 + 20)
    shifted = absolute.sinusoidal_encoding(positions + k, d)
    mapped = absolute.sinusoidal_encoding(positions, d) @ absolute.sinusoidal_shift(k, d).T
    torch.testing.assert_close(mapped, shifted, rtol=0, atol=1e-9)


def test_shift_map_is_orthogonal_and_independent_of_position():
    m = absolute.sinusoidal_shift(37, 8)
    torch.testing.assert_close(m @ m.T, torch.eye(8, dtype=torch.float64))


def test_learned_table_past_its_end_is_a_clear_error():
    enc = make_encoding("learned", d_model=8, num_heads=2, train_len=16)
    x = torch.zeros(1, 16, 8)
    assert enc.embed(x, torch.arange(16)).shape == x.shape
    with pytest.raises(PositionOutOfRange, match="positions exist for 0..15, asked for position 31: a learned table cannot extrapolate"):
        enc.embed(torch.zeros(1, 32, 8), torch.arange(32))


def test_sinusoidal_embedding_follows_the_papers_recipe():
    # Vaswani et al. (sec. 3.4) and fairseq: tokens times sqrt(d_model), plus the unit-amplitude table
    enc = make_encoding("sinusoidal", d_model=8, num_heads=2, train_len=16)
    x = torch.randn(2, 5, 8)
    pe = absolute.sinusoidal_table(5, 8).float().expand(2, 5, 8)
    torch.testing.assert_close(enc.embed(x, torch.arange(5)), 8**0.5 * x + pe)
    # the table itself has entries in [-1, 1] and RMS 1/sqrt(2) over many positions
    added = make_encoding("sinusoidal", d_model=64, num_heads=2, train_len=16).embed(torch.zeros(1, 500, 64), torch.arange(500))
    assert added.abs().max().item() <= 1.0
    assert added.pow(2).mean().sqrt().item() == pytest.approx(2**-0.5, rel=1e-3)
    # scale and token_scale are the two knobs
    half = make_encoding("sinusoidal", d_model=8, num_heads=2, train_len=16, scale=0.5, token_scale=1.0)
    torch.testing.assert_close(half.embed(x, torch.arange(5)), x + 0.5 * pe)


def test_sinusoidal_small_is_the_old_amplitude_and_a_variant():
    small = make_encoding("sinusoidal-small", d_model=64, num_heads=2, train_len=16)
    assert small.variant_of == "sinusoidal"
    x = torch.randn(1, 500, 64)
    added = small.embed(x, torch.arange(500)) - x  # tokens unscaled
    assert added.pow(2).mean().sqrt().item() == pytest.approx(0.02, rel=1e-3)
    from posenc_lab.encodings import PRIMARY
    assert "sinusoidal" in PRIMARY and "sinusoidal-small" not in PRIMARY
