"""Score biases (chapters 5 to 7): ALiBi, T5, KERPLE, FIRE."""

import math

import pytest
import torch

from posenc_lab import PosencError, bias, make_encoding


def test_alibi_slopes_for_8_heads_are_powers_of_one_half():
    assert bias.alibi_slopes(8).tolist() == [2.0 ** -e for e in range(1, 9)]


@pytest.mark.parametrize("heads,exponents", [
    # the paper's rule for n not a power of two: slopes of the closest smaller power p, then every other slope of 2p
    (6, [2, 4, 6, 8, 1, 3]),
    (12, [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]),
    (20, [0.5 * e for e in range(1, 17)] + [0.25, 0.75, 1.25, 1.75]),
    (1, [8]),
    (3, [4, 8, 2]),
])
def test_alibi_slopes_for_any_head_count(heads, exponents):
    assert bias.alibi_slopes(heads).tolist() == pytest.approx([2.0 ** -e for e in exponents], rel=1e-14)


@pytest.mark.parametrize("heads", [0, -3, 2.5, True])
def test_non_positive_head_count_is_an_error(heads):
    with pytest.raises(PosencError, match="positive integer"):
        bias.alibi_slopes(heads)


def test_alibi_bias_is_slope_times_key_minus_query_for_causal_keys():
    slopes = bias.alibi_slopes(4)
    b = bias.alibi_bias(slopes, torch.arange(10), torch.arange(10))
    for h in range(4):
        for i in range(10):
            for j in range(i + 1):
                assert b[h, i, j].item() == pytest.approx(slopes[h].item() * (j - i))


def t5_bucket_scalar(rel, bidirectional, num_buckets=32, max_distance=128):
    """The T5 bucket written out for one integer, in plain Python, from the paper's description."""
    n = -rel
    out = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            out += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return out + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return out + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (64, 256), (8, 20)])
def test_t5_bucket_matches_scalar_implementation(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-600, 601)
    got = bias.t5_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    want = [t5_bucket_scalar(r, bidirectional, num_buckets, max_distance) for r in rel.tolist()]
    assert got.tolist() == want


def test_t5_bucket_known_values_and_convention():
    # relative_position = key - query: a key 16 positions before the query has relative_position -16
    b = lambda r: bias.t5_bucket(torch.tensor(r), bidirectional=False).item()
    assert [b(0), b(-1), b(-15), b(-16), b(-32), b(-127), b(-128), b(-10**6)] == [0, 1, 15, 16, 21, 31, 31, 31]
    assert b(5) == 0  # future keys share bucket 0 in the causal variant (they are masked anyway)
    assert bias.t5_bucket(torch.tensor(5), bidirectional=True).item() == 16 + 5


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_small_distances_exact_monotone_and_saturating(bidirectional):
    nb = 32
    per_dir = nb // 2 if bidirectional else nb
    d = torch.arange(0, 5000)
    buckets = bias.t5_bucket(-d, bidirectional=bidirectional, num_buckets=nb)
    assert buckets[: per_dir // 2].tolist() == list(range(per_dir // 2))  # each small distance its own bucket
    assert torch.all(buckets[1:] >= buckets[:-1])  # monotone in distance
    assert buckets[-1].item() == per_dir - 1 and buckets.max().item() == per_dir - 1  # saturates


def test_t5_bias_gathers_the_table_by_bucket():
    enc = make_encoding("t5", d_model=16, num_heads=4, train_len=64)
    torch.nn.init.normal_(enc.table.table)
    b = enc.bias(torch.arange(200), torch.arange(200))
    i, j = 150, 3
    bucket = bias.t5_bucket(torch.tensor(j - i), bidirectional=False).item()
    torch.testing.assert_close(b[:, i, j], enc.table.table[bucket])


def test_kerple_log_formula_and_relative_property():
    r1, r2 = torch.tensor([0.5, 2.0], dtype=torch.float64), torch.tensor([1.0, 0.1], dtype=torch.float64)
    b = bias.kerple_log_bias(r1, r2, torch.arange(30), torch.arange(30))
    assert b[1, 20, 5].item() == pytest.approx(-2.0 * math.log(1 + 0.1 * 15))
    shifted = bias.kerple_log_bias(r1, r2, torch.arange(100, 130), torch.arange(100, 130))
    torch.testing.assert_close(b, shifted)


def test_kerple_module_parameters_stay_positive():
    enc = make_encoding("kerple", d_model=16, num_heads=4, train_len=64)
    with torch.no_grad():
        enc.kernel.raw_r1.fill_(-30.0)
    r1, r2 = enc.kernel.params()
    assert torch.all(r1 > 0) and torch.all(r2 > 0)


def test_fire_input_lies_in_unit_interval_at_every_length():
    c, threshold = torch.tensor(1.0), torch.tensor(64.0)
    for n in (16, 64, 1000, 20000):
        pos = torch.arange(n - 300 if n > 300 else 0, n)
        x = bias.fire_input(pos, pos, c, threshold)
        causal = torch.ones(len(pos), len(pos)).tril().bool()
        assert x[causal].min() >= 0 and x[causal].max() <= 1 + 1e-6


def test_fire_bias_is_the_mlp_of_the_normalised_distance():
    enc = make_encoding("fire", d_model=16, num_heads=4, train_len=32)
    i, j = 100, 40
    c, L = enc.fire.params()
    x = math.log(1 + c.item() * (i - j)) / math.log(1 + c.item() * max(L.item(), i))
    want = enc.fire.mlp(torch.tensor([[x]]))[0]
    got = enc.bias(torch.arange(101), torch.arange(101))[:, i, j]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fire_stays_finite_when_its_c_underflows():
    """With c = 0 the normalised distance would be 0 / 0: FIRE keeps c away from 0."""
    fire = bias.FIRE(4, init_threshold=64.0)
    with torch.no_grad():
        fire.raw_c.fill_(-1000.0)  # softplus underflows to exactly 0 in float32
    assert fire.params()[0].item() == 0.0
    b = fire(torch.arange(32), torch.arange(32))
    assert torch.isfinite(b).all()
    torch.testing.assert_close(b, b[:, :1, :1].expand_as(b))  # every distance reads as 0


def test_fire_epsilon_is_negligible_at_ordinary_parameters():
    c, L = torch.tensor(1.0, dtype=torch.float64), torch.tensor(128.0, dtype=torch.float64)
    x = bias.fire_input(torch.arange(300), torch.arange(300), c, L)
    exact = bias.fire_input(torch.arange(300), torch.arange(300), c, L, eps=0.0)
    assert (x - exact).abs().max() < 1e-6
