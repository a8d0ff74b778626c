"""The tables a forward pass shares (``Encoding.tables``) are built from the encoding as it is now.

Nothing outlives a forward pass unless its caller owns it (an evaluation's ``masks``, tested at the end); every
way a user can change what the answer depends on is seen at once: parameter writes by each route (``.data``, ``vector_to_parameters``,
``load_state_dict``, an optimizer step), new parameters, ``functional_call`` with fresh weights,
positions edited in place, attributes set directly, ``set_scaling``, dtype round trips, inference
and grad mode. Each test compares with a fresh copy of the encoding (or a freshly built model)
through the ``reference`` backend.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posenc_lab import ENCODINGS, PosencError, attention, make_encoding
from posenc_lab.backends import KVCache, bias_tensor

H, D, N, TRAIN_LEN = 4, 8, 12, 8

#: every encoding with state the attention backends read (RoPE's in its attributes), by its options
KINDS = {
    "rope": {},
    "rope/pi": {"scaling": "pi", "factor": 2.0},
    "rope/ntk": {"scaling": "ntk"},
    "rope/dynamic-ntk": {"scaling": "dynamic-ntk"},
    "rope/yarn": {"scaling": "yarn", "factor": 2.0},
    "xpos": {},
    "alibi": {},
    "t5": {},
    "kerple": {},
    "fire": {},
}

#: attributes a user may set directly: (module path, attribute, value); a callable value edits a tensor in place
ATTRIBUTES = {
    "rope": [("", "base", 500.0), ("", "base", 10000.0), ("", "train_len", 4), ("", "layout", "interleaved"),
             ("", "layout", "half")],
    "xpos": [("", "scale_base", 64.0), ("", "gamma", 0.2), ("", "layout", "interleaved"),
             ("", "freqs", lambda t: t.mul_(2)), ("", "freqs", lambda t: t.data.mul_(0.5))],
    "alibi": [("", "slopes", lambda t: t.mul_(2)), ("", "slopes", lambda t: t.data.mul_(0.25)),
              ("", "slopes", torch.linspace(0.1, 0.9, H))],
    "t5": [("table", "max_distance", 20), ("table", "max_distance", 128), ("table", "bidirectional", True),
           ("table", "bidirectional", False)],
    "kerple": [],
    "fire": [("fire", "CHUNK", 64)],
}
EXTRA_ROPE = {  # factors and forms a RoPE strategy accepts when set directly
    "pi": [("", "factor", 4.0), ("", "factor", None)],
    "ntk": [("", "factor", 4.0), ("", "factor", None)],
    "yarn": [("", "factor", 4.0), ("", "factor", None), ("", "scaling_options", lambda d: d.update(beta_fast=4.0))],
    "dynamic-ntk": [("", "dynamic", "sequence"), ("", "dynamic", "cache")],
    "none": [],
}


class Attend(nn.Module):
    """The encoding behind a module's ``forward``, for ``torch.func.functional_call``."""

    def __init__(self, enc):
        super().__init__()
        self.enc = enc

    def forward(self, q, k, v, positions, backend):
        return attention(q, k, v, self.enc, backend=backend, positions=positions)


def build(kind: str):
    name = kind.split("/")[0]
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=TRAIN_LEN, **KINDS[kind])
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # learned parameters away from their (often zero) initialisation
        for p in enc.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return enc


def fresh(enc):
    """A copy of ``enc`` in its current state."""
    return copy.deepcopy(enc)


def close(got, want, what, tol=1e-5):
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def qkv(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, D, generator=g) for _ in range(3)]


def stale(enc, positions=None, backend="sdpa"):
    """The largest difference between ``enc``'s answer now and a fresh copy's ``reference`` answer."""
    q, k, v = qkv()
    with torch.no_grad():
        got = attention(q, k, v, enc, backend=backend, positions=positions)
        want = attention(q, k, v, fresh(enc), backend="reference",
                         positions=None if positions is None else positions.clone())
    return (got - want).abs().max().item()


@pytest.mark.parametrize("route", ["data_mul", "data_assign", "vector_to_parameters", "half_float"])
@pytest.mark.parametrize("name", ["t5", "kerple", "fire"])
def test_writes_through_data_are_seen(name, route):
    """Writes that bypass the version counter (``.data``, ``vector_to_parameters``, a dtype round trip)."""
    enc = build(name)
    assert stale(enc) < 1e-5
    params = list(enc.parameters())
    if route == "data_mul":
        params[0].data.mul_(-1)
    elif route == "data_assign":
        params[0].data = -params[0].data
    elif route == "vector_to_parameters":
        vector_to_parameters(-parameters_to_vector(params).detach(), params)
    else:
        enc.half().float()
    assert stale(enc) < 1e-5


def test_a_new_parameter_or_fresh_weights_are_never_a_false_hit():
    """A new parameter object, or fresh weights through ``functional_call``, are what the next call reads."""
    enc = build("t5")
    shape = enc.table.table.shape
    for _ in range(20):
        assert stale(enc) < 1e-5
        enc.table.table = nn.Parameter(torch.randn(shape))  # the one the last call read is freed here ...
        enc.table.table = nn.Parameter(torch.randn(shape))  # ... and its address may be taken by this one
    q, k, v = qkv()
    weights, outputs = [], []
    with torch.no_grad():
        for _ in range(10):  # fresh weights each call, freed right after it
            w = torch.randn(shape)
            outputs.append(torch.func.functional_call(Attend(enc), {"enc.table.table": w}, (q, k, v, None, "sdpa")))
            weights.append(w.clone())
            del w
        for w, got in zip(weights, outputs):
            ref = fresh(enc)
            ref.table.table.copy_(w)
            torch.testing.assert_close(got, attention(q, k, v, ref, backend="reference"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("name", ["alibi", "rope", "fire"])
def test_positions_edited_in_place_are_seen(name, backend):
    """Positions edited in place are read as they are now."""
    enc, positions = build(name), torch.arange(N)
    assert stale(enc, positions, backend) < 1e-5
    positions.mul_(3)
    assert stale(enc, positions, backend) < 1e-5
    positions.data.add_(5)  # not even a version bump
    assert stale(enc, positions, backend) < 1e-5


def test_bias_tensor_is_the_callers_to_edit():
    """Editing what ``bias_tensor`` returns changes neither the next call nor the ``sdpa`` backend."""
    enc, positions = build("alibi"), torch.arange(N)
    first = bias_tensor(enc, positions, causal=True)
    first.add_(1.0)
    torch.testing.assert_close(bias_tensor(enc, positions, causal=True), first - 1.0)
    assert stale(enc, positions) < 1e-5


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float32])
def test_unsigned_or_non_integer_positions_are_one_clear_error(dtype):
    """Unsigned positions would wrap around in ``-distances``; they are refused in one sentence."""
    q, k, v = qkv()
    positions = torch.arange(N).to(dtype)
    for name in ("t5", "alibi", "rope"):
        with pytest.raises(PosencError, match="positions must be signed integers"):
            attention(q, k, v, build(name), backend="reference", positions=positions)
    with pytest.raises(PosencError, match="positions must be signed integers"):
        build("t5").bias(positions, positions)


def test_narrow_signed_positions_do_not_overflow():
    """Distances are taken in int64, so int8 positions far apart give the right bias."""
    enc = build("alibi")
    positions = torch.tensor([-100, 0, 100], dtype=torch.int8)
    torch.testing.assert_close(enc.bias(positions, positions), enc.bias(positions.long(), positions.long()))


@pytest.mark.parametrize("change", ["rope.base", "rope.factor", "rope.scaling_options", "t5.max_distance",
                                    "alibi.slopes", "xpos.scale_base"])
def test_attributes_set_directly_are_seen(change):
    """Every plain attribute (of submodules too) and every buffer set directly is read by the next call."""
    name = change.split(".")[0]
    enc = build(name) if name != "rope" else make_encoding("rope", d_model=H * D, num_heads=H, train_len=256,
                                                          scaling="yarn", factor=2.0)
    positions = torch.arange(0, 10 * N, 10)  # distances past T5's exact buckets
    assert stale(enc, positions) < 1e-5
    if change == "rope.base":
        enc.base = 500.0
    elif change == "rope.factor":
        enc.factor = 4.0
    elif change == "rope.scaling_options":
        enc.scaling_options["beta_fast"] = 4.0  # a dict edited in place
    elif change == "t5.max_distance":
        enc.table.max_distance = 20
    elif change == "alibi.slopes":
        enc.slopes.mul_(2)
    else:
        enc.scale_base = 8.0
    assert stale(enc, positions) < 1e-5


@pytest.mark.parametrize("name", ["alibi", "rope", "t5"])
def test_a_call_in_inference_mode_does_not_break_a_later_training_step(name):
    """A call in inference mode leaves nothing behind that a later backward pass could meet."""
    enc = build(name)
    q, k, v = qkv()
    with torch.inference_mode():
        attention(q, k, v, enc, backend="sdpa")
    q = q.clone().requires_grad_()
    attention(q, k, v, enc, backend="sdpa").sum().backward()
    assert q.grad is not None


def test_two_training_steps_on_one_positions_tensor_build_two_graphs():
    """The same positions tensor in two training steps: the second builds its own graph."""
    enc, positions = build("t5"), torch.arange(N)
    q, k, v = qkv()
    for _ in range(2):
        attention(q, k, v, enc, backend="sdpa", positions=positions).sum().backward()
    assert enc.table.table.grad is not None


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple"])
def test_compiled_attention_with_a_cache_matches_the_reference(name):
    """Under ``torch.compile`` the bias is built pairwise (no table sized from values it cannot read)."""
    torch._dynamo.reset()
    enc = build(name)
    q, k, v = qkv()
    step = torch.compile(lambda q, k, v, cache: attention(q, k, v, enc, backend="sdpa", cache=cache), backend="eager")
    cache = KVCache()
    with torch.no_grad():
        outs = [step(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache)]
        outs += [step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache) for i in range(4, 7)]
        want = attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], fresh(enc), backend="reference")
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["no_grad", "grad", "inference"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_backend_and_mode_equals_a_fresh_reference(kind, backend, mode):
    """Output, and under gradients the gradients of the queries and of every parameter, as a fresh copy's."""
    if backend == "flex" and mode == "grad":  # FlexAttention has no backward on the CPU
        return
    enc, (q, k, v), w = build(kind), qkv(), qkv(seed=1)[0]
    ref = fresh(enc)
    context = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "inference": torch.inference_mode}[mode]
    grads = []
    for e, b in ((enc, backend), (ref, "reference")):
        query = q.clone().requires_grad_(mode == "grad")
        with context():
            out = attention(query, k, v, e, backend=b, positions=torch.arange(N))
            if mode == "grad":
                (out * w).sum().backward()
        grads.append((out.detach(), query.grad, [p.grad for p in e.parameters()]))
    (got, got_q, got_p), (want, want_q, want_p) = grads
    close(got, want, f"{backend} output under {mode}")
    if mode == "grad":
        close(got_q, want_q, "gradient of the queries", tol=1e-4)
        for a, b in zip(got_p, want_p):
            assert (a is None) == (b is None)
            if a is not None:
                close(a, b, "gradient of a parameter", tol=1e-4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_attributes_set_one_after_another_are_each_seen(kind):
    """Every attribute a user may set directly, in turn, with a call between: each call equals a fresh copy's."""
    enc, name = build(kind), kind.split("/")[0]
    choices = ATTRIBUTES[name] + (EXTRA_ROPE[enc.scaling] if name == "rope" else [])
    positions = torch.arange(0, 3 * N, 3)
    for path, attr, value in choices:
        module = enc.get_submodule(path)
        if callable(value):
            value(getattr(module, attr))
        else:
            setattr(module, attr, value.clone() if isinstance(value, torch.Tensor) else value)
        for backend in ("sdpa", "reference"):
            assert stale(enc, positions, backend) < 1e-5, (path, attr)


def gpt(name, **options):
    from posenc_lab.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(encoding=name, n_layer=2, n_head=H, d_model=H * D, train_len=TRAIN_LEN,
                         encoding_options=options)).eval()


IDS = torch.randint(0, 256, (2, 3 * TRAIN_LEN), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("scaling", ["pi", "ntk", "dynamic-ntk", "yarn"])
def test_set_scaling_equals_a_model_built_with_that_scaling(scaling):
    model = gpt("rope")
    with torch.no_grad():
        plain = model(IDS)
        model.encoding.set_scaling(scaling)
        scaled = model(IDS)
        torch.testing.assert_close(scaled, gpt("rope", scaling=scaling)(IDS))
        assert not torch.equal(scaled, plain)
        model.encoding.set_scaling("none")
        torch.testing.assert_close(model(IDS), plain)


@pytest.mark.parametrize("route", ["load_state_dict", "data", "no_grad_inplace"])
@pytest.mark.parametrize("name", ["t5", "kerple", "fire", "learned"])
def test_a_model_with_new_encoding_weights_equals_one_built_with_them(name, route):
    """After a forward pass, the encoding's weights change by one route; the next pass equals a fresh model's."""
    model, ids = gpt(name), IDS[:, :TRAIN_LEN]
    with torch.no_grad():
        before = model(ids)
    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in model.encoding.state_dict().items()
           if t.is_floating_point()}
    if route == "load_state_dict":
        model.encoding.load_state_dict(new, strict=False)
    else:
        for n, p in model.encoding.named_parameters():
            if route == "data":
                p.data.copy_(new[n])
            else:
                with torch.no_grad():
                    p.copy_(new[n])
    want = gpt(name)
    want.load_state_dict(model.state_dict())
    with torch.no_grad():
        after = model(ids)
        torch.testing.assert_close(after, want(ids))
    assert not torch.equal(after, before)


# --------------------------------------------------------------------------------------------- an evaluation's masks


def _counting_builds(monkeypatch) -> list:
    from posenc_lab.backends import masks

    calls, build = [], masks.bias_block
    monkeypatch.setattr(masks, "bias_block", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    return calls


@pytest.mark.parametrize("name", ["alibi", "t5", "fire"])
def test_masks_owned_by_the_caller_are_built_once_for_every_pass_at_the_same_positions(name, monkeypatch):
    """Window after window at the same positions with one ``masks`` dict: the first forward pass builds the mask,
    the next ones reuse it; the outputs equal those of passes that build everything afresh."""
    model, calls = gpt(name).eval(), _counting_builds(monkeypatch)
    ids = IDS[:, :TRAIN_LEN]
    masks = {}
    with torch.no_grad():
        first = model(ids, masks=masks)
        again = model(ids, masks=masks)
        assert len(calls) == 1
        fresh = model(ids)
    assert len(calls) == 2
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(fresh, first, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["t5", "fire"])
def test_without_masks_every_pass_builds_its_own_and_sees_new_weights(name, monkeypatch):
    """No mask outlives a forward pass that was not handed a dict: a weight changed between two passes is read by
    the second."""
    model, calls = gpt(name).eval(), _counting_builds(monkeypatch)
    ids = IDS[:, :TRAIN_LEN]
    with torch.no_grad():
        before = model(ids)
        for p in model.encoding.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
        after = model(ids)
    assert len(calls) == 2 and not torch.equal(before, after)


def test_masks_across_passes_are_refused_in_training_under_gradients_or_with_a_cache():
    model, ids = gpt("t5"), IDS[:, :TRAIN_LEN]
    with pytest.raises(PosencError, match="for evaluation"), torch.no_grad():
        model.train()(ids, masks={})
    with pytest.raises(PosencError, match="for evaluation"):
        model.eval()(ids, masks={})
    with pytest.raises(PosencError, match="for evaluation"), torch.no_grad():
        model(ids, masks={}, cache=model.new_cache())


@pytest.mark.parametrize("name", ["alibi", "fire"])
def test_an_evaluation_builds_the_masks_of_its_length_once(name, monkeypatch):
    """``evaluate`` over eight windows of one length: one build, and the losses of passes that build afresh."""
    from posenc_lab.lab.measure.perplexity import evaluate

    model, calls = gpt(name).eval(), _counting_builds(monkeypatch)
    stream = torch.randint(0, 256, (8 * 32 + 1,), generator=torch.Generator().manual_seed(5))
    result = evaluate(model, stream, length=32, tokens=8 * 32, batch_size=2)
    assert len(calls) == 1
    with torch.no_grad():
        windows = stream[:-1].view(8, 32), stream[1:].view(8, 32)
        want = model.token_losses(*windows).double().mean().item()
    assert result["loss"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_every_encoding_takes_an_evaluations_masks(name):
    """Every encoding's ``tables`` takes the caller's ``masks``: two passes handed one dict equal a pass without."""
    model, ids = gpt(name).eval(), IDS[:, :TRAIN_LEN]
    with torch.no_grad():
        masks = {}
        first, again, alone = model(ids, masks=masks), model(ids, masks=masks), model(ids)
    torch.testing.assert_close(first, alone, rtol=0, atol=0)
    torch.testing.assert_close(again, alone, rtol=0, atol=0)
