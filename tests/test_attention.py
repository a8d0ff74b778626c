"""One attention function, several backends (chapters 1 and 9)."""

import copy

import pytest
import torch

import posenc_lab as pl
from posenc_lab import PosencError, attention, make_encoding

B, H, N, D = 2, 4, 48, 16
NAMES = sorted(pl.ENCODINGS)


def qkv(n=N, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g).to(dtype) for _ in range(3)]


def encoding(name, **options):
    torch.manual_seed(7)  # the initialisation too: the same parameters whichever tests ran before
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=32, **options)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # learned parameters away from their (often zero) initialisation
        for p in enc.parameters():
            p.copy_(p + 0.5 * torch.randn(p.shape, generator=g))
    return enc


POSITIONS = {"arange": lambda n: torch.arange(n), "offset": lambda n: torch.arange(n) + 1000,
             "strided": lambda n: torch.arange(0, 2 * n, 2)}


def encoding_for(name: str, causal: bool):
    if name == "learned":  # a table long enough for the offset positions
        return make_encoding("learned", d_model=H * D, num_heads=H, train_len=2048)
    return encoding(name, **({"bidirectional": True} if name == "t5" and not causal else {}))


def layer_inputs(enc, n):
    """What an encoding reads from a layer's input, as attention's keywords: FoX's log forget values (``decay``),
    PaTH's transforms (``householder``); None for every other encoding."""
    x = torch.randn(B, n, H * D, generator=torch.Generator().manual_seed(9))
    return {"decay": enc.decay(x), "householder": enc.householder(x)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pos", sorted(POSITIONS))
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", NAMES)
def test_every_backend_matches_reference_at_any_positions_both_directions(name, backend, pos, causal):
    """Every backend reads ``positions`` (not the indices) and scores keys after the query at their own signed
    distance, in both directions. FIRE, xPos (whose decay would grow without bound for keys after the query), SSMax
    (which counts the keys a query sees causally), FoX and CoPE (a query decays or counts the keys before it) have no
    non-causal form. FlexAttention computes a softmax only: stick-breaking's weights are refused."""
    enc = encoding_for(name, causal)
    q, k, v = qkv(n=64)
    p = POSITIONS[pos](64)
    inputs = layer_inputs(enc, 64)
    if not causal and not enc.noncausal:
        with pytest.raises(PosencError, match="no non-causal form"):
            attention(q, k, v, enc, backend=backend, positions=p, causal=False, **inputs)
        return
    if backend == "flex" and enc.weighting != "softmax":
        with pytest.raises(PosencError, match="^FlexAttention computes a softmax"):
            attention(q, k, v, enc, backend=backend, positions=p, causal=causal, **inputs)
        return
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference", positions=p, causal=causal, **inputs)
        got = attention(q, k, v, enc, backend=backend, positions=p, causal=causal, **inputs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_noncausal_bias_is_symmetric_in_distance_for_alibi_and_kerple():
    for name in ("alibi", "kerple"):
        enc = encoding(name)
        b = enc.bias(torch.arange(40), torch.arange(40))
        torch.testing.assert_close(b, b.transpose(-1, -2))


def test_one_directional_t5_refuses_noncausal_attention():
    q, k, v = qkv()
    with pytest.raises(PosencError, match="bidirectional=True"):
        attention(q, k, v, encoding("t5"), causal=False)


def test_positions_must_be_integers():
    q, k, v = qkv()
    with pytest.raises(PosencError, match="integers"):
        attention(q, k, v, positions=torch.arange(N, dtype=torch.float32))


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "fire"])
def test_blocked_long_attention_matches_reference(name):
    """Past ``BLOCK`` queries the sdpa backend works block by block; and with a mask over budget it builds each block."""
    from posenc_lab import backends
    from posenc_lab.backends import kernels

    enc = encoding(name)
    q, k, v = qkv(n=backends.BLOCK * 2 + 37)
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference")
        torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa"), ref, rtol=1e-5, atol=1e-5)
        budget, kernels.MASK_BUDGET = kernels.MASK_BUDGET, 0
        try:
            torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa"), ref, rtol=1e-5, atol=1e-5)
        finally:
            kernels.MASK_BUDGET = budget


@pytest.mark.parametrize("scaling", ["pi", "ntk", "dynamic-ntk", "yarn"])
def test_rope_scalings_match_reference_past_training_length(scaling):
    enc = encoding("rope", scaling=scaling)
    q, k, v = qkv(n=128)
    torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa"), attention(q, k, v, enc, backend="reference"),
                               rtol=1e-5, atol=1e-5)


def test_reference_is_softmax_of_scaled_scores_plus_bias():
    enc = encoding("alibi")
    q, k, v = (t.double() for t in qkv(n=6))
    s = q @ k.transpose(-1, -2) / D**0.5 + enc.bias(torch.arange(6), torch.arange(6)).double()
    s = s + torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1)
    torch.testing.assert_close(attention(q, k, v, enc, backend="reference"), s.softmax(-1) @ v)


def test_attention_without_encoding_is_permutation_equivariant():
    q, k, v = qkv()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    out = attention(q, k, v, None, backend="reference", causal=False)
    permuted = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], None, backend="reference", causal=False)
    torch.testing.assert_close(permuted, out[:, :, perm])


def test_rope_attention_is_not_permutation_equivariant():
    q, k, v = qkv()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    enc = encoding("rope")
    out = attention(q, k, v, enc, backend="reference", causal=False)
    permuted = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], enc, backend="reference", causal=False)
    assert (permuted - out[:, :, perm]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["rope", "xpos", "alibi", "t5", "kerple"])
def test_relative_encodings_are_invariant_to_shifting_every_position(name):
    enc = encoding(name)
    q, k, v = qkv()
    base = attention(q, k, v, enc, backend="reference", positions=torch.arange(N))
    shifted = attention(q, k, v, enc, backend="reference", positions=torch.arange(N) + 1000)
    torch.testing.assert_close(shifted, base, rtol=1e-5, atol=1e-5)


def test_bf16_sdpa_close_to_reference():
    enc = encoding("alibi")
    q, k, v = qkv(dtype=torch.bfloat16)
    ref = attention(q, k, v, enc, backend="reference").float()
    got = attention(q, k, v, enc, backend="sdpa").float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_bad_inputs_name_the_problem():
    q, k, v = qkv()
    with pytest.raises(PosencError, match="shapes do not match"):
        attention(q, k[:, :, :10], v)
    with pytest.raises(PosencError, match="4-d"):
        attention(q[0], k[0], v[0])
    with pytest.raises(PosencError, match="valid attention backends: auto, flex, reference, sdpa"):
        attention(q, k, v, backend="flash")
    with pytest.raises(PosencError, match="valid encodings: " + ", ".join(sorted(pl.ENCODINGS))):
        make_encoding("absolute", d_model=64, num_heads=4, train_len=8)
    with pytest.raises(PosencError, match="positive integer"):
        make_encoding("alibi", d_model=64, num_heads=0, train_len=8)
    with pytest.raises(PosencError, match="not divisible"):
        make_encoding("rope", d_model=64, num_heads=3, train_len=8)
    with pytest.raises(PosencError, match="unexpected option"):
        make_encoding("alibi", d_model=64, num_heads=4, train_len=8, base=5)
    with pytest.raises(PosencError, match="positions must have shape"):
        attention(q, k, v, positions=torch.arange(3))


def _tiny_gpt(name):
    from posenc_lab.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(encoding=name, n_layer=3, n_head=H, d_model=H * D, train_len=32))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", ["alibi", "t5", "fire"])
def test_a_forward_pass_builds_its_bias_once_for_every_layer(name, grad, monkeypatch):
    """The model asks once per forward pass; its layers share the mask (and, under gradients, its graph)."""
    from posenc_lab.backends import GRAD_BLOCK, masks

    model, calls = _tiny_gpt(name), []
    build = masks.bias_block
    monkeypatch.setattr(masks, "bias_block", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    x = torch.randint(0, 256, (2, N))
    with torch.set_grad_enabled(grad):
        model(x)
        per_forward = len(calls)
        model(x)
    assert N <= GRAD_BLOCK  # one block of queries: one mask per forward pass, however it trains
    assert per_forward == 1 and len(calls) == 2  # once per forward pass: not once per layer, nor kept for the next


def test_a_trained_bias_is_read_afresh_after_an_optimizer_step():
    """Each forward pass reads the parameters as they are now: after a step, the model equals a fresh one
    loaded with the same weights, and differs from what it computed before the step."""
    model, x = _tiny_gpt("t5"), torch.randint(0, 256, (2, N))
    opt = torch.optim.SGD(model.encoding.parameters(), lr=10.0)
    with torch.no_grad():
        before = model(x)
    model.loss(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    fresh = _tiny_gpt("t5")
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after = model(x)
        torch.testing.assert_close(after, fresh(x))
    assert not torch.equal(after, before)


def test_tables_refuse_other_positions_or_another_encoding():
    q, k, v = qkv()
    enc, positions = encoding("rope"), torch.arange(N)
    tables = enc.tables(positions)
    torch.testing.assert_close(attention(q, k, v, enc, positions=positions, tables=tables),
                               attention(q, k, v, enc, positions=positions))
    with pytest.raises(PosencError, match="tables serve the encoding and the positions tensor"):
        attention(q, k, v, enc, positions=torch.arange(N), tables=tables)
    with pytest.raises(PosencError, match="tables serve the encoding and the positions tensor"):
        attention(q, k, v, encoding("rope"), positions=positions, tables=tables)


def test_causal_mask_is_folded_into_the_bias():
    from posenc_lab.backends import bias_tensor

    for name in ("alibi", "t5", "kerple", "fire"):
        enc = encoding(name)
        b = bias_tensor(enc, torch.arange(10), causal=True)
        want = enc.bias(torch.arange(10), torch.arange(10)).masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(),
                                                                       float("-inf"))
        torch.testing.assert_close(b, want)


def test_learned_bias_gradient_is_the_same_through_every_backend():
    grads = {}
    for backend in ("reference", "sdpa"):
        enc = encoding("t5")
        q, k, v = qkv()
        attention(q, k, v, enc, backend=backend).pow(2).sum().backward()
        grads[backend] = enc.table.table.grad
    torch.testing.assert_close(grads["sdpa"], grads["reference"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pos", ["arange", "offset"])
@pytest.mark.parametrize("name", ["t5", "kerple", "fire"])
def test_learned_bias_gradients_through_query_blocks_match_reference(name, pos, causal):
    """A learned bias trains through blocks of GRAD_BLOCK queries, each with the keys it can see;
    every gradient (queries, keys, values, the bias's parameters) is the float64 reference's, across a
    length that is not a multiple of the block."""
    from posenc_lab.backends import GRAD_BLOCK

    if name == "fire" and not causal:
        pytest.skip("FIRE is causal only")
    n = 2 * GRAD_BLOCK + 44
    torch.manual_seed(0)  # FIRE's MLP starts from the global RNG: seeded, so the test does not depend on test order
    grads, original = {}, encoding_for(name, causal)  # one encoding, copied for both backends
    for backend in ("reference", "sdpa"):
        enc = copy.deepcopy(original)
        q, k, v = (t.requires_grad_() for t in qkv(n=n))
        out = attention(q, k, v, enc, backend=backend, causal=causal, positions=POSITIONS[pos](n))
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad] + [p.grad for p in enc.parameters()]
    for got, want in zip(grads["sdpa"], grads["reference"]):
        # a parameter's gradient sums n^2 float32 terms: an element near zero carries the rounding of the largest
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_encodings_survive_deepcopy_after_a_forward():
    import copy

    for name in ("rope", "t5"):
        enc = encoding(name)
        q, k, v = (t.requires_grad_() for t in qkv())
        attention(q, k, v, enc, backend="sdpa").sum().backward()
        clone = copy.deepcopy(enc)
        torch.testing.assert_close(attention(q, k, v, clone, backend="sdpa"), attention(q, k, v, enc, backend="sdpa"))


def test_auto_backend_choice():
    from posenc_lab.backends import choose_backend

    cpu = torch.device("cpu")
    assert {choose_backend(encoding(n), cpu) for n in NAMES} == {"sdpa"}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize("name", ["rope", "xpos", "alibi", "t5", "kerple", "fire"])
def test_fast_paths_in_bf16_within_1e_2_of_reference(name, backend, device):
    enc = encoding(name).to(device)
    q, k, v = (t.to(device) for t in qkv(n=256, dtype=torch.bfloat16))
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference").float()
        got = attention(q, k, v, enc, backend=backend).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "fire"])
def test_flex_on_cuda_at_long_length_matches_sdpa_and_trains(name):
    enc = encoding(name).cuda()
    q, k, v = (t.cuda().requires_grad_() for t in qkv(n=4096, dtype=torch.bfloat16))
    out = attention(q, k, v, enc, backend="flex")
    ref = attention(q, k, v, enc, backend="sdpa")
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    out.float().sum().backward()
    assert all(p.grad is not None for p in enc.parameters())


def test_flex_kernel_options_fall_through_then_back_to_sdpa_once():
    import importlib

    att = importlib.import_module("posenc_lab.backends.kernels")
    tried = []

    def smaller_tiles_only(options):
        tried.append(options)
        if options is None:
            raise RuntimeError("out of resource: shared memory")
        return "flex result"

    assert att.first_kernel_that_compiles("test-a", smaller_tiles_only, lambda: "sdpa") == "flex result"
    assert att.first_kernel_that_compiles("test-a", smaller_tiles_only, lambda: "sdpa") == "flex result"
    assert tried == [None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 64}]

    attempts = []

    def never(options):
        attempts.append(options)
        raise RuntimeError("illegal memory access")

    with pytest.warns(RuntimeWarning, match="falling back to SDPA"):
        assert att.first_kernel_that_compiles("test-b", never, lambda: "sdpa") == "sdpa"
    assert att.first_kernel_that_compiles("test-b", never, lambda: "sdpa") == "sdpa"
    assert len(attempts) == len(att.FLEX_KERNEL_OPTIONS)  # the second call did not try again


@pytest.mark.parametrize("threshold", [200.0, 20.0], ids=["below-threshold", "past-threshold"])
def test_fire_mask_is_the_pairwise_bias_whether_or_not_it_is_distance_only(threshold):
    """Below FIRE's threshold the mask comes from a per-distance table; the values are the pairwise ones."""
    from posenc_lab.backends import bias_block

    enc = make_encoding("fire", d_model=H * D, num_heads=H, train_len=32, init_threshold=threshold)
    positions = torch.arange(64)
    assert enc.distance_only_at(positions) == (threshold >= 63)
    with torch.no_grad():
        got = bias_block(enc, positions, positions, causal=True, offset=0, dtype=torch.float32)[0]
        want = enc.bias(positions, positions).masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    q, k, v = qkv(n=64)
    ref = attention(q, k, v, enc, backend="reference")
    torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa"), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- a sliding-window mask (reach)


@pytest.mark.parametrize("reach", [1, 9, 40, 200])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pos", sorted(POSITIONS))
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "fire"])
def test_reach_matches_reference_on_every_backend(name, backend, pos, causal, reach):
    """Keys ``reach`` or more positions away are masked, by positions (the strided ones reach fewer keys)."""
    if not causal and name == "fire":
        return
    enc = encoding_for(name, causal)
    q, k, v = qkv(n=64)
    p = POSITIONS[pos](64)
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference", positions=p, causal=causal, reach=reach)
        got = attention(q, k, v, enc, backend=backend, positions=p, causal=causal, reach=reach)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_reference_reach_is_the_softmax_over_the_reachable_keys_only():
    """Independent of the masking code: each query row computed alone over the keys ``i - W < j <= i``."""
    enc = encoding("alibi")
    q, k, v = qkv(n=30)
    reach = 7
    got = attention(q, k, v, enc, backend="reference", reach=reach)
    for i in range(30):
        lo = max(0, i - reach + 1)
        keys = torch.arange(lo, i + 1)
        scores = (q[:, :, i : i + 1].double() @ k[:, :, lo : i + 1].double().transpose(-1, -2)) / D**0.5
        scores = scores + enc.bias(torch.tensor([i]), keys).double()
        want = scores.softmax(-1) @ v[:, :, lo : i + 1].double()
        torch.testing.assert_close(got[:, :, i : i + 1].double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["nope", "alibi", "t5"])
def test_reach_over_many_blocks_matches_reference(name):
    """Past ``BLOCK`` queries each block takes only the keys it can reach."""
    from posenc_lab import backends

    enc = encoding(name)
    q, k, v = qkv(n=backends.BLOCK * 2 + 37)
    with torch.no_grad():
        for reach in (100, backends.BLOCK, 3 * backends.BLOCK):
            ref = attention(q, k, v, enc, backend="reference", reach=reach)
            torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa", reach=reach), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pos", ["arange", "strided"])
def test_reach_over_many_blocks_any_positions_both_directions(pos, causal):
    from posenc_lab import backends

    n = backends.BLOCK + 70
    enc = encoding_for("alibi", causal)
    q, k, v = qkv(n=n)
    p = POSITIONS[pos](n)
    with torch.no_grad():
        for reach in (33, 300):
            ref = attention(q, k, v, enc, backend="reference", positions=p, causal=causal, reach=reach)
            got = attention(q, k, v, enc, backend="sdpa", positions=p, causal=causal, reach=reach)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,n,reach,spans", [
    ("t5", 50, 9, ((0, 21), (21, 34), (34, 50))),                 # a cache filled in chunks
    ("alibi", 40, 6, tuple((i, i + 1) for i in range(40))),       # ... and token by token
], ids=["chunks", "tokens"])
def test_reach_with_a_cache_matches_reach_without(name, n, reach, spans):
    from posenc_lab.backends import KVCache

    enc = encoding(name)
    q, k, v = qkv(n=n)
    cache = KVCache()
    with torch.no_grad():
        whole = attention(q, k, v, enc, backend="sdpa", reach=reach)
        parts = [attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], enc, cache=cache, reach=reach) for a, b in spans]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_reach_past_every_key_changes_nothing():
    enc = encoding("t5")
    q, k, v = qkv(n=64)
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, enc, backend="sdpa", reach=64), attention(q, k, v, enc, backend="sdpa"))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_reach_is_one_sentence(bad):
    q, k, v = qkv()
    with pytest.raises(PosencError, match="reach must be a positive integer"):
        attention(q, k, v, reach=bad)
