"""Diagnostics of trained models (chapter 9): the recomputed attention weights are the model's own."""

import pytest
import torch
from einops import rearrange

from posenc_lab import attention
from posenc_lab.model import GPT, GPTConfig
from posenc_lab.lab.measure import diagnostics


@pytest.mark.parametrize("name", ["nope", "sinusoidal", "rope", "alibi", "t5", "fire"])
def test_attention_weights_reproduce_every_layers_attention(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=2, n_head=2, d_model=32, train_len=32)).eval()
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    weights = diagnostics.attention_weights(model, idx)
    inputs = diagnostics._layer_inputs(model, idx)
    assert len(weights) == 2
    for block, w, x in zip(model.blocks, weights, inputs):
        assert w.shape == (2, 2, 40, 40)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 40))
        assert (w.triu(1) == 0).all()  # causal
        q, k, v = rearrange(block.attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=2)
        with torch.no_grad():
            want = attention(q, k, v, model.encoding, backend="reference")
        torch.testing.assert_close(w @ v.detach(), want, rtol=1e-5, atol=1e-5)


def test_entropy_of_uniform_and_one_hot_rows():
    n = 8
    uniform = torch.full((n,), 1 / n)
    assert diagnostics.entropy(uniform).item() == pytest.approx(torch.log(torch.tensor(8.0)).item())
    assert diagnostics.entropy(torch.eye(n)[3]).item() == 0.0


def test_mean_by_distance():
    n = 6
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None]).float()
    torch.testing.assert_close(diagnostics.mean_by_distance(distance), torch.arange(n, dtype=torch.float64))
    values = torch.arange(n)[:, None].float().expand(n, n)  # the query's own position
    # pairs at distance 0 are all queries 0..5 (mean 2.5); at distance 5 only query 5
    got = diagnostics.mean_by_distance(values)
    assert got[0].item() == pytest.approx(2.5) and got[5].item() == 5.0
    assert diagnostics.mean_by_distance(values, min_query=4)[0].item() == pytest.approx(4.5)


def test_log_forget_values_are_each_layers_gates_on_the_input_the_model_gives_it():
    """FoX: per layer, log sigmoid(w_f . x + b_f) written out on the input each attention layer received during the
    model's own forward pass (captured by a hook here), with that layer's gates; no gates: None per layer."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding="fox", n_layer=3, n_head=2, d_model=32, train_len=32)).eval()
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [block.attn.register_forward_hook(lambda mod, args, out: seen.append(args[0])) for block in model.blocks]
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    values = diagnostics.log_forget_values(model, idx)
    assert len(values) == 3
    gates = [model.encoding.for_layer(i, 3) for i in range(3)]
    assert len({id(g.w_f) for g in gates}) == 3  # every layer its own gates
    for x, g, got in zip(seen, gates, values):
        want = F.logsigmoid(torch.einsum("bnd,hd->bhn", x.double(), g.w_f.double()) + g.b_f.double()[:, None])
        assert got.shape == (2, 2, 40)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    rope = GPT(GPTConfig(encoding="rope", n_layer=2, n_head=2, d_model=32, train_len=32))
    assert diagnostics.log_forget_values(rope, idx) == [None, None]
