"""The package's RoPE frequencies against vectors Hugging Face transformers produced.

``tests/data/hf_rope_golden.json`` is written once by ``scripts/hf_rope_golden.py`` on a machine with
transformers; these tests only read it, so they need neither transformers nor a network. Each case
holds transformers' inputs (a small Llama config) and its ``inv_freq`` and ``attention_factor``;
:func:`package_freqs` says how each Hugging Face RoPE type maps onto a scaling strategy of
:mod:`posenc_lab.rope`. transformers computes in float32, the package in float64: they agree to
float32's rounding.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from posenc_lab import make_encoding, rope

GOLDEN = Path(__file__).parent / "data" / "hf_rope_golden.json"
RTOL = 2e-6  # a few float32 ulps


def _load() -> dict:
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.relative_to(Path(__file__).parents[1])} is absent: run scripts/hf_rope_golden.py "
                    "where transformers is installed", allow_module_level=True)
    return json.loads(GOLDEN.read_text())


DOCUMENT = _load()
CASES = DOCUMENT["cases"]


def package_freqs(case: dict) -> tuple[torch.Tensor, float]:
    """The package's ``(inv_freq, attention_factor)`` for one Hugging Face case.

    ``linear`` is position interpolation (``pi``); ``dynamic`` with ``factor = 1`` is ``dynamic-ntk`` with the
    config's ``max_position_embeddings`` as the training length (transformers never goes below it); ``yarn`` and
    ``llama3`` take their original context (``original_max_position_embeddings``) as ``train_len`` and
    ``original_len``; transformers' ``attention_factor`` is the package's ``mscale``; partial rotary is the
    same formula over the first ``int(head_dim * partial_rotary_factor)`` coordinates.
    """
    kind, p = case["rope_type"], case["params"]
    dim = int(case["head_dim"] * case["partial_rotary_factor"])
    base, max_pos = case["rope_theta"], case["max_position_embeddings"]
    original = case["rope_parameters"].get("original_max_position_embeddings", max_pos)
    if kind == "default":
        return rope.inv_freq(dim, base), 1.0
    if kind == "linear":
        return rope.scaled_inv_freq("pi", dim, base=base, train_len=max_pos, factor=p["factor"])
    if kind == "dynamic":
        assert p["factor"] == 1.0, "only transformers' dynamic with factor 1 is the package's dynamic-ntk"
        return rope.scaled_inv_freq("dynamic-ntk", dim, base=base, train_len=max_pos,
                                    seq_len=max(case["seq_len"] or max_pos, max_pos))
    if kind == "yarn":
        options = {k: p[k] for k in ("beta_fast", "beta_slow") if k in p}
        if "attention_factor" in p:
            options["mscale"] = p["attention_factor"]
        return rope.scaled_inv_freq("yarn", dim, base=base, train_len=original, factor=p["factor"], **options)
    if kind == "llama3":
        return rope.scaled_inv_freq("llama3", dim, base=base, train_len=original, factor=p["factor"],
                                    low_freq_factor=p["low_freq_factor"], high_freq_factor=p["high_freq_factor"],
                                    original_len=p["original_max_position_embeddings"])
    raise AssertionError(f"no mapping for Hugging Face RoPE type {kind!r}")


def test_golden_file_names_its_source():
    assert DOCUMENT["transformers_version"]
    assert {c["rope_type"] for c in CASES} >= {"default", "linear", "dynamic", "yarn", "llama3"}
    assert any(c["partial_rotary_factor"] < 1 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_frequencies_match_hugging_face(case):
    freqs, factor = package_freqs(case)
    expected = torch.tensor(case["inv_freq"], dtype=torch.float64)
    assert freqs.shape == expected.shape
    torch.testing.assert_close(freqs, expected, rtol=RTOL, atol=0)
    assert math.isclose(factor, case["attention_factor"], rel_tol=1e-6)


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
