"""Generation with a key/value cache (chapter 4): cached == uncached for every encoding, dynamic NTK both ways,
YaRN's factor applied exactly once."""

import math

import pytest
import torch

import posenc_lab as pl
from posenc_lab import PosencError, rope
from posenc_lab.model import GPT, GPTConfig
from helpers import same_with_and_without_cache

TRAIN_LEN = 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def model(encoding, **options):
    torch.manual_seed(0)
    m = GPT(GPTConfig(encoding=encoding, n_layer=2, n_head=2, d_model=32, train_len=TRAIN_LEN, encoding_options=options))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # learned encodings away from their (often zero) initialisation
        for p in m.encoding.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return m.eval()


def prompt(n=6, batch=2):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(2))


# randomized positions draw a whole window's positions together: no cache serves them (tests/test_variants.py)
CASES = [(name, {}) for name in sorted(pl.ENCODINGS) if name not in ("learned", "rope-random", "learned-random")] + [
    ("rope", {"scaling": s}) for s in ("pi", "ntk", "yarn", "llama3")] + [("rope", {"layout": "interleaved"})]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("encoding,options", CASES, ids=[f"{n}-{'-'.join(map(str, o.values())) or 'plain'}" for n, o in CASES])
def test_cached_generation_equals_recomputing_everything(encoding, options, device):
    """Past the training length too: 6 prompt tokens + 30 new ones, trained at 16."""
    m = model(encoding, **options).to(device)
    p = prompt().to(device)
    cached = same_with_and_without_cache(m, p, 30)
    assert cached.shape == (2, 36)


def test_learned_positions_stop_with_a_clear_error_at_the_end_of_their_table():
    m = model("learned")
    # the last new token is never fed back: TRAIN_LEN + 1 tokens need positions 0 .. TRAIN_LEN - 1 only
    assert m.generate(prompt(), TRAIN_LEN - 5).shape == (2, TRAIN_LEN + 1)
    with pytest.raises(PosencError, match="cannot extrapolate"):
        m.generate(prompt(), TRAIN_LEN - 4)


def test_dynamic_ntk_cache_form_is_the_positionwise_evaluation():
    """Cached dynamic NTK (each key keeps the base of the length at which it entered) equals, position by position,
    one forward pass with the experiment's position-wise dynamic NTK."""
    m = model("rope", scaling="dynamic-ntk")  # dynamic="cache" is the default
    p = prompt()
    tokens, logits = m.generate(p, 30, cache=True, return_logits=True)
    whole = m(tokens[:, :-1])[:, p.shape[1] - 1:]  # the logits that chose each new token, in one pass
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    uncached, uncached_logits = m.generate(p, 30, cache=False, return_logits=True)
    assert torch.equal(tokens, uncached)


def test_dynamic_ntk_sequence_form_is_a_fresh_forward_pass_and_differs_past_training():
    m = model("rope", scaling="dynamic-ntk")
    p = prompt()
    tokens, logits = m.generate(p, 30, dynamic="sequence", return_logits=True)  # recomputes: no cache can serve it
    m.encoding.set_scaling("dynamic-ntk", dynamic="sequence")
    fresh = torch.stack([m(tokens[:, :i])[:, -1] for i in range(p.shape[1], tokens.shape[1])], dim=1)
    torch.testing.assert_close(logits, fresh, rtol=1e-5, atol=1e-5)
    m.encoding.set_scaling("dynamic-ntk", dynamic="cache")
    with pytest.raises(PosencError, match="no key/value cache can serve"):
        m.generate(p, 3, cache=True, dynamic="sequence")
    assert m.encoding.dynamic == "cache"  # restored after the call


def stepwise_logits(m, tokens, start, dynamic):
    """Next-token logits after each prefix of ``tokens`` longer than ``start``, fed through a cache."""
    m.encoding.set_scaling("dynamic-ntk", dynamic=dynamic)
    caches = m.new_cache()
    out = [m(tokens[:, :start], cache=caches)[:, -1]]
    out += [m(tokens[:, i : i + 1], cache=caches)[:, -1] for i in range(start, tokens.shape[1])]
    return torch.stack(out, dim=1)


def test_the_two_dynamic_ntk_forms_agree_within_training_and_differ_past_it():
    m = model("rope", scaling="dynamic-ntk")
    with torch.no_grad():  # sharper attention than at initialisation, so that positions matter to the logits
        for block in m.blocks:
            block.attn.qkv.weight.mul_(30)
    tokens = torch.randint(0, 256, (2, 3 * TRAIN_LEN), generator=torch.Generator().manual_seed(7))
    start = 6
    cached = stepwise_logits(m, tokens, start, "cache")
    m.encoding.set_scaling("dynamic-ntk", dynamic="sequence")  # a fresh forward pass over every prefix
    rerotated = torch.stack([m(tokens[:, : i + 1])[:, -1] for i in range(start - 1, tokens.shape[1])], dim=1)
    m.encoding.set_scaling("dynamic-ntk", dynamic="cache")
    whole = m(tokens)[:, start - 1 :]  # the position-wise evaluation the experiment uses, in one pass
    torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
    within = TRAIN_LEN - start + 1  # prefixes of at most TRAIN_LEN tokens: the base has not changed yet
    torch.testing.assert_close(cached[:, :within], rerotated[:, :within], rtol=1e-5, atol=1e-5)
    gap = (cached[:, within:] - rerotated[:, within:]).abs().max().item()
    print(f"max |logit difference| between the two dynamic-NTK forms past the training length: {gap:.3g}")
    assert gap > 1e-2


@pytest.mark.parametrize("s", [2.0, 4.0, 16.0])
def test_yarn_scales_logits_by_the_square_of_its_factor_exactly_once(s):
    d, n, L = 32, 64, 16
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(n)
    freqs, factor = rope.scaled_inv_freq("yarn", d, train_len=L, factor=s)
    assert factor == pytest.approx(0.1 * math.log(s) + 1)
    plain = rope.apply_rope(q, positions, freqs) @ rope.apply_rope(k, positions, freqs).transpose(-1, -2)
    # through apply_rope with the factor, through the encoding's rotate, and through the cache's rotate_one
    with_factor = (rope.apply_rope(q, positions, freqs, attention_factor=factor)
                   @ rope.apply_rope(k, positions, freqs, attention_factor=factor).transpose(-1, -2))
    enc = pl.make_encoding("rope", d_model=d, num_heads=1, train_len=L, scaling="yarn", factor=s)
    rq, rk = enc.rotate(q, k, positions)
    cq, ck = enc.rotate_one(q, positions, "q"), enc.rotate_one(k, positions, "k")
    for scores in (with_factor, rq @ rk.transpose(-1, -2), cq @ ck.transpose(-1, -2)):
        torch.testing.assert_close(scores, plain * factor**2, rtol=1e-12, atol=1e-12)


def test_yarn_model_path_applies_the_factor_once():
    """The model's logits under YaRN equal those of a model whose attention sees scores scaled by factor^2 once."""
    m = model("rope", scaling="yarn", factor=4.0)
    p = prompt(n=40)
    factor = rope.yarn_attention_factor(4.0)
    seen = []
    from posenc_lab.backends import kernels as backends

    original = backends._sdpa

    def spy(q, k, v, encoding, q_pos, k_pos, causal, reach=None, tables=None, chunk=None):
        seen.append((q.norm() * k.norm()).item())
        return original(q, k, v, encoding, q_pos, k_pos, causal, reach, tables, chunk)

    backends._BACKEND_FNS["sdpa"] = spy
    try:
        m(p)
        with_factor = seen[:]
        seen.clear()
        m.encoding.set_scaling("yarn", 4.0, mscale=1.0)
        m(p)
    finally:
        backends._BACKEND_FNS["sdpa"] = original
    for a, b in zip(with_factor, seen):
        assert a == pytest.approx(b * factor**2, rel=1e-5)


def test_generation_edge_cases():
    m = model("alibi")
    long = torch.randint(0, 256, (1, 3 * TRAIN_LEN), generator=torch.Generator().manual_seed(4))
    assert m.generate(long, 5).shape == (1, 3 * TRAIN_LEN + 5)  # a prompt longer than the training length
    one = m.generate(torch.tensor([65]), 4)  # a one-token prompt, given as 1-d
    assert one.shape == (1, 5) and one[0, 0] == 65
    assert torch.equal(m.generate(long, 0), long)  # nothing to generate
    with pytest.raises(PosencError, match="at least one token"):
        m.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(PosencError, match="non-negative"):
        m.generate(long, -1)
    with pytest.raises(PosencError, match="temperature"):
        m.generate(long, 2, temperature=-1.0)


def test_sampling_is_reproducible_with_a_generator_and_top_k_one_is_greedy():
    m = model("rope")
    p = prompt()
    a = m.generate(p, 10, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = m.generate(p, 10, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert torch.equal(m.generate(p, 10, temperature=1.0, top_k=1), m.generate(p, 10))


def test_prefill_then_steps_equals_one_pass():
    """The cache fed a prompt, then tokens one at a time, gives the logits of one pass over everything."""
    for name in ("rope", "xpos", "alibi", "t5", "fire"):
        m = model(name)
        x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(6))
        caches = m.new_cache()
        parts = [m(x[:, :25], cache=caches)] + [m(x[:, i : i + 1], cache=caches) for i in range(25, 40)]
        torch.testing.assert_close(torch.cat(parts, dim=1), m(x), rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_a_rotation_that_changes_with_the_length():
    """Review finding: a PI factor that follows the length would rotate each new query with a larger factor
    than the keys already cached; the cache refuses it (generate() fixes the factor for the call instead)."""
    m = model("rope", scaling="pi")
    caches = m.new_cache()
    with pytest.raises(PosencError, match="fix the factor"):
        m(prompt(), cache=caches)
    m.encoding.set_scaling("pi", 2.0)
    m(prompt(), cache=caches)  # a fixed factor: fine
    with pytest.raises(PosencError, match="batch of 2"):
        m(prompt(batch=3), cache=caches)


def test_bad_token_ids_are_one_sentence():
    with pytest.raises(PosencError, match=r"token ids must lie in 0 \.\. 255"):
        model("nope")(torch.tensor([[1, 256]]))
