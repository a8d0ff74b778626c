"""Attention benchmark: every encoding x backend x length, against SDPA causal attention without bias.

    python benchmarks/attention.py --smoke                   # CPU, small sizes (CI runs this)
    python benchmarks/attention.py --json out/attention.json # CUDA, 512 ... 32768, bf16

Forward (evaluation) at every length; forward + backward at the training length. For each: the
median time, attention TFLOP/s (causal: 2 b h n^2 d forward, 2.5x that for forward + backward),
peak GPU memory, and the ratio to plain SDPA causal attention measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, peak_memory, print_table, write_json  # noqa: E402

import posenc_lab as pl  # noqa: E402
from posenc_lab.backends import flex_available  # noqa: E402

ATTENTION_ENCODINGS = ("nope", "rope", "xpos", "alibi", "t5", "kerple", "fire")  # embed-hook encodings = nope here


def attention_flops(b, h, n, d, backward=False):
    fwd = 2 * b * h * n * n * d  # two matmuls of 2 b h n^2 d, halved by the causal mask
    return fwd * 3.5 if backward else fwd


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []
    baseline = {}
    total = (len(args.lengths) + 1) * len(ATTENTION_ENCODINGS) * len(args.backends)
    bar = tqdm(total=total, desc="attention benchmark", disable=args.no_progress)
    for mode, lengths in (("forward", args.lengths), ("forward+backward", [args.train_len])):
        backward = mode != "forward"
        for n in lengths:
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g) for _ in range(3))
            for name in ATTENTION_ENCODINGS:
                enc = pl.make_encoding(name, d_model=h * d, num_heads=h, train_len=args.train_len).to(device)
                for backend in args.backends:
                    bar.update()
                    bar.set_postfix_str(f"{mode} {name} {backend} {n}")
                    if name == "nope" and backend != "sdpa" and not args.all_baselines:
                        continue
                    reason = skip_reason(backend, enc, n, device, backward, args)
                    row = {"mode": mode, "encoding": name, "backend": backend, "length": n}
                    if reason:
                        rows.append({**row, "note": reason})
                        continue
                    inputs = [t.clone().requires_grad_(backward) for t in (q, k, v)]

                    def step():
                        with torch.set_grad_enabled(backward):
                            out = pl.attention(*inputs, enc, backend=backend)
                            if backward:
                                out.float().sum().backward()

                    try:
                        seconds = median_time(step, device, warmup=args.warmup, reps=args.reps)
                        memory = peak_memory(step, device)
                    except (torch.cuda.OutOfMemoryError, RuntimeError, NotImplementedError) as err:
                        rows.append({**row, "note": f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"})
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    if name == "nope" and backend == "sdpa":
                        baseline[(mode, n)] = seconds
                    rows.append({**row, "ms": seconds * 1e3, "tflops": attention_flops(b, h, n, d, backward) / seconds / 1e12,
                                 "peak_gib": memory, "vs_sdpa_causal": seconds / baseline[(mode, n)]})
    bar.close()
    return {"environment": environment(device), "args": vars(args), "rows": rows}


def skip_reason(backend, enc, n, device, backward, args) -> str | None:
    if backend == "flex" and not flex_available(device):
        return "FlexAttention unavailable"
    if backend == "flex" and device.type == "cpu" and backward:
        return "no FlexAttention backward on CPU"
    if backend == "flex" and not enc.has_bias:
        return "no bias: flex adds nothing"
    if backend == "reference" and n > args.max_reference_len:
        return f"O(n^2) float64: skipped past {args.max_reference_len}"
    if backend == "sdpa" and enc.has_bias and n > args.max_materialized_len:
        return f"n x n bias: skipped past {args.max_materialized_len}"
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU-sized run (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--train-len", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backends", type=lambda s: s.split(","), default=["sdpa", "flex", "reference"])
    p.add_argument("--max-reference-len", type=int, default=4096)
    p.add_argument("--max-materialized-len", type=int, default=16384)
    p.add_argument("--all-baselines", action="store_true", help="also time nope through flex and reference")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths = args.lengths or [128, 256, 512]
        args.train_len = args.train_len or 128
        args.heads, args.head_dim, args.warmup, args.reps = 4, 32, 1, 3
        args.dtype = args.dtype or "fp32"
    args.lengths = args.lengths or [512, 1024, 2048, 4096, 8192, 16384, 32768]
    args.train_len = args.train_len or 512
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    result = run(args)
    result["command"] = list(sys.argv[1:] if argv is None else argv)
    print(result["environment"])
    print_table(result["rows"], ["mode", "encoding", "backend", "length", "ms", "tflops", "peak_gib", "vs_sdpa_causal", "note"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
