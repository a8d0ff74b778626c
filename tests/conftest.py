import os

import pytest
import torch

# deterministic, and quiet about FlexAttention running unfused on the CPU (that is what we test there)
torch.manual_seed(0)
os.environ.setdefault("TQDM_DISABLE", "1")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore:flex_attention called without torch.compile")
