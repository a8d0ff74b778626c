"""What each speed lever of the ``sdpa`` backend buys for a bias, one at a time, against no bias in the same run.

    python benchmarks/levers.py --smoke
    python benchmarks/levers.py --json results/benchmarks/cpu-levers.json     # n = 4096, h = 4, d = 32

One attention call (forward, no gradients) of ``b x h x n x d`` with ALiBi's bias, five ways:

* ``no bias, causal``: SDPA's fused causal kernel without any bias (the floor, ratio 1);
* ``3-d mask``: the bias and the causal ``-inf`` as an ``h n n`` float mask (what a first version did);
* ``4-d mask``: the same values as ``1 h n n`` (SDPA's fused CPU kernel takes a 4-d mask);
* ``4-d, query blocks``: the 4-d mask applied block by block of 512 queries, each block with only
  the keys it can see (what the ``sdpa`` backend does past 512 queries);
* ``... + denormals flushed``: the same under ``flush_denormals()`` (as training and evaluation run).

The mask is built once outside the timed call (a model builds it once per forward pass, for all its layers); its build time
is reported separately, with the Toeplitz construction the backend uses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, print_table, write_json  # noqa: E402

import posenc_lab as pl  # noqa: E402
from posenc_lab.backends import BLOCK, bias_block  # noqa: E402
from posenc_lab.lab.run.training import flush_denormals  # noqa: E402


def blocked(q, k, v, mask):
    n = q.shape[-2]
    outs = [F.scaled_dot_product_attention(q[:, :, a : a + BLOCK], k[:, :, : a + BLOCK], v[:, :, : a + BLOCK],
                                           attn_mask=mask[:, :, a : a + BLOCK, : a + BLOCK]) for a in range(0, n, BLOCK)]
    return torch.cat(outs, dim=2)


def run(args) -> dict:
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, args.length, args.head_dim, generator=g) for _ in range(3))
    enc = pl.make_encoding("alibi", d_model=args.heads * args.head_dim, num_heads=args.heads, train_len=512)
    positions = torch.arange(args.length)
    mask4 = bias_block(enc, positions, positions, causal=True, offset=0, dtype=torch.float32)
    mask3 = mask4[0].contiguous()
    build = median_time(lambda: bias_block(enc, positions, positions, causal=True, offset=0, dtype=torch.float32),
                        cpu, warmup=1, reps=args.reps)

    def flushed():
        with flush_denormals():
            blocked(q, k, v, mask4)

    ways = [("no bias, causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            ("3-d mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask3)),
            ("4-d mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask4)),
            ("4-d, query blocks", lambda: blocked(q, k, v, mask4)),
            ("4-d, query blocks, denormals flushed", flushed)]
    rows = []
    with torch.no_grad():
        for name, fn in ways:
            rows.append({"way": name, "ms": median_time(fn, cpu, warmup=1, reps=args.reps) * 1e3})
    for r in rows:
        r["vs_no_bias"] = r["ms"] / rows[0]["ms"]
    return {"environment": environment(cpu), "args": vars(args), "rows": rows, "mask_build_ms": build * 1e3}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.smoke:
        args.length, args.reps = 1024, 2
    result = run(args)
    result["command"] = list(sys.argv[1:] if argv is None else argv)
    print(result["environment"], f"| mask build (Toeplitz, once per length): {result['mask_build_ms']:.0f} ms")
    print_table(result["rows"], ["way", "ms", "vs_no_bias"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
