"""The memoised masks and tables (``Encoding.memo``, chapter 11) never serve a stale answer (issue 22).

A stateful property test drives an encoding through random sequences of attention calls on every
CPU backend, interleaved with every way a user can change what the answer depends on: parameter
writes by each route (``.data``, ``vector_to_parameters``, ``load_state_dict``, in place under
``no_grad``), new parameters, ``functional_call`` with fresh weights, positions edited in place,
attributes set directly, dtype round trips, inference and grad mode. Every output is compared with
a fresh copy of the encoding (nothing memoised) through the ``reference`` backend. Below it, one
small regression test per item of the issue.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posenc_lab import PosencError, attention, make_encoding
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
    """A copy of ``enc`` in its current state, with nothing memoised."""
    clone = copy.deepcopy(enc)
    clone.clear_cache()
    return clone


def close(got, want, what, tol=1e-5):
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


class MemoMachine(RuleBasedStateMachine):
    kind = "t5"

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed):
        self.enc = build(self.kind)
        g = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v, self.w = (torch.randn(1, H, N, D, generator=g) for _ in range(4))
        self.pos = torch.arange(N)

    # ------------------------------------------------------------------------------------ calls

    def expected(self, positions, grad=False, enc=None):
        ref = fresh(self.enc if enc is None else enc)
        q = self.q.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = attention(q, self.k, self.v, ref, backend="reference", positions=positions.clone())
            if grad:
                (out * self.w).sum().backward()
        return out.detach(), q.grad, {n: p.grad for n, p in ref.named_parameters()}

    @rule(backend=st.sampled_from(["reference", "sdpa", "flex"]), mode=st.sampled_from(["no_grad", "grad", "inference"]))
    def call(self, backend, mode):
        if backend == "flex" and mode == "grad":  # FlexAttention has no backward on the CPU
            backend = "sdpa"
        q = self.q.clone().requires_grad_(mode == "grad")
        for p in self.enc.parameters():
            p.grad = None
        context = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "inference": torch.inference_mode}[mode]
        with context():
            out = attention(q, self.k, self.v, self.enc, backend=backend, positions=self.pos)
            if mode == "grad":
                (out * self.w).sum().backward()
        want, q_grad, grads = self.expected(self.pos, grad=mode == "grad")
        close(out.detach(), want, f"{backend} output under {mode}")
        if mode == "grad":
            close(q.grad, q_grad, "gradient of the queries", tol=1e-4)
            for name, p in self.enc.named_parameters():
                if grads[name] is None or p.grad is None:
                    assert grads[name] is None and p.grad is None, f"gradient of {name}: one is missing"
                else:
                    close(p.grad, grads[name], f"gradient of {name}", tol=1e-4)

    @rule(backend=st.sampled_from(["reference", "sdpa"]), scale=st.floats(-2, 2), grad=st.booleans())
    def call_functional(self, backend, scale, grad):
        """``functional_call`` with fresh weights, three times (issue 22, item 2)."""
        for i in range(3):
            weights = {f"enc.{n}": (p.detach() * (scale + i)).requires_grad_(grad) for n, p in self.enc.named_parameters()}
            with torch.set_grad_enabled(grad):
                out = torch.func.functional_call(Attend(self.enc), weights, (self.q, self.k, self.v, self.pos, backend))
                if grad and weights:
                    (out * self.w).sum().backward()
            ref = fresh(self.enc)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p.copy_(weights[f"enc.{n}"])
            want, _, grads = self.expected(self.pos, grad=grad, enc=ref)
            close(out.detach(), want, "functional_call output")
            if grad:
                for n in grads:
                    if grads[n] is not None:
                        close(weights[f"enc.{n}"].grad, grads[n], f"functional_call gradient of {n}", tol=1e-4)

    @precondition(lambda self: self.enc.cacheable)
    @rule(backend=st.sampled_from(["reference", "sdpa", "flex"]), split=st.integers(1, N - 1))
    def call_with_cache(self, backend, split):
        cache = KVCache()
        with torch.no_grad():
            attention(self.q[:, :, :split], self.k[:, :, :split], self.v[:, :, :split], self.enc, backend=backend,
                      positions=self.pos[:split], cache=cache)
            out = attention(self.q[:, :, split:], self.k[:, :, split:], self.v[:, :, split:], self.enc,
                            backend=backend, positions=self.pos[split:], cache=cache)
        close(out, self.expected(self.pos)[0][:, :, split:], f"{backend} with a key/value cache")

    @precondition(lambda self: self.enc.has_bias)
    @rule()
    def edit_bias_tensor(self):
        """What ``bias_tensor`` hands out is the caller's: editing it changes nothing memoised (item 4)."""
        with torch.no_grad():
            b = bias_tensor(self.enc, self.pos, causal=True)
            close(b, bias_tensor(fresh(self.enc), self.pos.clone(), causal=True), "bias_tensor")
            b.add_(1.0)

    # ------------------------------------------------------------------------------------ changes

    def parameter(self, index):
        named = list(self.enc.named_parameters())
        return named[index % len(named)] if named else (None, None)

    @precondition(lambda self: any(True for _ in self.enc.parameters()))
    @rule(route=st.sampled_from(["data_mul", "data_assign", "vector_to_parameters", "no_grad_inplace",
                                 "load_state_dict", "replace_parameter"]),
          index=st.integers(0, 7), factor=st.sampled_from([-1.0, 0.5, 1.0, 1.5]))
    def write_parameter(self, route, index, factor):
        name, p = self.parameter(index)
        if route == "data_mul":
            p.data.mul_(factor).add_(0.01)
        elif route == "data_assign":
            p.data = p.data * factor + 0.01
        elif route == "vector_to_parameters":
            params = list(self.enc.parameters())
            vector_to_parameters(parameters_to_vector(params).detach() * factor + 0.01, params)
        elif route == "no_grad_inplace":
            with torch.no_grad():
                p.mul_(factor).add_(0.01)
        elif route == "load_state_dict":
            self.enc.load_state_dict({n: t * factor + 0.01 for n, t in self.enc.state_dict().items()})
        else:  # a new parameter object, possibly with the same values
            owner, _, attr = name.rpartition(".")
            setattr(self.enc.get_submodule(owner), attr, nn.Parameter(p.detach() * factor,
                                                                       requires_grad=p.requires_grad))

    @rule(dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float64]))
    def dtype_round_trip(self, dtype):
        self.enc.to(dtype).float()

    @precondition(lambda self: any(True for _ in self.enc.parameters()))
    @rule(flag=st.booleans())
    def requires_grad(self, flag):
        for p in self.enc.parameters():
            p.requires_grad_(flag)

    @rule(op=st.sampled_from(["add_", "mul_", "data_add", "data_mul", "tail", "new_offset", "new_strided", "reset"]))
    def edit_positions(self, op):
        pos = self.pos
        if op == "add_":
            pos.add_(7)
        elif op == "mul_":
            pos.mul_(3)
        elif op == "data_add":
            pos.data.add_(5)
        elif op == "data_mul":
            pos.data.mul_(2)
        elif op == "tail":  # no longer consecutive: the gathered (not Toeplitz) path
            pos[N // 2:] += 5
        elif op == "new_offset":
            self.pos = torch.arange(N) + 40
        elif op == "new_strided":
            self.pos = torch.arange(0, 2 * N, 2)
        else:
            pos.copy_(torch.arange(N))
        if int(self.pos.max()) > 3000:  # keep xPos's powers finite in float32
            self.pos = torch.arange(N)

    @rule(data=st.data())
    def set_attribute(self, data):
        name = self.kind.split("/")[0]
        choices = ATTRIBUTES[name] + (EXTRA_ROPE[self.enc.scaling] if name == "rope" else [])
        if not choices:
            return
        path, attr, value = data.draw(st.sampled_from(choices))
        module = self.enc.get_submodule(path)
        if callable(value):
            value(getattr(module, attr))
        else:
            setattr(module, attr, value.clone() if isinstance(value, torch.Tensor) else value)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_memo_never_serves_a_stale_answer(kind):
    """Random calls and changes; every output equals a fresh encoding's ``reference`` output (<= 1e-5)."""
    machine = type(f"MemoMachine_{kind}", (MemoMachine,), {"kind": kind})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=30, stateful_step_count=20, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


# ---------------------------------------------------------------------------------------- one test per item of issue 22


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
    """Item 1: writes that bypass the version counter (``.data``, ``vector_to_parameters``, a dtype round trip)."""
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
    """Item 2: the key holds the parameters themselves (weakly) and their values, not an ``id`` that a new tensor
    can take over once the old one is freed."""
    enc = build("t5")
    shape = enc.table.table.shape
    for _ in range(20):
        assert stale(enc) < 1e-5
        enc.table.table = nn.Parameter(torch.randn(shape))  # the one the memo saw is freed here ...
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
    """Item 3: the positions' values are compared, not only their identity."""
    enc, positions = build(name), torch.arange(N)
    assert stale(enc, positions, backend) < 1e-5
    positions.mul_(3)
    assert stale(enc, positions, backend) < 1e-5
    positions.data.add_(5)  # not even a version bump
    assert stale(enc, positions, backend) < 1e-5


def test_bias_tensor_is_a_copy_of_the_memoised_mask():
    """Item 4: editing what ``bias_tensor`` returns changes neither the next call nor the ``sdpa`` backend."""
    enc, positions = build("alibi"), torch.arange(N)
    first = bias_tensor(enc, positions, causal=True)
    first.add_(1.0)
    torch.testing.assert_close(bias_tensor(enc, positions, causal=True), first - 1.0)
    assert stale(enc, positions) < 1e-5


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float32])
def test_unsigned_or_non_integer_positions_are_one_clear_error(dtype):
    """Item 5: unsigned positions would wrap around in ``-distances``; they are refused in one sentence."""
    q, k, v = qkv()
    positions = torch.arange(N).to(dtype)
    for name in ("t5", "alibi", "rope"):
        with pytest.raises(PosencError, match="positions must be signed integers"):
            attention(q, k, v, build(name), backend="reference", positions=positions)
    with pytest.raises(PosencError, match="positions must be signed integers"):
        build("t5").bias(positions, positions)


def test_narrow_signed_positions_do_not_overflow():
    """Item 5: distances are taken in int64, so int8 positions far apart give the right bias."""
    enc = build("alibi")
    positions = torch.tensor([-100, 0, 100], dtype=torch.int8)
    torch.testing.assert_close(enc.bias(positions, positions), enc.bias(positions.long(), positions.long()))


@pytest.mark.parametrize("change", ["rope.base", "rope.factor", "rope.scaling_options", "t5.max_distance",
                                    "alibi.slopes", "xpos.scale_base"])
def test_attributes_set_directly_are_seen(change):
    """Item 6: every plain attribute (of submodules too) and every buffer is part of the key."""
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
def test_an_entry_made_in_inference_mode_is_not_reused_in_training(name):
    """Item 7: inference mode is part of the key, so the backward pass never meets an inference tensor."""
    enc = build(name)
    q, k, v = qkv()
    with torch.inference_mode():
        attention(q, k, v, enc, backend="sdpa")
    q = q.clone().requires_grad_()
    attention(q, k, v, enc, backend="sdpa").sum().backward()
    assert q.grad is not None


def test_a_graph_is_never_reused_after_its_backward_pass():
    """The same positions tensor in two training steps: the second builds its own graph."""
    enc, positions = build("t5"), torch.arange(N)
    q, k, v = qkv()
    for _ in range(2):
        attention(q, k, v, enc, backend="sdpa", positions=positions).sum().backward()
    assert enc.table.table.grad is not None


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple"])
def test_compiled_attention_with_a_cache_matches_the_reference(name):
    """Item 8: under ``torch.compile`` the bias is built pairwise (no table sized from values it cannot read)."""
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
