"""Golden RoPE vectors from Hugging Face transformers, for tests/test_golden.py.

Run once, on a machine with ``transformers`` installed (4.45 or later, 5.x included)::

    python scripts/hf_rope_golden.py            # writes tests/data/hf_rope_golden.json
    python scripts/hf_rope_golden.py --out x.json

For every RoPE type of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` that posenc_lab implements
(``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``) in a spread of settings (YaRN's
``attention_factor``, ``mscale``, ``mscale_all_dim`` and ``truncate``; LongRoPE below and above its original
length; dynamic at several lengths and factors; Llama 3's thresholds), and for partial rotary
(``partial_rotary_factor``), it builds a small ``LlamaConfig`` and stores the ``inv_freq`` and
``attention_factor`` that transformers' own initialisation function returns. The package is not imported:
the JSON holds transformers' inputs and outputs only, and the test maps each case onto the package.

The JSON format::

    {"transformers_version": "5.25.0", "torch_version": "...", "cases": [
        {"name": "yarn", "rope_type": "yarn", "head_dim": 64, "rope_theta": 10000.0,
         "partial_rotary_factor": 1.0, "max_position_embeddings": 512,
         "params": {"factor": 4.0}, "seq_len": null,
         "rope_parameters": {...},            # the config's RoPE dict after transformers standardised it
         "inv_freq": [...], "attention_factor": 1.1386...}, ...]}

``params`` are the type's own parameters as passed (``rope_type``, ``rope_theta`` and
``partial_rotary_factor`` are fields of their own); ``seq_len`` is the current length handed to
``dynamic`` and ``longrope`` (null: the initialisation value).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_rope_golden.json"
HEADS = 4

# (name, rope_type, head_dim, rope_theta, partial_rotary_factor, max_position_embeddings, params, seq_len);
# yarn, longrope and llama3 read original_max_position_embeddings from params (transformers sets it to the config's
# max_position_embeddings when absent), and transformers expects max_position_embeddings above it (Llama 3.1: 8192
# and 131072)


def _longrope_factors(pairs: int) -> dict:
    """A short and a long factor per pair, shaped like Phi-3's (short near 1, long rising to a few dozen)."""
    return {"short_factor": [round(1.0 + 0.08 * (i / (pairs - 1)) ** 2, 6) for i in range(pairs)],
            "long_factor": [round(1.0 + 40.0 * (i / (pairs - 1)) ** 3, 6) for i in range(pairs)]}


LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
LONG = {"original_max_position_embeddings": 512, **_longrope_factors(32)}
CASES = [
    ("default", "default", 64, 10000.0, 1.0, 512, {}, None),
    ("default-theta-500k", "default", 128, 500000.0, 1.0, 8192, {}, None),
    ("linear", "linear", 64, 10000.0, 1.0, 512, {"factor": 4.0}, None),
    *[(f"dynamic-{n or 'init'}", "dynamic", 64, 10000.0, 1.0, 512, {"factor": 1.0}, n)
      for n in (None, 256, 512, 1024, 2048, 4096)],
    *[(f"dynamic-factor-{k:g}-{n or 'init'}", "dynamic", 64, 10000.0, 1.0, 512, {"factor": k}, n)
      for k in (2.0, 4.0) for n in (None, 256, 513, 1024, 4096)],
    ("yarn", "yarn", 64, 10000.0, 1.0, 512, {"factor": 4.0}, None),
    ("yarn-factor-16", "yarn", 64, 10000.0, 1.0, 512, {"factor": 16.0}, None),
    ("yarn-betas", "yarn", 64, 10000.0, 1.0, 512, {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0}, None),
    ("yarn-attention-factor", "yarn", 64, 10000.0, 1.0, 512, {"factor": 4.0, "attention_factor": 1.5}, None),
    ("yarn-original", "yarn", 128, 1000000.0, 1.0, 131072, {"factor": 4.0, "original_max_position_embeddings": 32768},
     None),
    ("yarn-factor-from-lengths", "yarn", 64, 10000.0, 1.0, 2048,
     {"factor": None, "original_max_position_embeddings": 512}, None),
    ("yarn-mscale", "yarn", 64, 10000.0, 1.0, 20480,
     {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 512}, None),
    ("yarn-mscale-deepseek", "yarn", 64, 10000.0, 1.0, 163840,
     {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
      "original_max_position_embeddings": 4096}, None),
    ("yarn-mscale-alone", "yarn", 64, 10000.0, 1.0, 2048,
     {"factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 512}, None),
    ("yarn-attention-factor-and-mscale", "yarn", 64, 10000.0, 1.0, 2048,
     {"factor": 4.0, "attention_factor": 1.2, "mscale": 1.0, "mscale_all_dim": 0.5,
      "original_max_position_embeddings": 512}, None),
    ("yarn-truncate-false", "yarn", 64, 150000.0, 1.0, 131072,
     {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
     None),
    ("yarn-truncate-true", "yarn", 64, 150000.0, 1.0, 131072,
     {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 4096},
     None),
    ("yarn-truncate-false-betas", "yarn", 64, 10000.0, 1.0, 2048,
     {"factor": 4.0, "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False, "original_max_position_embeddings": 512},
     None),
    *[(f"longrope-{n or 'init'}", "longrope", 64, 10000.0, 1.0, 4096, LONG, n) for n in (None, 256, 512, 513, 2048)],
    ("longrope-factor", "longrope", 64, 10000.0, 1.0, 4096, {"factor": 2.0, **LONG}, 1024),
    ("longrope-attention-factor", "longrope", 64, 10000.0, 1.0, 4096, {"attention_factor": 1.25, **LONG}, 2048),
    ("longrope-phi3-theta", "longrope", 96, 10000.0, 1.0, 131072,
     {"original_max_position_embeddings": 4096, **_longrope_factors(48)}, 8192),
    ("llama3", "llama3", 64, 10000.0, 1.0, 2048, LLAMA3, None),
    ("llama3-meta", "llama3", 128, 500000.0, 1.0, 131072,
     {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, None),
    ("llama3-low-high", "llama3", 64, 10000.0, 1.0, 16384,
     {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 1024}, None),
    ("llama3-factor-32", "llama3", 128, 500000.0, 1.0, 131072,
     {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}, None),
    ("partial-default", "default", 64, 10000.0, 0.5, 512, {}, None),
    ("partial-linear", "linear", 64, 10000.0, 0.5, 512, {"factor": 4.0}, None),
    ("partial-dynamic-2048", "dynamic", 64, 10000.0, 0.5, 512, {"factor": 1.0}, 2048),
    ("partial-dynamic-factor-2-2048", "dynamic", 64, 10000.0, 0.5, 512, {"factor": 2.0}, 2048),
    ("partial-yarn", "yarn", 64, 10000.0, 0.5, 512, {"factor": 4.0}, None),
    ("partial-yarn-truncate-false", "yarn", 64, 10000.0, 0.5, 2048,
     {"factor": 4.0, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 512},
     None),
    *[(f"partial-longrope-{n}", "longrope", 64, 10000.0, 0.5, 4096,
       {"original_max_position_embeddings": 512, **_longrope_factors(16)}, n) for n in (300, 3000)],
    ("partial-llama3", "llama3", 64, 10000.0, 0.25, 2048, LLAMA3, None),
    ("partial-llama3-0.75", "llama3", 64, 10000.0, 0.75, 2048, LLAMA3, None),
]


def _new_config_api(rope_utils) -> bool:
    """transformers >= 5 (and late 4.x) keep every RoPE setting in ``config.rope_parameters``."""
    return hasattr(rope_utils, "RotaryEmbeddingConfigMixin")


def make_config(rope_type, head_dim, theta, partial, max_pos, params, new_api):
    """A small LlamaConfig carrying the case's RoPE settings, in the form this transformers version reads."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=head_dim * HEADS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                 head_dim=head_dim, max_position_embeddings=max_pos, num_hidden_layers=1,
                 intermediate_size=2 * head_dim * HEADS, vocab_size=32)
    if new_api:
        rope_parameters = {"rope_type": rope_type, "rope_theta": theta, **params}
        if partial != 1.0:
            rope_parameters["partial_rotary_factor"] = partial
        return LlamaConfig(**shape, rope_parameters=rope_parameters)
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **params}
    config = LlamaConfig(**shape, rope_theta=theta, rope_scaling=scaling)
    if partial != 1.0:
        config.partial_rotary_factor = partial  # 4.x reads it as a config attribute
    return config


def init_function(rope_type, rope_utils):
    """transformers' own function for ``rope_type``; "default" moved out of the registry in 5.x into each model's
    rotary class (GPT-NeoX's honours partial_rotary_factor, as the 4.x registry entry did)."""
    if rope_type in rope_utils.ROPE_INIT_FUNCTIONS:
        return rope_utils.ROPE_INIT_FUNCTIONS[rope_type]
    if rope_type == "default":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters
    raise KeyError(f"transformers {rope_utils.__name__} has no RoPE type {rope_type!r}")


def _plain(value):
    """``value`` as JSON: tensors and numbers as floats, dicts and lists element by element."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def golden_case(case, rope_utils, new_api) -> dict:
    import torch

    name, rope_type, head_dim, theta, partial, max_pos, params, seq_len = case
    config = make_config(rope_type, head_dim, theta, partial, max_pos, dict(params), new_api)
    fn = init_function(rope_type, rope_utils)
    inv_freq, attention_factor = fn(config, torch.device("cpu"), seq_len=seq_len)
    expected_pairs = int(head_dim * partial) // 2
    if inv_freq.shape != (expected_pairs,):
        raise RuntimeError(f"{name}: transformers returned {tuple(inv_freq.shape)} frequencies, "
                           f"expected {expected_pairs}")
    stored = getattr(config, "rope_parameters", None) if new_api else getattr(config, "rope_scaling", None)
    return {
        "name": name, "rope_type": rope_type, "head_dim": head_dim, "rope_theta": theta,
        "partial_rotary_factor": partial, "max_position_embeddings": max_pos, "params": params,
        "seq_len": seq_len, "rope_parameters": _plain(stored or {}),
        "inv_freq": [float(x) for x in inv_freq.detach().to(torch.float64).cpu()],
        "attention_factor": float(attention_factor),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the JSON (default {OUT})")
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
        from transformers import modeling_rope_utils as rope_utils
    except ImportError as err:
        print(f"needs transformers and torch: {err}", file=sys.stderr)
        return 1
    new_api = _new_config_api(rope_utils)
    cases = [golden_case(case, rope_utils, new_api) for case in CASES]
    document = {
        "generated_by": "scripts/hf_rope_golden.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config_api": "rope_parameters" if new_api else "rope_scaling",
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(cases)} cases from transformers {transformers.__version__} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
