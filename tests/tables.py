"""Made-up results tables for the statistics tests: known perplexities, a small noise of their own."""

import zlib

import numpy as np

LENGTHS = (128, 256, 512)


def rows_from(table: dict, seeds=(0,), mode="nonoverlapping", noise=0.004):
    """Rows of a results table: ``{"label": (ppl at each of LENGTHS)}``, one row a seed and length, trained at 128."""
    rows = []
    for name, values in table.items():
        enc, _, strategy = name.partition("/")
        for seed in seeds:
            for length, ppl in zip(LENGTHS, values):
                # a small noise of its own for every cell, so that paired differences have a spread
                bump = 0.01 * seed + noise * np.random.default_rng(zlib.crc32(f"{name}{seed}{length}".encode())).standard_normal()
                rows.append({"encoding": enc, "strategy": strategy or "-", "seed": seed, "eval_len": length,
                             "eval_mode": mode, "train_len": 128, "perplexity": ppl + bump if ppl == ppl else ppl})
    return rows
