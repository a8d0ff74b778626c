"""Training throughput of the GPT model with each encoding, against NoPE in the same run.

    python benchmarks/train_throughput.py --smoke                  # CPU, a small model (CI runs this)
    python benchmarks/train_throughput.py --json out/train.json    # CUDA: the paper model, bf16, compiled

Reports tokens/s, model FLOPs utilisation (6 N + 6 L n d FLOPs per token against the machine's limit: the
matrix-multiply rate measured in the same run, bf16 on CUDA and float32 on the CPU, or --peak-tflops) and the
ratio to NoPE's tokens/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, matmul_tflops, median_time, peak_memory, print_table, write_json  # noqa: E402

import posenc_lab as pl  # noqa: E402
from posenc_lab.model import GPT, GPTConfig  # noqa: E402
from posenc_lab.lab.run.training import TrainConfig, autocast, flush_denormals, make_optimizer  # noqa: E402


def build(name: str, args, device: torch.device):
    """The model with encoding ``name`` and a function that runs one training step on a fixed batch."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                          train_len=args.seq_len)).to(device)
    opt = make_optimizer(model, TrainConfig())
    forward = torch.compile(model.loss) if args.compile else model.loss
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g).to(device)

    def step():  # as train() runs it: same precision, same denormal flushing
        with flush_denormals(), autocast(device):
            loss = forward(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return model, step


def measure_all(args, device: torch.device) -> list[dict]:
    """Each encoding's median step time, best of ``rounds`` interleaved rounds (so that no encoding
    is favoured by when it ran: warm caches, clocks, other load)."""
    built = {name: build(name, args, device) for name in args.encodings}
    best = {name: float("inf") for name in args.encodings}
    bar = tqdm(total=args.rounds * len(built), desc="training throughput", disable=args.no_progress)
    for _ in range(args.rounds):
        for name, (_, step) in built.items():
            bar.set_postfix_str(name)
            best[name] = min(best[name], median_time(step, device, warmup=args.warmup, reps=args.reps))
            bar.update()
    bar.close()
    rows = []
    for name, (model, step) in built.items():
        tokens_per_s = args.batch * args.seq_len / best[name]
        flops = model.flops_per_token(args.seq_len) * tokens_per_s
        rows.append({"encoding": name, "ms_per_step": best[name] * 1e3, "tokens_per_s": tokens_per_s,
                     "mfu": flops / (args.peak_tflops * 1e12) if args.peak_tflops else None,
                     "peak_gib": peak_memory(step, device), "params_m": model.num_params() / 1e6})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU-sized run (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--encodings", type=lambda s: s.split(","), default=list(pl.ENCODINGS))
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on CUDA)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak for MFU (default: its matrix-multiply rate, measured in this run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best median counts")
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.smoke:
        args.n_layer, args.n_head, args.d_model, args.seq_len, args.batch = 2, 4, 64, 128, 4
        args.warmup, args.reps = 2, 3
    if args.compile is None:
        args.compile = device.type == "cuda"
    measured = matmul_tflops(device, seconds=1.0 if args.smoke else 3.0)
    if args.peak_tflops is None:
        args.peak_tflops = measured
    rows = measure_all(args, device)
    nope = next((r["tokens_per_s"] for r in rows if r["encoding"] == "nope"), None)
    for r in rows:
        r["vs_nope"] = r["tokens_per_s"] / nope if nope else None
    result = {"environment": environment(device), "matmul_tflops": measured, "args": vars(args), "rows": rows,
              "command": list(sys.argv[1:] if argv is None else argv)}
    print(result["environment"])
    print(f"the machine's limit: {measured:.2f} TFLOP/s of matrix products (measured); MFU against "
          f"{args.peak_tflops:.2f} TFLOP/s")
    print_table(rows, ["encoding", "ms_per_step", "tokens_per_s", "mfu", "peak_gib", "vs_nope"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
