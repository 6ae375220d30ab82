"""--activation-checkpointing: the same losses and gradients as without, dropout included
(the recomputation replays the RNG), and it is off outside training forwards."""

from __future__ import annotations

import pytest
import torch
from models_testlib import make_batch, run, tiny_model

from valle.models.transformer import set_activation_checkpointing


def losses_and_grads(recompute: bool, stage: int):
    model = tiny_model(dropout=0.1)
    model.train()
    set_activation_checkpointing(model, recompute)
    batch = make_batch()
    torch.manual_seed(123)  # dropout masks
    seeds = torch.arange(4, dtype=torch.long)
    loss, metrics = run(model, batch, train_stage=stage, seeds=seeds)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_recomputation_gives_the_same_losses_and_gradients(stage):
    loss, metrics, grads = losses_and_grads(False, stage)
    loss_ck, metrics_ck, grads_ck = losses_and_grads(True, stage)
    torch.testing.assert_close(loss_ck, loss)
    assert metrics_ck.keys() == metrics.keys()
    for k in metrics:
        torch.testing.assert_close(metrics_ck[k], metrics[k], msg=k)
    assert grads_ck.keys() == grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads_ck[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_recomputation_saves_activation_memory():
    from valle.train.resilience.meter import CensusMeter

    def peak(recompute: bool) -> int:
        model = tiny_model(num_decoder_layers=4)
        set_activation_checkpointing(model, recompute)
        meter = CensusMeter()
        with meter.active():
            loss, _ = run(model, make_batch(), train_stage=0, seeds=torch.arange(4))
            loss.backward()
        return meter.peak_bytes()

    assert peak(True) < peak(False)


def test_it_is_off_without_gradients_and_in_eval():
    model = tiny_model()
    set_activation_checkpointing(model, True)
    stacks = [m for m in model.modules() if hasattr(m, "activation_checkpointing")]
    assert stacks and all(s.activation_checkpointing for s in stacks)
    model.eval()
    assert not any(s._recompute(None, None) for s in stacks)
    model.train()
    with torch.no_grad():
        assert not any(s._recompute(None, None) for s in stacks)
    assert all(s._recompute(None, None) for s in stacks)
