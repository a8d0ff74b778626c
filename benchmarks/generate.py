"""Generation with and without the key/value cache: tokens/s up to a given total length, per encoding.

    python benchmarks/generate.py --smoke
    python benchmarks/generate.py --json results/benchmarks/cpu-generate.json     # 2048 tokens, CPU

The experiment's GPT (fresh weights: the cost does not depend on them) continues a prompt of
``--length - --new`` tokens by ``--new`` tokens, greedily: once with the cache (the prompt is run
once, then one token at a time) and once recomputing the whole sequence at every step. Tokens/s
counts the new tokens over the whole call (the prompt's pass included); ``speedup`` is cached over
uncached, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, print_table, write_json  # noqa: E402

from posenc_lab.model import GPT, GPTConfig  # noqa: E402
from posenc_lab.lab.run.training import flush_denormals  # noqa: E402


def run(args) -> dict:
    cpu = torch.device(args.device)
    rows = []
    for name in tqdm(args.encodings, desc="generation", disable=args.no_progress):
        torch.manual_seed(0)
        model = GPT(GPTConfig(encoding=name, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                              train_len=args.train_len)).to(cpu).eval()
        prompt = torch.randint(0, 256, (1, args.length - args.new), generator=torch.Generator().manual_seed(0)).to(cpu)
        row = {"encoding": name, "length": args.length, "new_tokens": args.new}
        for cache in (True, False):
            def call():
                with flush_denormals():
                    model.generate(prompt, args.new, cache=cache)

            seconds = median_time(call, cpu, warmup=1, reps=args.reps)
            row["tok_s_cached" if cache else "tok_s_uncached"] = args.new / seconds
        row["speedup"] = row["tok_s_cached"] / row["tok_s_uncached"]
        rows.append(row)
    return {"environment": environment(cpu), "args": vars(args), "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small sizes (CI)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--encodings", type=lambda s: s.split(","), default=["nope", "rope", "xpos", "alibi", "t5", "fire"])
    p.add_argument("--length", type=int, default=2048, help="prompt plus new tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.length, args.new, args.n_layer, args.d_model, args.train_len, args.reps = 128, 8, 1, 32, 64, 1
    result = run(args)
    result["command"] = list(sys.argv[1:] if argv is None else argv)
    print(result["environment"])
    print_table(result["rows"], ["encoding", "length", "new_tokens", "tok_s_cached", "tok_s_uncached", "speedup"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
