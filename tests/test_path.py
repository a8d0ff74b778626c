"""PaTH (Yang et al. 2025): the logits against the paper's product of matrices written out in float64, the limits
(every beta at 0 is NoPE; fixed transforms give a relative score, a reflection at beta = 2), causality, every backend
and the key/value cache against the reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from posenc_lab import KVCache, PaTH, PosencError, SinkCache, attention, make_encoding
from posenc_lab.encodings.householder import householder_vectors, path_logits, path_logits_blocked
from posenc_lab.model import GPT, GPTConfig
from helpers import same_with_and_without_cache

B, H, N, D = 2, 3, 10, 4


def transforms(b=B, h=H, n=N, d=D, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = F.normalize(torch.randn(b, h, n, d, generator=g, dtype=dtype), dim=-1)
    return w, 2 * torch.rand(b, h, n, generator=g, dtype=dtype)


def qkv(b=B, h=H, n=N, d=D, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


def paper_logits(q, k, w, beta, offset):
    """``q_r^T H_m H_{m-1} ... H_{j+1} k_j`` for the query at key row ``m = r + offset``, each ``H_t = I - beta_t w_t
    w_t^T`` a ``d x d`` matrix and the product formed explicitly, the latest transform on the left (next to the
    query); ``-inf`` for the keys after the query."""
    b, h, nq, d = q.shape
    nk = k.shape[-2]
    out = torch.full((b, h, nq, nk), float("-inf"), dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            Hs = [eye - beta[bi, hi, t] * torch.outer(w[bi, hi, t], w[bi, hi, t]) for t in range(nk)]
            for r in range(nq):
                m = r + offset
                for j in range(m + 1):
                    P = eye.clone()
                    for t in range(j + 1, m + 1):
                        P = Hs[t] @ P
                    out[bi, hi, r, j] = q[bi, hi, r] @ P @ k[bi, hi, j]
    return out


@pytest.mark.parametrize("nq", [N, 3, 1])
def test_logits_are_the_papers_product_of_transforms_written_out(nq):
    """For a whole sequence and for the last ``nq`` queries against every key (a cache's call)."""
    q, k, _ = qkv()
    w, beta = transforms()
    expected = paper_logits(q[:, :, N - nq:], k, w, beta, N - nq)
    got = path_logits(q[:, :, N - nq:], k, w, beta)
    seen = torch.isfinite(expected)
    torch.testing.assert_close(got[seen], expected[seen], rtol=1e-12, atol=1e-12)
    assert (got[~seen] == 0).all()


@pytest.mark.parametrize("n,block", [(37, 8), (32, 16), (16, 4), (5, 8), (17, 16)])
def test_the_blocked_computation_equals_the_walk(n, block):
    """Blocks of queries and keys, the product across whole blocks as ``d x d`` matrices: the walk's numbers, whether
    ``n`` is a multiple of the block or not; and their gradients."""
    q, k, _ = (t.requires_grad_() for t in qkv(n=n, d=6, seed=n))
    w, beta = (t.requires_grad_() for t in transforms(n=n, d=6, seed=n + 1))
    walked = path_logits(q, k, w, beta)
    blocked = path_logits_blocked(q, k, w, beta, block)
    torch.testing.assert_close(blocked, walked, rtol=1e-12, atol=1e-12)
    weights = torch.randn(walked.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((walked * weights).sum(), (q, k, w, beta)),
                    torch.autograd.grad((blocked * weights).sum(), (q, k, w, beta))):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_attention_is_the_softmax_of_the_papers_logits():
    q, k, v = qkv()
    w, beta = transforms()
    weights = (paper_logits(q, k, w, beta, 0) / math.sqrt(D)).softmax(-1)
    out = attention(q, k, v, PaTH(H, 12, D), householder=(w, beta), backend="reference")
    torch.testing.assert_close(out, weights @ v, rtol=1e-12, atol=1e-12)


def test_every_beta_at_zero_is_nope():
    q, k, v = qkv()
    w, _ = transforms()
    beta = torch.zeros(B, H, N, dtype=torch.float64)
    torch.testing.assert_close(path_logits(q, k, w, beta).tril(), (q @ k.transpose(-1, -2)).tril(), rtol=0, atol=1e-13)
    path = PaTH(H, 12, D)
    for backend in ("reference", "sdpa"):
        torch.testing.assert_close(attention(q, k, v, path, householder=(w, beta), backend=backend),
                                   attention(q, k, v, None, backend="reference"), rtol=1e-12, atol=1e-12)


def test_a_model_whose_gates_are_shut_is_the_nope_model():
    """Gates' biases at -1e4: every beta is 0 in float32, and the PaTH model gives the NoPE model's logits."""
    torch.manual_seed(0)
    path = GPT(GPTConfig(encoding="path", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    nope = GPT(GPTConfig(encoding="nope", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    nope.load_state_dict({k: v for k, v in path.state_dict().items() if not k.startswith("encoding.")})
    with torch.no_grad():
        for layer in (path.encoding, *path.encoding.later):
            layer.gate_bias.fill_(-1e4)
        idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        assert float(path.encoding.householder(torch.randn(2, 12, 32))[1].max()) == 0.0
        torch.testing.assert_close(path(idx), nope(idx), rtol=0, atol=1e-6)
        path.encoding.gate_bias.fill_(0.0)  # beta near 1: no longer NoPE (at the small start, by a little)
        assert (path(idx) - nope(idx)).abs().max() > 1e-4


def test_fixed_transforms_give_a_score_of_the_distance_alone():
    """The same ``w, beta`` at every token: ``q_i^T H^(i-j) k_j`` (against the matrix power), so the same query and
    key at any two positions the same distance apart score the same -- a relative encoding, like RoPE's."""
    n = 9
    g = torch.Generator().manual_seed(3)
    w1 = F.normalize(torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64), dim=-1)
    for b in (0.4, 1.3, 2.0):
        w, beta = w1.expand(1, 1, n, D), torch.full((1, 1, n), b, dtype=torch.float64)
        Hm = torch.eye(D, dtype=torch.float64) - b * torch.outer(w1.flatten(), w1.flatten())
        q, k, _ = qkv(b=1, h=1, n=n, seed=4)
        s = path_logits(q, k, w, beta)
        for i in range(n):
            for j in range(i + 1):
                expected = q[0, 0, i] @ torch.linalg.matrix_power(Hm, i - j) @ k[0, 0, j]
                torch.testing.assert_close(s[0, 0, i, j], expected, rtol=1e-12, atol=1e-12)
        same = path_logits(q[:, :, :1].expand(1, 1, n, D), k[:, :, :1].expand(1, 1, n, D), w, beta)
        for distance in range(n):
            diagonal = same[0, 0].diagonal(-distance)
            torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-12, atol=1e-12)


def transform_matrix(betas, seed=5):
    """The package's accumulated transform between a key at row 0 and the query at row ``len(betas)``, read back as a
    matrix: entry ``(a, c)`` is the logit of the query ``e_a`` and the key ``e_c`` (basis vectors)."""
    steps = len(betas)
    g = torch.Generator().manual_seed(seed)
    w = F.normalize(torch.randn(1, 1, steps + 1, D, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.tensor([[[0.0, *betas]]], dtype=torch.float64)
    eye = torch.eye(D, dtype=torch.float64)
    matrix = torch.zeros(D, D, dtype=torch.float64)
    for a in range(D):
        for c in range(D):
            keys = torch.zeros(1, 1, steps + 1, D, dtype=torch.float64)
            keys[0, 0, 0] = eye[c]
            matrix[a, c] = path_logits(eye[a].view(1, 1, 1, D), keys, w, beta, offset=steps)[0, 0, 0, 0]
    return matrix


def test_each_transform_is_a_reflection_at_beta_two_and_two_make_a_rotation():
    """Orthogonal with determinant -1 at beta = 2 (a reflection); two in a row: orthogonal with determinant +1 (a
    rotation); at beta = 1 a projection (idempotent, not orthogonal)."""
    eye = torch.eye(D, dtype=torch.float64)
    reflection = transform_matrix([2.0])
    torch.testing.assert_close(reflection @ reflection.T, eye, rtol=0, atol=1e-12)
    assert torch.linalg.det(reflection).item() == pytest.approx(-1.0)
    rotation = transform_matrix([2.0, 2.0])
    torch.testing.assert_close(rotation @ rotation.T, eye, rtol=0, atol=1e-12)
    assert torch.linalg.det(rotation).item() == pytest.approx(1.0)
    projection = transform_matrix([1.0])
    assert (projection @ projection.T - eye).abs().max() > 0.1
    torch.testing.assert_close(projection @ projection, projection, rtol=0, atol=1e-12)


def test_a_later_token_changes_no_earlier_output():
    q, k, v = qkv(dtype=torch.float32)
    w, beta = transforms(dtype=torch.float32)
    path = PaTH(H, 12, D)
    before = attention(q, k, v, path, householder=(w, beta))
    q2, k2, v2, w2, beta2 = (t.clone() for t in (q, k, v, w, beta))
    for t in (q2, k2, v2):
        t[:, :, 6:] = torch.randn_like(t[:, :, 6:])
    w2[:, :, 6:] = F.normalize(torch.randn_like(w2[:, :, 6:]), dim=-1)
    beta2[:, :, 6:] = 2 - beta2[:, :, 6:]
    after = attention(q2, k2, v2, path, householder=(w2, beta2))
    torch.testing.assert_close(after[:, :, :6], before[:, :, :6], rtol=0, atol=0)
    assert (after[:, :, 6:] - before[:, :, 6:]).abs().max() > 1e-3


def test_the_transforms_read_from_the_input_are_unit_vectors_and_gates_in_zero_two():
    """``w = normalize(U V x)``, ``beta = 2 sigmoid(a . x + c)``, written out in float64 token by token."""
    path = PaTH(2, 12, 6, rank=5)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    with torch.no_grad():
        path.gate_bias.copy_(torch.tensor([0.3, -0.7]))
    w, beta = path.householder(x)
    for bi in range(2):
        for t in range(7):
            low = path.down.double() @ x[bi, t]
            for h in range(2):
                u = path.up[h].double() @ low
                torch.testing.assert_close(w[bi, h, t], u / u.norm(), rtol=1e-12, atol=1e-12)
                gate = path.gate[h].double() @ x[bi, t] + path.gate_bias[h].double()
                torch.testing.assert_close(beta[bi, h, t], 2 / (1 + torch.exp(-gate)), rtol=1e-12, atol=1e-12)
    assert torch.allclose(w.norm(dim=-1), torch.ones(2, 2, 7, dtype=torch.float64))
    assert ((beta > 0) & (beta < 2)).all()
    again = householder_vectors(x, path.down, path.up, path.gate, path.gate_bias)
    assert all(torch.equal(a, b) for a, b in zip(again, (w, beta)))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("options", [{}, {"reach": 4}, {"positions": torch.arange(N) + 50}, {"grouped": True},
                                     {"real_keys": True}], ids=["plain", "reach", "offset", "grouped", "padded"])
def test_every_backend_equals_reference(backend, options):
    options = dict(options)
    q, k, v = qkv(dtype=torch.float32, n=N)
    w, beta = transforms(dtype=torch.float32)
    if options.pop("grouped", False):
        k, v = k[:, :1], v[:, :1]
    if options.pop("real_keys", False):
        options["real_keys"] = torch.ones(B, N, dtype=torch.bool)
        options["real_keys"][1, :2] = False
    path = PaTH(H, 12, D)
    with torch.no_grad():
        ref = attention(q, k, v, path, householder=(w, beta), backend="reference", **options)
        got = attention(q, k, v, path, householder=(w, beta), backend=backend, **options)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_sdpa_gradients_match_the_reference_past_one_block():
    from posenc_lab.backends import kernels

    n = kernels.GRAD_BLOCK + 21
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float32, n=n, h=2, d=8))
    w, beta = (t.requires_grad_() for t in transforms(dtype=torch.float32, n=n, h=2, d=8))
    path = PaTH(2, 16, 8)
    out = attention(q, k, v, path, householder=(w, beta), backend="sdpa")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, w, beta))
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v, w, beta)]
    ref = attention(*inputs64[:3], path, householder=tuple(inputs64[3:]), backend="reference")
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("pieces", [[1] * N, [4, 1, 1, 4]], ids=["token-by-token", "prefill-then-steps"])
def test_a_cache_fed_piece_by_piece_equals_one_pass(pieces):
    q, k, v = qkv(dtype=torch.float32)
    w, beta = transforms(dtype=torch.float32)
    path, cache, outputs, start = PaTH(H, 12, D), KVCache(), [], 0
    for size in pieces:
        part = slice(start, start + size)
        outputs.append(attention(q[:, :, part], k[:, :, part], v[:, :, part], path, cache=cache,
                                 householder=(w[:, :, part], beta[:, :, part])))
        start += size
    torch.testing.assert_close(torch.cat(outputs, dim=2),
                               attention(q, k, v, path, householder=(w, beta), backend="reference"),
                               rtol=1e-5, atol=1e-5)
    assert cache.householder[0].shape == (B, H, N, D)


def sharp_path_model() -> GPT:
    """A two-layer PaTH model whose reflections are far from the identity: ``w`` scaled away from its small start
    (its direction matters, not its length) and the gates' biases spread, so every position's transform differs."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="path", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    with torch.no_grad():
        for layer in (model.encoding, *model.encoding.later):
            layer.gate_bias.normal_(0.0, 1.0)
            layer.up.mul_(50.0)
    return model


def test_the_model_generates_the_same_with_and_without_a_cache():
    model = sharp_path_model()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    same_with_and_without_cache(model, prompt, 20)


def test_what_cannot_be_served_is_refused_in_one_sentence():
    q, k, v = qkv(dtype=torch.float32)
    w, beta = transforms(dtype=torch.float32)
    path = PaTH(H, 12, D)
    cases = [
        (dict(), r"^encoding 'path' reads the layer's input: pass householder=encoding.householder\(x\)"),
        (dict(householder=(w[:, :, :3], beta)), r"^householder must be \(w, beta\) of shapes"),
        (dict(householder=(w, beta), causal=False), "no non-causal form"),
        (dict(householder=(w, beta), cache=SinkCache(window=4)), "^a sink cache drops tokens"),
        (dict(householder=(w, beta), chunk=4), "attention within chunks is not available"),
    ]
    for options, message in cases:
        with pytest.raises(PosencError, match=message) as err:
            attention(q, k, v, path, **options)
        assert "\n" not in str(err.value)
    with pytest.raises(PosencError, match=r"^PaTH cannot be called on one tensor: call attention\(q, k, v"):
        path(torch.randn(1, 2, 7, 4))
    cache = KVCache()
    attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], None, cache=cache)
    with pytest.raises(PosencError, match="from the first token on"):
        attention(q[:, :, 2:4], k[:, :, 2:4], v[:, :, 2:4], path, cache=cache,
                  householder=(w[:, :, 2:4], beta[:, :, 2:4]))


def test_registered_as_a_variant_of_rope_with_its_own_transforms_in_every_layer():
    from posenc_lab.encodings import ENCODINGS, PRIMARY

    assert ENCODINGS["path"] is PaTH and "path" not in PRIMARY and PaTH.variant_of == "rope"
    enc = make_encoding("path", d_model=32, num_heads=4, n_layer=3, rank=8)
    assert enc.up.shape == (4, 8, 8) and len(enc.later) == 2 and enc.for_layer(2, 3) is enc.later[1]
    with pytest.raises(PosencError, match="build it with n_layer=4"):
        enc.for_layer(0, 4)


def test_the_diagnostics_recompute_each_layers_path_weights():
    """:func:`diagnostics.attention_weights` reads each layer's transforms: its weights times the values are the
    layer's attention."""
    from einops import rearrange

    from posenc_lab.lab.measure import diagnostics

    model = sharp_path_model()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    for i, (block, w, x) in enumerate(zip(model.blocks, diagnostics.attention_weights(model, idx),
                                          diagnostics._layer_inputs(model, idx))):
        enc = model.encoding.for_layer(i, 2)
        q, k, v = rearrange(block.attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=2)
        with torch.no_grad():
            want = attention(q, k, v, enc, backend="reference", householder=enc.householder(x))
            plain = attention(q, k, v, None, backend="reference")
        torch.testing.assert_close(w @ v.detach(), want, rtol=1e-5, atol=1e-5)
        assert (want - plain).abs().max() > 1e-4  # the transforms matter (small weights at the start: a little)


# --------------------------------------------------------------------------------------------- PaTH-FoX


def test_path_fox_logits_are_the_product_plus_the_gates_sum_both_divided_by_sqrt_d():
    """``(q_i^T H_i ... H_{j+1} k_j + sum_{l=j+1}^{i} log f_l) / sqrt(d)``, the gates ``f_l = sigmoid(w_f . x_l +
    b_f)``, written out token by token in float64, against every backend."""
    from posenc_lab import PaTHFoX

    enc = PaTHFoX(H, 12, D)
    with torch.no_grad():
        enc.w_f.normal_(0.0, 0.5)
        enc.b_f.normal_(1.0, 0.5)
    x = torch.randn(B, N, 12, dtype=torch.float64)
    q, k, v = qkv()
    with torch.no_grad():
        w, beta = enc.householder(x)
    w_f, b_f = enc.w_f.detach().double(), enc.b_f.detach().double()
    log_f = torch.zeros(B, H, N, dtype=torch.float64)
    for bi in range(B):
        for h in range(H):
            for t in range(N):
                log_f[bi, h, t] = math.log(1 / (1 + math.exp(-float(w_f[h] @ x[bi, t] + b_f[h]))))
    sums = log_f.cumsum(-1)
    expected = ((paper_logits(q, k, w, beta, 0) + sums[..., :, None] - sums[..., None, :]) / math.sqrt(D)).softmax(-1)
    with torch.no_grad():
        inputs = {"householder": (w, beta), "decay": enc.decay(x)}  # FoX's gates are float32 (log_forget)
    torch.testing.assert_close(inputs["decay"].double(), log_f / math.sqrt(D), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(attention(q, k, v, enc, backend="reference", **inputs), expected @ v,
                               rtol=1e-6, atol=1e-6)
    for backend in ("sdpa", "flex"):
        got = attention(q.float(), k.float(), v.float(), enc, backend=backend,
                        **{name: tuple(t.float() for t in value) if isinstance(value, tuple) else value.float()
                           for name, value in inputs.items()})
        torch.testing.assert_close(got.double(), expected @ v, rtol=1e-5, atol=1e-5)
    with pytest.raises(PosencError, match="pass decay=encoding.decay"):
        attention(q, k, v, enc, householder=(w, beta))


def test_path_fox_generates_the_same_with_and_without_a_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="path-fox", n_layer=2, n_head=2, d_model=32, train_len=16)).eval()
    with torch.no_grad():
        for layer in (model.encoding, *model.encoding.later):
            layer.up.mul_(50.0)
            layer.b_f.normal_(0.0, 1.0)
    assert all(layer.has_decay for layer in (model.encoding, *model.encoding.later))
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    same_with_and_without_cache(model, prompt, 20)


def test_the_block_matrix_is_the_same_with_and_without_gradients():
    """The blocked logits assemble their block pairs one way under autograd and another without it: the same
    numbers, the later key blocks zero, and the blocked form equals the walk either way."""
    from posenc_lab.encodings.householder import path_logits, path_logits_blocked

    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64), torch.randn(2, 3, 37, 8, generator=g,
                                                                                     dtype=torch.float64)
    w = torch.nn.functional.normalize(torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(2, 3, 37, generator=g, dtype=torch.float64)
    with torch.no_grad():
        quiet = path_logits_blocked(q, k, w, beta, block=4)
    traced = path_logits_blocked(q.requires_grad_(), k, w, beta, block=4)
    assert traced.requires_grad
    torch.testing.assert_close(quiet, traced.detach(), rtol=0, atol=0)
    torch.testing.assert_close(quiet, path_logits(q.detach(), k, w, beta), rtol=1e-12, atol=1e-12)
    assert (quiet.triu(1) == 0).all()
