"""The GPU call's script runs on the CPU at a tiny size: the path the lent card takes, run before the card is lent."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_article_shape_script_runs_probe_run_pack_and_precision_at_toy_size(tmp_path):
    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "OUT": str(out), "RUN": str(run), "PRESET": "ci", "CORPUS": "stdlib", "JOBS": "2",
           "PACK_EVERY": "3", "PY": sys.executable, "RUN_ARGS": "--encodings nope,alibi,t5 --seeds 0 --steps 6"}
    done = subprocess.run(["bash", "scripts/device_article_shape.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "probe done" in done.stdout and "3 units finished" in done.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["env.txt", "gpu.txt", "precision.json", "probe.json", "run.log", "units.tar.gz"]
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    with tarfile.open(out / "units.tar.gz") as tar:
        units = sorted(Path(n).name for n in tar.getnames() if "/units/" in n and n.endswith(".json"))
    assert units == ["alibi-s0.json", "nope-s0.json", "t5-s0.json"]
    probe = json.loads((out / "probe.json").read_text())
    assert probe["go"] and probe["units"] == 3 and probe["matmul_tflops"] > 0
    precision = json.loads((out / "precision.json").read_text())["encodings"]
    assert set(precision) == {"alibi", "t5"}
    assert all(p["relative_difference"] == 0.0 for p in precision.values())  # the CPU evaluates in float32 both times


@pytest.mark.slow
def test_article_shape_probe_stops_a_call_the_card_cannot_finish(tmp_path):
    done = subprocess.run([sys.executable, "scripts/article_shape.py", "probe", "--preset", "ci", "--encodings",
                           "nope", "--seeds", "0", "--deadline", "0", "--overhead", "0",
                           "--json", str(tmp_path / "p.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "stopped: even at 30% MFU" in done.stdout and "too slow" in done.stdout
    assert json.loads((tmp_path / "p.json").read_text())["go"] is False


def test_article_shape_preset_is_the_articles_shape_on_the_headlines_evaluation_text():
    from posenc_lab.lab.experiments.language_model import LONG_RUN_ENCODINGS, PRESETS

    shape, headline = PRESETS["article-shape"], PRESETS["article-long-b4"]
    m = shape.model
    assert (m.n_layer, m.n_head, m.d_model, m.train_len) == (12, 8, 512, 512)
    assert shape.encodings == LONG_RUN_ENCODINGS and shape.seeds == (0, 1, 2)
    assert shape.strategies == headline.strategies
    ev, hv = shape.evaluation, headline.evaluation
    # the same scored bytes and lead-in: the same evaluation text (the same SHA-256 from the same corpus)
    assert (ev.eval_tokens, ev.lead_in(), ev.eval_lengths, ev.sliding) == (hv.eval_tokens, hv.lead_in(),
                                                                           hv.eval_lengths, hv.sliding)
    from posenc_lab.lab.data.corpora import evaluation_text, load_corpus

    text = evaluation_text(load_corpus("stdlib"), ev.eval_tokens, lead_in=ev.lead_in()).describe()
    committed = json.loads((ROOT / "results" / "article-long-b4" / "config.json").read_text())["evaluation_text"]
    assert text["eval_text_sha256"] == committed["eval_text_sha256"]
