"""A researcher's check of posenc_lab, written apart from its tests: Hugging Face RoPE dicts, grouped-query attention,
a padded batch and decoding with a key/value cache, each answer compared with a plain float64 computation written
out below (no posenc_lab function in it).

    python scripts/researcher_check.py        # one line per check; exit status 1 if any fails

The configs are those of a Llama 3.1 (``rope_parameters``, transformers 5) and of a Qwen2.5 with YaRN
(``rope_scaling`` and ``rope_theta`` apart, transformers 4), scaled down to a few heads. The batch has a row padded
on the left, as ``generate`` pads it, with Hugging Face's ``position_ids = cumsum(attention_mask) - 1``; decoding
uses one row of positions for the batch (a ``KVCache`` keeps one), which RoPE allows: its scores read only the
distance between two positions, so shifting a row's positions changes nothing.
"""

from __future__ import annotations

import math
import sys

import torch

import posenc_lab as pl

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # grouped-query: 4 query heads share each key/value head
D_MODEL = 256
CONFIGS = {
    "llama3.1": dict(rope=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=8192),
                     max_position_embeddings=131072, extra={}),
    "qwen2.5-yarn": dict(rope=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
                         max_position_embeddings=131072, extra=dict(rope_theta=1000000.0)),
}
TOKENS, PROMPT = 12, 7
PADS = (3, 0)  # row 0 has three pads on the left
START = 40000  # the check's positions begin here: past the original context of both configs
TOL = 2e-5  # float32 activations against float64


# --------------------------------------------------------------------------------------------- the plain computation


def plain_inv_freq(rope: dict, theta: float) -> tuple[list[float], float]:
    """The scaled frequencies and attention factor, written out from the two papers' recipes in float64."""
    d = HEAD_DIM
    freqs = [theta ** (-2 * i / d) for i in range(d // 2)]
    kind = rope.get("rope_type") or rope.get("type")
    s, original = rope["factor"], rope["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = original / rope["low_freq_factor"], original / rope["high_freq_factor"]
        out = []
        for f in freqs:
            wavelength = 2 * math.pi / f
            if wavelength < high:
                out.append(f)
            elif wavelength > low:
                out.append(f / s)
            else:
                g = (original / wavelength - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
                out.append((1 - g) * f / s + g * f)
        return out, 1.0
    # YaRN, the released code's ramp: over the pair index between the pairs making 32 and 1 turns in the original
    def pair_making(turns):
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(pair_making(32)), 0), min(math.ceil(pair_making(1)), d - 1)
    out = []
    for i, f in enumerate(freqs):
        kept = 1 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1: as trained; 0: divided by s
        out.append(f / s * (1 - kept) + f * kept)
    return out, 0.1 * math.log(s) + 1


def plain_rotate(x: torch.Tensor, positions: torch.Tensor, freqs: list[float], factor: float) -> torch.Tensor:
    """Pair ``i`` is ``(x[i], x[i + d/2])`` (Llama's rotate_half), turned by ``p * theta_i``, times the factor."""
    x = x.double()
    angles = positions.double()[..., None] * torch.tensor(freqs, dtype=torch.float64)  # b n d/2
    cos, sin = (torch.cat([t, t], dim=-1)[:, None] * factor for t in (angles.cos(), angles.sin()))  # b 1 n d
    half = x.shape[-1] // 2
    swapped = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * sin


def plain_attention(q, k, v, q_pos, k_pos, real_keys, freqs, factor) -> torch.Tensor:
    """softmax(q k / sqrt(d)) v over the real keys at or before each query, every key head serving a group of
    query heads; a query that sees no real key gives zeros."""
    q, k = plain_rotate(q, q_pos, freqs, factor), plain_rotate(k, k_pos, freqs, factor)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # b h i j
    nq, nk = q.shape[2], k.shape[2]
    causal = torch.arange(nk)[None, :] <= torch.arange(nk - nq, nk)[:, None]  # i j
    seen = causal[None, None] & real_keys[:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.where(seen.any(-1, keepdim=True), scores.softmax(-1), torch.zeros_like(scores))
    return weights.nan_to_num(0.0) @ v


# --------------------------------------------------------------------------------------------- the checks


def main() -> int:
    torch.manual_seed(0)
    failures = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")

    x = torch.randn(2, TOKENS, D_MODEL)
    w_q, w_k, w_v = (torch.randn(D_MODEL, n * HEAD_DIM) / D_MODEL ** 0.5 for n in (HEADS, KV_HEADS, KV_HEADS))
    q = (x @ w_q).view(2, TOKENS, HEADS, HEAD_DIM).transpose(1, 2)  # b h n d
    k = (x @ w_k).view(2, TOKENS, KV_HEADS, HEAD_DIM).transpose(1, 2)  # b h_kv n d
    v = (x @ w_v).view(2, TOKENS, KV_HEADS, HEAD_DIM).transpose(1, 2)
    real = torch.ones(2, TOKENS, dtype=torch.bool)
    for row, pads in enumerate(PADS):
        real[row, :pads] = False
    hf_positions = START + (real.long().cumsum(-1) - 1).clamp(min=0)  # Hugging Face's position_ids, pads at START
    shared = START + torch.arange(TOKENS)  # one row of positions for the cache

    for name, config in CONFIGS.items():
        enc = pl.rope_from_hf(config["rope"], HEAD_DIM, max_position_embeddings=config["max_position_embeddings"],
                              **config["extra"])
        theta = config["extra"].get("rope_theta", config["rope"].get("rope_theta"))
        freqs, factor = plain_inv_freq(config["rope"], theta)
        ours, our_factor = enc.frequencies()
        error = (ours - torch.tensor(freqs, dtype=torch.float64)).abs().div(torch.tensor(freqs)).max().item()
        check(f"{name} frequencies", error < 1e-12 and abs(our_factor - factor) < 1e-12,
              f"largest relative difference {error:.1e}, attention factor {our_factor:.6f} (plain {factor:.6f})")

        expected = plain_attention(q, k, v, hf_positions, hf_positions, real, freqs, factor)
        for backend in ("reference", "sdpa") + (("flex",) if pl.backends.flex_available(torch.device("cpu")) else ()):
            out = pl.attention(q, k, v, enc, backend=backend, positions=hf_positions, real_keys=real)
            error = (out.double() - expected).abs().max().item()
            check(f"{name} padded batch, grouped-query, {backend}", error < TOL and not out.isnan().any(),
                  f"largest difference {error:.1e} from the plain float64 attention")
        padded_out = pl.attention(q, k, v, enc, positions=hf_positions, real_keys=real)
        check(f"{name} padded queries", bool((padded_out[0, :, :PADS[0]] == 0).all()),
              "a query before its row's first real token gives zeros")

        cache = pl.KVCache()
        steps = [pl.attention(q[:, :, :PROMPT], k[:, :, :PROMPT], v[:, :, :PROMPT], enc, cache=cache,
                              positions=shared[:PROMPT], real_keys=real[:, :PROMPT])]
        for t in range(PROMPT, TOKENS):  # one token at a time, the mask growing with the cache
            steps.append(pl.attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], enc, cache=cache,
                                      real_keys=real[:, :t + 1]))
        decoded = torch.cat(steps, dim=2)
        error = (decoded.double() - expected).abs().max().item()
        check(f"{name} decoding with a KVCache", error < TOL and len(cache) == TOKENS,
              f"largest difference {error:.1e} from the plain attention at Hugging Face's positions "
              f"({len(cache)} keys cached)")

    try:
        pl.rope_from_hf({"rope_type": "su"}, HEAD_DIM, max_position_embeddings=4096)
        check("an unknown rope_type", False, "accepted")
    except pl.PosencError as err:
        check("an unknown rope_type", "\n" not in str(err) and "longrope" in str(err), f"refused: {err}")
    print(f"{'all checks passed' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
