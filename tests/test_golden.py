"""The package's RoPE against Hugging Face transformers: every RoPE type by its name, through :func:`rope_from_hf`.

``tests/data/hf_rope_golden.json`` is written by ``scripts/hf_rope_golden.py`` on a machine with transformers; the
golden tests only read it, so they need neither transformers nor a network. Each case holds transformers' inputs (a
small Llama config, its RoPE dict as transformers standardised it, and the current length handed to ``dynamic`` and
``longrope``) and its ``inv_freq`` and ``attention_factor``. transformers computes in float32, the package in
float64: they agree to float32's rounding. Where transformers is installed, the last tests compare with it live,
rotations included.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from posenc_lab import HF_ROPE_TYPES, PosencError, make_encoding, rope, rope_from_hf

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "hf_rope_golden.json"
RTOL = 2e-6  # a few float32 ulps


def _load() -> dict:
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.relative_to(ROOT)} is absent: run scripts/hf_rope_golden.py where transformers is "
                    "installed", allow_module_level=True)
    return json.loads(GOLDEN.read_text())


DOCUMENT = _load()
CASES = DOCUMENT["cases"]
STYLES = ("rope_parameters", "rope_scaling")


def hf_encoding(case: dict, style: str):
    """The case's RoPE through :func:`rope_from_hf`, from the dict as transformers 5 keeps it (``rope_parameters``:
    theta and partial rotary inside) or as a 4.x config holds it (``rope_scaling``: the type's keys alone, theta and
    partial rotary as arguments)."""
    shape = dict(max_position_embeddings=case["max_position_embeddings"])
    if style == "rope_parameters":
        return rope_from_hf(case["rope_parameters"], case["head_dim"], **shape)
    scaling = None if case["rope_type"] == "default" else {"type": case["rope_type"], **case["params"]}
    return rope_from_hf(scaling, case["head_dim"], rope_theta=case["rope_theta"],
                        partial_rotary_factor=case["partial_rotary_factor"], **shape)


def test_golden_file_covers_every_type_and_setting():
    assert DOCUMENT["transformers_version"]
    assert {c["rope_type"] for c in CASES} == set(HF_ROPE_TYPES)
    assert any(c["partial_rotary_factor"] < 1 for c in CASES)
    yarn = [c["params"] for c in CASES if c["rope_type"] == "yarn"]
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast"):
        assert any(key in p for p in yarn), key
    assert any(p.get("truncate") is False for p in yarn) and any(p.get("factor") is None for p in yarn)
    longrope = [c for c in CASES if c["rope_type"] == "longrope"]
    original = 512
    assert {c["seq_len"] is not None and c["seq_len"] > original for c in longrope if c["max_position_embeddings"] == 4096
            and c["rope_parameters"]["original_max_position_embeddings"] == original} == {True, False}
    assert {c["params"]["factor"] for c in CASES if c["rope_type"] == "dynamic"} >= {1.0, 2.0, 4.0}
    assert len({c["seq_len"] for c in CASES if c["rope_type"] == "dynamic"}) >= 5
    assert len([c for c in CASES if c["rope_type"] == "llama3"]) >= 4


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_rope_from_hf_gives_hugging_faces_frequencies(case, style):
    """Every golden case, through the one constructor, from either form of the config's dict: transformers'
    ``inv_freq`` and ``attention_factor`` at the case's length (its initialisation length when none)."""
    enc = hf_encoding(case, style)
    freqs, factor = enc.frequencies(case["seq_len"])
    expected = torch.tensor(case["inv_freq"], dtype=torch.float64)
    assert freqs.shape == expected.shape and enc.rotary_dim == 2 * len(case["inv_freq"])
    torch.testing.assert_close(freqs, expected, rtol=RTOL, atol=0)
    assert math.isclose(factor, case["attention_factor"], rel_tol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if (c["seq_len"] or 0) <= 8192], ids=lambda c: c["name"])
def test_the_rotation_uses_those_frequencies_at_the_sequences_length(case):
    """``cos_sin`` over positions ``0 .. n-1`` reads the length ``n`` where the type does (dynamic, longrope) and
    rotates with :meth:`RoPE.frequencies` at ``n``, the attention factor included."""
    enc = hf_encoding(case, "rope_parameters")
    n = case["seq_len"] or enc.train_len
    positions = torch.arange(n)
    freqs, factor = enc.frequencies(n)
    cos, sin = enc.cos_sin(positions, torch.float64)
    angles = positions[:, None].double() * freqs
    torch.testing.assert_close(cos, angles.cos() * factor, rtol=0, atol=1e-12)
    torch.testing.assert_close(sin, angles.sin() * factor, rtol=0, atol=1e-12)


def test_longrope_switches_to_its_long_factors_past_the_original_length():
    case = next(c for c in CASES if c["name"] == "longrope-2048")
    enc = hf_encoding(case, "rope_parameters")
    base = rope.inv_freq(enc.rotary_dim, enc.base)
    short, long = (torch.tensor(case["params"][k], dtype=torch.float64) for k in ("short_factor", "long_factor"))
    torch.testing.assert_close(enc.frequencies(512)[0], base / short)
    torch.testing.assert_close(enc.frequencies(513)[0], base / long)
    assert not enc.cacheable  # the choice changes the rotation of keys already cached


def test_dynamic_factor_is_the_slope_of_the_ntk_factor():
    """Hugging Face's ``dynamic`` with ``factor = k``: ``s = k n / L - (k - 1)`` past ``L``, 1 up to it."""
    assert rope.dynamic_ntk_factor(512, 512, 2.0) == 1.0 and rope.dynamic_ntk_factor(256, 512, 4.0) == 1.0
    assert rope.dynamic_ntk_factor(1024, 512, 2.0) == 3.0 and rope.dynamic_ntk_factor(2048, 512, 1.0) == 4.0
    enc = rope_from_hf({"rope_type": "dynamic", "factor": 2.0}, 64, max_position_embeddings=512, dynamic="cache")
    angles = rope.dynamic_ntk_angles(torch.arange(2048), 64, train_len=512, slope=2.0)
    torch.testing.assert_close(enc.cos_sin(torch.arange(2048), torch.float64)[0], angles.cos())
    torch.testing.assert_close(angles[-1] / 2047, enc.frequencies(2048)[0])  # the last position: the length's base


def test_yarn_truncate_false_keeps_the_ramps_fractional_bounds():
    truncated = rope.yarn_ramp(64, 150000.0, 4096)
    exact = rope.yarn_ramp(64, 150000.0, 4096, truncate=False)
    lo, hi = (rope.yarn_pair_making(t, 64, 150000.0, 4096) for t in (32.0, 1.0))
    index = torch.arange(32, dtype=torch.float64)
    torch.testing.assert_close(exact, 1 - ((index - max(lo, 0)) / (min(hi, 63) - max(lo, 0))).clamp(0, 1))
    assert not torch.equal(truncated, exact)


def test_yarn_mscale_ratio_is_deepseeks_attention_factor():
    assert rope.yarn_mscale_ratio(40.0, 0.707, 0.707) == 1.0 and rope.yarn_mscale_ratio(1.0, 1.0, 0.5) == 1.0
    s = 40.0
    assert math.isclose(rope.yarn_mscale_ratio(s, 1.0, 0.8), (0.1 * math.log(s) + 1) / (0.08 * math.log(s) + 1))


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "su"}, r"^unknown Hugging Face rope_type 'su'; valid Hugging Face rope_types: default, dynamic, "
                          r"linear, llama3, longrope, yarn$"),
    ({"rope_type": "proportional", "rope_theta": 1e4}, r"^unknown Hugging Face rope_type 'proportional'; valid .*yarn$"),
    ({"rope_type": "yarn"}, r"^Hugging Face rope_type 'yarn' needs the keys factor; missing: factor$"),
    ({"type": "llama3", "factor": 8.0}, r"^Hugging Face rope_type 'llama3' needs the keys factor, high_freq_factor, "
                                        r"low_freq_factor; missing: high_freq_factor, low_freq_factor$"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32}, r"needs the keys long_factor, short_factor; missing: "
                                                            r"long_factor$"),
    ({"rope_type": "linear", "factor": 2.0, "mrope_section": [8, 8]}, r"^Hugging Face rope_type 'linear' does not read "
                                                                      r"the keys mrope_section; its keys: factor, .*"),
    ({"rope_type": "yarn", "type": "linear", "factor": 2.0}, r"^the RoPE dict names two types"),
    ({"rope_type": "default", "rope_theta": 5e5}, r"^rope_theta is 500000.0 in the RoPE dict but 10000.0 as an "
                                                  r"argument: pass one of them$"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3},
     r"^LongRoPE needs short_factor: a list of 32 positive numbers .*got 3 values$"),
    ({"rope_type": "dynamic", "factor": -1.0}, r"slope \(Hugging Face's factor\) must be a positive number, got -1.0$"),
])
def test_a_bad_rope_dict_is_one_line_naming_what_is_allowed(params, match):
    with pytest.raises(PosencError, match=match) as err:
        rope_from_hf(params, 64, max_position_embeddings=512, rope_theta=10000.0)
    assert "\n" not in str(err.value)


def test_phi3s_original_length_beside_the_dict_wins():
    """Phi-3 keeps ``original_max_position_embeddings`` as a config attribute; transformers prefers it."""
    params = {"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
              "original_max_position_embeddings": 999}
    enc = rope_from_hf(params, 64, max_position_embeddings=8192, original_max_position_embeddings=4096)
    assert enc.train_len == 4096 and math.isclose(enc.frequencies()[1], math.sqrt(1 + math.log(2) / math.log(4096)))


@pytest.mark.parametrize("case", [c for c in CASES if c["partial_rotary_factor"] < 1 and c["rope_type"] == "default"],
                         ids=lambda c: c["name"])
def test_partial_rotary_encoding_turns_like_hugging_face(case):
    """The ``rope-partial`` encoding rotates its first coordinates with Hugging Face's partial-rotary angles."""
    enc = make_encoding("rope-partial", head_dim=case["head_dim"], train_len=case["max_position_embeddings"],
                        fraction=case["partial_rotary_factor"], base=case["rope_theta"])
    positions = torch.arange(0, 300, 7)
    cos, sin = enc.cos_sin(positions, torch.float64)
    angles = positions[:, None].double() * torch.tensor(case["inv_freq"], dtype=torch.float64)
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-4)  # float32 frequencies times positions
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------- live, where installed


def _script():
    spec = importlib.util.spec_from_file_location("hf_rope_golden", ROOT / "scripts" / "hf_rope_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LIVE = [c for c in CASES if c["max_position_embeddings"] <= 20480 and (c["seq_len"] or 0) <= 4096]


@pytest.mark.parametrize("case", LIVE, ids=[c["name"] for c in LIVE])
def test_rope_from_hf_matches_the_installed_transformers(case):
    """The installed transformers' own initialisation function, not the stored vectors: the same frequencies; and,
    for full rotary, its Llama rotary embedding and ``apply_rotary_pos_emb`` at positions ``(1, n)`` rotate ``q`` and
    ``k`` as the package does."""
    pytest.importorskip("transformers")
    from transformers import modeling_rope_utils as rope_utils
    from transformers.models.llama import modeling_llama

    script = _script()
    new_api = script._new_config_api(rope_utils)
    config = script.make_config(case["rope_type"], case["head_dim"], case["rope_theta"], case["partial_rotary_factor"],
                                case["max_position_embeddings"], json.loads(json.dumps(case["params"])), new_api)
    hf_freqs, hf_factor = script.init_function(case["rope_type"], rope_utils)(config, torch.device("cpu"),
                                                                              seq_len=case["seq_len"])
    enc = hf_encoding(case, "rope_parameters")
    freqs, factor = enc.frequencies(case["seq_len"])
    torch.testing.assert_close(freqs, hf_freqs.double(), rtol=RTOL, atol=0)
    assert math.isclose(factor, hf_factor, rel_tol=1e-6)
    if case["partial_rotary_factor"] < 1:
        return  # Llama's attention rotates the whole head; partial rotary is checked by its frequencies above
    n = case["seq_len"] or min(enc.train_len, 1024)
    positions = torch.arange(n)[None]  # Hugging Face's position_ids: (1, n)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, n, case["head_dim"], generator=g) for _ in range(2))
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(q, positions)
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = enc.rotate(q, k, positions)
    tol = 2e-5 * n ** 0.5 + 1e-5  # transformers' float32 angles
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=tol)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=tol)
