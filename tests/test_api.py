"""The library as a researcher uses it: the public names, shapes as other libraries pass them, no silent answer."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc_lab as pl
from posenc_lab import ENCODINGS, KVCache, PosencError, attention, bias_tensor, make_encoding, rope
from posenc_lab.lab.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]

H, D, L = 4, 8, 32


def test_every_public_name_is_exported_and_listed_in_the_docstring():
    for name in ("make_encoding", "ENCODINGS", "attention", "bias_tensor", "KVCache", "apply_rope", "scaled_inv_freq",
                 "inv_freq", "ROPE_SCALINGS", "yarn_attention_factor"):
        assert name in pl.__all__ and name in pl.__doc__, name
    for cls in ENCODINGS.values():
        assert getattr(pl, cls.__name__) is cls and cls.__name__ in pl.__doc__


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_make_encoding_takes_head_dim_and_asks_only_for_what_is_used(name):
    shape = {q: {"d_model": H * D, "num_heads": H, "head_dim": D, "train_len": L, "n_layer": 2}[q]
             for q in set(ENCODINGS[name].shape.values())}
    enc = make_encoding(name, **shape)
    assert isinstance(enc, ENCODINGS[name])


def test_make_encoding_names_what_is_missing():
    assert make_encoding("rope", head_dim=64, train_len=512).head_dim == 64
    assert isinstance(make_encoding("alibi", num_heads=8), pl.ALiBi)
    with pytest.raises(PosencError, match=r"^encoding 'rope' needs head_dim \(or d_model and num_heads\)$"):
        make_encoding("rope", train_len=512)
    with pytest.raises(PosencError, match=r"^encoding 't5' needs num_heads$"):
        make_encoding("t5")


@pytest.mark.parametrize("method", [m for m in rope.ROPE_SCALINGS if m != "none"])
def test_scalings_that_need_a_factor_refuse_a_call_without_one(method):
    with pytest.raises(PosencError) as err:
        pl.scaled_inv_freq(method, 64, train_len=512)
    assert "\n" not in str(err.value) and ("factor" in str(err.value) or "seq_len" in str(err.value))


# --------------------------------------------------------------------------------------------- positions (b, n)

def _encoding(name):
    torch.manual_seed(0)
    options = {"max_len": 64} if name in ("learned",) else {}
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L if name != "learned" else 64)
    if name in ("rope-random", "learned-random"):
        enc.eval()
    return enc, options


@settings(max_examples=12, deadline=None)
@given(starts=st.lists(st.integers(0, 20), min_size=2, max_size=3), n=st.integers(1, 6),
       name=st.sampled_from(sorted(ENCODINGS)), scaled=st.booleans())
def test_batch_positions_give_each_row_its_own_answer(starts, n, name, scaled):
    """Positions (b, n), what Hugging Face passes as position_ids, equal attending row by row; with b = h too."""
    b = len(starts) if len(starts) != 3 else H  # b = h is where a wrong broadcast stays silent
    starts = (starts * H)[:b]
    enc, _ = _encoding(name)
    if scaled and isinstance(enc, pl.RoPE) and not isinstance(enc, pl.RandomizedRoPE):
        enc.set_scaling("yarn", None)
    positions = torch.stack([torch.arange(s, s + n) for s in starts])  # b n
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, H, n, D, generator=g) for _ in range(3))
    with torch.no_grad():
        layer_input = torch.randn(b, n, H * D, generator=g)
        decay = enc.decay(layer_input)  # a decay-gated encoding's (FoX), None otherwise
        householder = enc.householder(layer_input)  # PaTH's transforms, None otherwise
        together = attention(q, k, v, enc, backend="reference", positions=positions, decay=decay,
                             householder=householder)
        rows = torch.cat([attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], enc, backend="reference",
                                   positions=positions[i], decay=None if decay is None else decay[i:i + 1],
                                   householder=None if householder is None else tuple(t[i:i + 1] for t in householder))
                          for i in range(b)])
        torch.testing.assert_close(together, rows, rtol=1e-5, atol=1e-6)
        x = torch.randn(b, n, H * D, generator=g)
        torch.testing.assert_close(enc.embed(x, positions), torch.cat([enc.embed(x[i:i + 1], positions[i])
                                                                        for i in range(b)]))
        if enc.has_bias:
            table = bias_tensor(enc, positions, causal=True)
            assert table.shape == (b, H, n, n)
            torch.testing.assert_close(table[1], bias_tensor(enc, positions[1], causal=True))


def test_rope_rotates_each_batch_row_with_its_own_positions():
    enc = make_encoding("rope", head_dim=D, train_len=L)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9], [3, 5, 8], [1, 1, 1]])  # b = 4 = h
    q = torch.randn(4, H, 3, D)
    rotated, _ = enc.rotate(q, q, positions)
    for i in range(4):
        torch.testing.assert_close(rotated[i], enc.rotate(q[i:i + 1], q[i:i + 1], positions[i])[0][0])
    freqs = rope.inv_freq(D)
    torch.testing.assert_close(rope.apply_rope(q, positions, freqs)[2], rope.apply_rope(q[2], positions[2], freqs))


def test_positions_of_another_shape_are_refused_in_one_line():
    q = torch.randn(2, H, 3, D)
    with pytest.raises(PosencError, match=r"positions must have shape \(3,\) or \(2, 3\)"):
        attention(q, q, q, positions=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(PosencError, match="KVCache keeps one row"):
        attention(q, q, q, make_encoding("rope", head_dim=D, train_len=L), cache=KVCache(),
                  positions=torch.tensor([[0, 1, 2], [5, 6, 7]]))


# --------------------------------------------------------------------------------------------- grouped-query attention

BACKENDS_HERE = ["reference", "sdpa"] + (["flex"] if pl.backends.flex_available(torch.device("cpu")) else [])


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "fire", "xpos"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_equals_repeated_keys_and_values(backend, name, kv_heads):
    torch.manual_seed(1)
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L)
    q = torch.randn(2, H, 10, D)
    k, v = torch.randn(2, kv_heads, 10, D), torch.randn(2, kv_heads, 10, D)
    with torch.no_grad():
        grouped = attention(q, k, v, enc, backend=backend)
        repeated = attention(q, pl.repeat_kv(k, H), pl.repeat_kv(v, H), enc, backend=backend)
    torch.testing.assert_close(grouped, repeated)
    assert torch.equal(pl.repeat_kv(k, H)[:, H // kv_heads - 1], k[:, 0])  # query head i reads key head i // group


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_grouped_query_cache_stores_the_key_heads_and_matches_full_attention(name):
    torch.manual_seed(2)
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L)
    q, k, v = torch.randn(1, H, 7, D), torch.randn(1, 1, 7, D), torch.randn(1, 1, 7, D)
    cache = KVCache()
    with torch.no_grad():
        steps = [attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], enc, cache=cache)]
        steps += [attention(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], enc, cache=cache) for i in range(4, 7)]
        full = attention(q, k, v, enc, backend="reference")
    assert cache.k.shape == (1, 1, 7, D)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, rtol=1e-5, atol=1e-6)


def test_grouped_heads_must_divide_the_query_heads():
    q, k = torch.randn(1, H, 3, D), torch.randn(1, 3, 3, D)
    with pytest.raises(PosencError, match="must divide"):
        attention(q, k, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("name", ["rope", "alibi", "xpos", "sinusoidal"])
def test_half_precision_inputs_keep_their_dtype(dtype, backend, name):
    enc = make_encoding(name, d_model=H * D, num_heads=H, train_len=L)
    q, k, v = (torch.randn(2, H, 5, D, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        assert attention(q, k[:, :2], v[:, :2], enc, backend=backend).dtype == dtype
        assert enc.rotate(q, k, torch.arange(5))[0].dtype == dtype
        assert enc.embed(torch.randn(2, 5, H * D, dtype=dtype), torch.arange(5)).dtype == dtype


# --------------------------------------------------------------------------------------------- the command line

def _spec(argv):
    from posenc_lab import __main__ as cli
    from posenc_lab.lab.experiments import language_model

    args = cli.parser().parse_args(argv)
    overrides = language_model.Spec.given(args)
    return language_model.preset(args.preset, **cli._asked(args, language_model.PRESETS[args.preset], overrides))


def test_seeds_apply_to_every_encoding_named():
    spec = _spec(["run", "--preset", "cpu", "--encodings", "rope-partial,kerple,rope", "--seeds", "0,1,2"])
    assert all(spec.seeds_for(name) == (0, 1, 2) for name in spec.encodings)
    both = _spec(["run", "--preset", "cpu", "--seeds", "0,1", "--other-seeds", "5"])
    assert both.seeds_for("rope") == (0, 1) and both.seeds_for("kerple") == (5,)


def test_only_the_asked_modes_are_validated():
    spec = _spec(["run", "--preset", "article-cpu", "--modes", "nonoverlapping", "--eval-lengths", "512,2048"])
    assert spec.evaluation.modes == ("nonoverlapping",) and spec.evaluation.eval_lengths == (512, 2048)
    sliding = _spec(["run", "--preset", "article-cpu", "--eval-lengths", "512,2048"])
    assert sliding.evaluation.sliding == ((512, 256), (2048, 1024))


@pytest.mark.parametrize("module,extra", [("posenc_lab.lab.run.training", "lab"), ("posenc_lab.lab.verdicts.statistics", "lab"),
                                          ("posenc_lab.lab.figures.plots", "figures")])
def test_a_missing_extra_is_one_line_naming_the_install(module, extra):
    """With the extra's modules hidden, importing a lab or book module says which extra to install."""
    hide = "\n".join([
        "import importlib.abc, sys",
        "class Hide(importlib.abc.MetaPathFinder):",
        f"    def find_spec(self, name, path, target=None):",
        f"        if name.split('.')[0] in {EXTRAS[extra]!r}: raise ModuleNotFoundError(name)",
        "sys.meta_path.insert(0, Hide())",
        "import importlib.util",
        "_find = importlib.util.find_spec",
        f"importlib.util.find_spec = lambda n, *a: None if n in {EXTRAS[extra]!r} else _find(n, *a)",
        f"import {module}"])
    result = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, cwd=ROOT)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and f"pip install 'posenc-lab[{extra}]'" in last and "MissingExtra" in last
