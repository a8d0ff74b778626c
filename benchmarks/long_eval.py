"""Scoring one long window with every encoding: time and peak memory, against NoPE in the same run.

    python benchmarks/long_eval.py --smoke                                   # CPU, small (CI runs this)
    python benchmarks/long_eval.py --json results/benchmarks/cpu-long-eval.json

The experiment's GPT with each encoding (fresh weights: the cost does not depend on them) scores
one window of each length without gradients, exactly as ``evaluate()`` runs it (same precision,
denormals flushed). ``first_ms`` is the first call at a length (with its one-off costs: the
allocator's first blocks of that size); ``ms`` the median of the calls after it (every later window
of an evaluation, which reuse the masks the evaluation holds for its length: ``masks``), best of interleaved
rounds. The first call builds its bias once, for all its layers.
``peak_gib``: the process's peak resident set during the first two calls on
the CPU (bias building included; everything the process holds counts), peak allocated memory
on CUDA. ``vs_nope``: ``ms`` over NoPE's at the
same length in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, peak_memory, peak_rss, print_table, sync, write_json  # noqa: E402

import posenc_lab as pl  # noqa: E402
from posenc_lab.model import GPT, GPTConfig  # noqa: E402
from posenc_lab.lab.run.training import autocast, flush_denormals  # noqa: E402


def build(name: str, args, device: torch.device) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(encoding=name, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, train_len=args.train_len)
    return GPT(cfg).to(device).eval()


def run(args) -> dict:
    device = torch.device(args.device)
    names = [n for n in args.encodings if n != "learned"]  # a learned table cannot score past its length
    models = {name: build(name, args, device) for name in names}
    rows = {(name, n): {"encoding": name, "length": n, "ms": float("inf")} for name in names for n in args.lengths}
    held = {(name, n): {} for name in names for n in args.lengths}  # each evaluation's masks, as evaluate() holds them
    bar = tqdm(total=args.rounds * len(rows), desc="long evaluation", disable=args.no_progress)
    for round_ in range(args.rounds):
        for n in args.lengths:
            x = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
            for name, model in models.items():
                bar.set_postfix_str(f"{name} {n}")

                def score(masks=held[name, n]):
                    with torch.no_grad(), flush_denormals(), autocast(device):
                        model(x, masks=masks)

                if round_ == 0:  # the first call at a length: timed alone, and its memory counted
                    def first():
                        sync(device)
                        t0 = time.perf_counter()
                        score()
                        sync(device)
                        rows[name, n]["first_ms"] = (time.perf_counter() - t0) * 1e3
                        score()

                    rows[name, n]["peak_gib"] = peak_memory(first, device) if device.type == "cuda" else peak_rss(first)
                ms = median_time(score, device, warmup=0, reps=args.reps) * 1e3
                rows[name, n]["ms"] = min(rows[name, n]["ms"], ms)
                bar.update()
    bar.close()
    out = list(rows.values())
    for r in out:
        base = rows.get(("nope", r["length"]))
        r["vs_nope"] = r["ms"] / base["ms"] if base else None
    return {"environment": environment(device), "args": vars(args), "rows": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small sizes (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--encodings", type=lambda s: s.split(","), default=list(pl.ENCODINGS))
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best median counts")
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.n_layer, args.d_model, args.train_len, args.reps, args.rounds = [256, 512], 2, 64, 64, 2, 1
    result = run(args)
    result["command"] = list(sys.argv[1:] if argv is None else argv)
    print(result["environment"])
    print_table(result["rows"], ["encoding", "length", "first_ms", "ms", "vs_nope", "peak_gib"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
