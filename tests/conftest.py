import os

import pytest
import torch

# deterministic, and quiet about FlexAttention running unfused on the CPU (that is what we test there)
torch.manual_seed(0)
# under `make test` two workers share the cores: one thread each for the tests in this process, so that they do
# not oversubscribe the machine (the chapters and the book, run in processes of their own, keep torch's default)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
os.environ.setdefault("TQDM_DISABLE", "1")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def _training_is_marked_slow(request, monkeypatch):
    """The two lanes: a test that takes a training step (``posenc_lab.lab.run.training``) must be marked ``slow``, so that
    ``make test-fast`` (``-m "not slow"``) trains nothing."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    from posenc_lab.lab.run import training as train

    steps, original = [], train._step
    monkeypatch.setattr(train, "_step", lambda *args, **kwargs: steps.append(1) or original(*args, **kwargs))
    yield
    if steps:
        pytest.fail(f"{request.node.nodeid} takes {len(steps)} training steps: mark it slow", pytrace=False)


# fixtures shared by a module's tests that are cheap enough to build once per worker
_SPREAD = {"colab"}


def pytest_collection_modifyitems(config, items):
    """`make test` runs two workers (pytest-xdist, ``--dist loadgroup``). A test that uses a costly module-scoped
    fixture (the built book, a trained run, the wheels) joins its module's group, so that the fixture is built once,
    on one worker; the other tests, the chapters run alone among them, are spread over both workers."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = [name for name in item.fixturenames
                  if name not in _SPREAD and defs.get(name) and defs[name][-1].scope in ("module", "session")]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
