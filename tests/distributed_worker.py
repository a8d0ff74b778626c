"""One process of a hand-launched process group, for tests/test_distributed.py (what torchrun would start).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/distributed_worker.py OUT [--die-after N] -- CLI ARGS
    RANK=r ... python tests/distributed_worker.py OUT --evaluate

Writes OUT/rank<r>.json: the command's return code (and, for --evaluate, the sharded evaluation's result).
"""

import json
import os
import sys
from pathlib import Path

import torch


def evaluate_sharded(out: Path) -> dict:
    from posenc_lab.lab.data.corpora import load_corpus
    from posenc_lab.lab.measure.perplexity import evaluate
    from posenc_lab.lab.run import distributed
    from tests.test_distributed import tiny_model

    distributed.init(torch.device("cpu"), timeout_s=60)
    stream = load_corpus("stdlib").stream("test")
    results = {mode: evaluate(tiny_model(), stream, length=64, tokens=2048, mode=mode, stride=16 if mode == "sliding" else None,
                              lead_in=48, batch_size=3) for mode in ("nonoverlapping", "sliding")}
    distributed.shutdown()
    return results


def main():
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if "--evaluate" in sys.argv:
        result = {"rc": 0, "evaluation": evaluate_sharded(out)}
    else:
        args = sys.argv[sys.argv.index("--") + 1 :]
        if "--die-after" in sys.argv and rank == 1:
            calls = int(sys.argv[sys.argv.index("--die-after") + 1])
            from posenc_lab.lab.run import distributed

            original = distributed.mean_over_processes

            def die_at_some_step(value):  # this process is killed mid-run (no clean shutdown, no message)
                nonlocal calls
                calls -= 1
                if calls < 0:
                    os._exit(9)
                return original(value)

            distributed.mean_over_processes = die_at_some_step
        from posenc_lab.__main__ import main as cli

        result = {"rc": cli(args)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
