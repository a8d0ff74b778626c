"""One attention function, several backends (chapters 1 and 9)."""

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
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=32, **options)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # learned parameters away from their (often zero) initialisation
        for p in enc.parameters():
            p.copy_(p + 0.5 * torch.randn(p.shape, generator=g))
    return enc


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", NAMES)
def test_every_backend_matches_reference(name, backend):
    enc = encoding(name)
    q, k, v = qkv()
    with torch.no_grad():
        ref = attention(q, k, v, enc, backend="reference")
        got = attention(q, k, v, enc, backend=backend)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


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
    with pytest.raises(PosencError, match="valid encodings: alibi, fire, kerple, learned, nope, rope, sinusoidal, t5, xpos"):
        make_encoding("absolute", d_model=64, num_heads=4, train_len=8)
    with pytest.raises(PosencError, match="positive integer"):
        make_encoding("alibi", d_model=64, num_heads=0, train_len=8)
    with pytest.raises(PosencError, match="not divisible"):
        make_encoding("rope", d_model=64, num_heads=3, train_len=8)
    with pytest.raises(PosencError, match="unexpected option"):
        make_encoding("alibi", d_model=64, num_heads=4, train_len=8, base=5)
    with pytest.raises(PosencError, match="positions must have shape"):
        attention(q, k, v, positions=torch.arange(3))


def test_bias_is_built_once_per_forward_and_rebuilt_after_an_update():
    enc = encoding("t5")
    q, k, v = qkv()
    positions = torch.arange(N)
    from posenc_lab.attention import bias_tensor

    first = bias_tensor(enc, positions)
    assert bias_tensor(enc, positions) is first  # the next layer of the same forward
    assert bias_tensor(enc, torch.arange(N)) is not first  # the next forward
    with torch.no_grad():
        enc.table.table.add_(1.0)  # an optimizer step
    torch.testing.assert_close(bias_tensor(enc, positions), first + 1.0)


def test_learned_bias_gradient_is_the_same_through_every_backend():
    grads = {}
    for backend in ("reference", "sdpa"):
        enc = encoding("t5")
        q, k, v = qkv()
        attention(q, k, v, enc, backend=backend).pow(2).sum().backward()
        grads[backend] = enc.table.table.grad
    torch.testing.assert_close(grads["sdpa"], grads["reference"], rtol=1e-4, atol=1e-5)


def test_encodings_survive_deepcopy_after_a_forward():
    import copy

    for name in ("rope", "t5"):
        enc = encoding(name)
        q, k, v = (t.requires_grad_() for t in qkv())
        attention(q, k, v, enc, backend="sdpa").sum().backward()
        clone = copy.deepcopy(enc)
        torch.testing.assert_close(attention(q, k, v, clone, backend="sdpa"), attention(q, k, v, enc, backend="sdpa"))


def test_auto_backend_choice():
    from posenc_lab.attention import choose_backend

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

    att = importlib.import_module("posenc_lab.attention")  # the module, not the function of the same name
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
