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


def test_sinusoidal_embedding_adds_the_table():
    enc = make_encoding("sinusoidal", d_model=8, num_heads=2, train_len=16, scale=0.5)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(enc.embed(x, torch.arange(5)) - x, 0.5 * absolute.sinusoidal_table(5, 8).float().expand(2, 5, 8))
    # the default scale gives the table the RMS of a learned table initialised at std 0.02
    default = make_encoding("sinusoidal", d_model=64, num_heads=2, train_len=16)
    added = default.embed(torch.zeros(1, 500, 64), torch.arange(500))
    assert added.pow(2).mean().sqrt().item() == pytest.approx(0.02, rel=1e-3)
