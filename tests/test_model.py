"""The GPT model with each encoding plugged in."""

import pytest
import torch

import posenc_lab as pl
from posenc_lab import PositionOutOfRange
from posenc_lab.model import GPT, GPTConfig
from posenc_lab.lab.run.training import TrainConfig, lr_at


def small(encoding, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(encoding=encoding, n_layer=2, n_head=4, d_model=32, train_len=16, **kw))


@pytest.mark.parametrize("encoding", sorted(pl.ENCODINGS))
def test_model_is_causal_with_every_encoding(encoding):
    model = small(encoding).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


def test_models_differ_only_in_the_encoding():
    counts = {name: small(name).num_params() - sum(p.numel() for p in small(name).encoding.parameters())
              for name in pl.ENCODINGS}
    assert len(set(counts.values())) == 1


@pytest.mark.parametrize("encoding", sorted(pl.ENCODINGS))
@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_count_the_weights_a_token_is_multiplied_by(encoding, tied):
    """6 N + 6 L n d with N the weights of every nn.Linear (the tied head included) and the layer norms': a lookup
    (a learned position table, an untied input embedding, a bias encoding's parameters) does no multiply per token."""
    model = small(encoding, tie_embeddings=tied)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    norms = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
    # FIRE's network runs per distance, not per token
    linear -= sum(p.numel() for m in model.encoding.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert model.flops_per_token(16) == 6 * (linear + norms) + 6 * 2 * 16 * 32


def test_untied_embeddings_give_the_head_its_own_matrix_and_are_recorded_only_when_set():
    tied, untied = small("rope"), small("rope", tie_embeddings=False)
    assert tied.head.weight is tied.tok_emb.weight and untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 256 * 32
    # the configuration of every model made before the option existed is unchanged
    assert "tie_embeddings" not in tied.cfg.to_dict() and untied.cfg.to_dict()["tie_embeddings"] is False
    again = GPT(GPTConfig(**untied.cfg.to_dict()))
    again.load_state_dict(untied.state_dict())
    assert again.head.weight is not again.tok_emb.weight
    torch.testing.assert_close(again.head.weight, untied.head.weight)
    # a step moves the untied head without moving the embedding rows of bytes never seen as input
    opt = torch.optim.SGD(untied.parameters(), lr=0.1)
    before = untied.tok_emb.weight.detach().clone()
    x = torch.full((1, 8), 65)
    torch.nn.functional.cross_entropy(untied(x)[0], torch.full((8,), 48)).backward()
    opt.step()
    moved = (untied.tok_emb.weight.detach() - before).abs().sum(1) > 0
    assert moved.nonzero().flatten().tolist() == [65]
    # untied weights are refused by a tied model in one sentence (loaded, the head would replace the embedding)
    with pytest.raises(pl.PosencError, match="untied from the embedding"):
        small("rope").load_state_dict(untied.state_dict())
    small("rope").load_state_dict(tied.state_dict())  # a tied model's own weights still load


def test_learned_model_past_training_length_raises_clear_error():
    model = small("learned")
    with pytest.raises(PositionOutOfRange, match="cannot extrapolate"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["rope", "t5", "learned"])
def test_compiled_training_step_matches_eager(encoding):
    model = small(encoding)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model.loss)(x[:, :-1], x[:, 1:])
    compiled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model.loss(x[:, :-1], x[:, 1:])
    eager.backward()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_flushing_denormals_nests():
    """A probe inside training (retrieval's monitor) must not switch flushing off for the rest of training."""
    from posenc_lab.lab.run.training import flush_denormals

    tiny = torch.tensor([1e-39])  # subnormal in float32
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    torch.set_flush_denormal(False)
    with flush_denormals():
        with flush_denormals():
            pass
        assert (tiny * 1.0).item() == 0.0  # still flushed after the inner block
    assert (tiny * 1.0).item() != 0.0  # and restored after the outer one


@pytest.mark.parametrize("encoding", ["t5", "learned", "kerple", "fire", "alibi", "rope"])
def test_position_parameters_are_not_weight_decayed(encoding):
    from posenc_lab.lab.run.training import decay_groups, make_optimizer

    model = small(encoding)
    decay, rest = decay_groups(model)
    position = {id(p) for p in model.encoding.parameters()}
    assert not position & {id(p) for p in decay}
    assert position <= {id(p) for p in rest}
    # the Transformer's matrices are still decayed; every trainable parameter is in exactly one group
    assert id(model.tok_emb.weight) in {id(p) for p in decay}
    assert sorted(map(id, decay + rest)) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    by_group = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(by_group[i] == 0.0 for i in position)


def test_a_weight_decayed_t5_table_would_shrink_and_ours_does_not():
    """One AdamW step with zero gradients: decay alone moves a decayed parameter, never the T5 table."""
    from posenc_lab.lab.run.training import make_optimizer

    model = small("t5")
    table = next(model.encoding.parameters())
    with torch.no_grad():
        table.fill_(1.0)
    before = table.detach().clone()
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1, lr=0.1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(table.detach(), before)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["t5", "kerple", "fire"])
def test_query_blocks_of_a_learned_bias_train_as_one_block(encoding, monkeypatch):
    """The learned biases' blocked explicit path gives the losses of the whole square in one block after a few
    training steps, within float32 rounding."""
    from posenc_lab.backends import kernels
    from posenc_lab.lab.run.training import train

    stream = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    losses = {}
    for block in (16, 10**9):
        monkeypatch.setattr(kernels, "GRAD_BLOCK", block)
        torch.manual_seed(0)
        model = GPT(GPTConfig(encoding=encoding, n_layer=2, n_head=2, d_model=32, train_len=64))
        losses[block] = train(model, stream, TrainConfig(steps=6, batch_size=2, lr=3e-3, warmup=2),
                              progress=False)["losses"]
    assert losses[16] == pytest.approx(losses[10**9], abs=1e-5)
    assert len(set(losses[16])) > 1  # it trained


@pytest.mark.parametrize("name", list(pl.ENCODINGS))
def test_every_encoding_pins_its_length_for_a_generation_and_restores_it(name):
    """The model asks the encoding (``pin_length``), never its type: a RoPE whose factor follows the length holds
    ``final_len / train_len`` while pinned; every encoding is as it was after ``restore``."""
    enc = pl.make_encoding(name, d_model=64, num_heads=4, train_len=32, n_layer=2)
    if isinstance(enc, pl.RoPE):
        enc.set_scaling("pi")
    before = enc.settings()
    restore = enc.pin_length(128)
    if isinstance(enc, pl.RoPE):
        assert enc.factor == 4.0 and not enc.factor_follows_length
    restore()
    assert enc.settings() == before
