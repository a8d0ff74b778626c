"""Which digit of the answer a trained retrieval model gets wrong: the share right at each answer position, by
needle depth, at the training length (teacher forcing, as the grid reads exact match).

    python scripts/answer_digits.py results/retrieval-multikey-cpu rope 0 [--windows 128]

reads the run's config.json and its weights models/<encoding>-s<seed>.pt (float32 or float16), as
:func:`posenc_lab.lab.results.model_from_run` builds any run's model.
"""

import argparse
import json
from pathlib import Path

import torch

from posenc_lab.errors import PosencError
from posenc_lab.lab import results
from posenc_lab.lab.data import tasks
from posenc_lab.lab.experiments.families import spec_of
from posenc_lab.lab.experiments import retrieval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("encoding")
    parser.add_argument("seed", type=int)
    parser.add_argument("--windows", type=int, default=128)
    args = parser.parse_args()
    try:
        model = results.model_from_run(args.run, args.encoding, seed=args.seed)
    except PosencError as error:
        raise SystemExit(f"answer_digits: {error}") from None
    spec = spec_of(json.loads((args.run / "config.json").read_text()))
    if not isinstance(spec, retrieval.RetrievalSpec):
        raise SystemExit(f"answer_digits: {args.run} is a language-model run; this script reads retrieval runs")
    generator = torch.Generator().manual_seed(2026)
    print(f"{args.encoding} seed {args.seed}, {spec.task}, {spec.model.train_len} bytes, {args.windows} windows a depth")
    for depth in spec.depths:
        x, y, _, _ = tasks.make_windows(args.windows, spec.model.train_len, depth, generator, spec.task)
        hits = retrieval.answer_hits(model, x, y).float()
        print(f"depth {depth:4.2f}: right by answer byte " + " ".join(f"{h:.2f}" for h in hits.mean(0).tolist())
              + f"; exact match {hits.prod(-1).mean().item():.2f}")


if __name__ == "__main__":
    main()
