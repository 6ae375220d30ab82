"""ScaledAdam computed one parameter at a time: the reference the tests compare the
chunked multi-tensor path of valle.train.optim.ScaledAdam against.

Same state, same clipping, same resumable progress (one commit per parameter); the
arithmetic is written out per tensor, as icefall's ScaledAdam does it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from valle.train.optim import ScaledAdam


class ReferenceScaledAdam(ScaledAdam):
    def _units(self, params: list[Tensor]) -> list[list[Tensor]]:
        return [[p] for p in params]

    def _weighted_norms(self, params: list[Tensor], scalar_lr_scale: float) -> list[Tensor]:
        weighted = []
        for p in params:
            if p.grad is None:
                continue
            norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
            weighted.append(norm * (self.state[p]["param_rms"] if p.numel() > 1
                                    else scalar_lr_scale))
        return weighted

    def _step_unit(self, group: dict, unit: list[Tensor], factor: Tensor | None) -> None:
        (p,) = unit
        if p.numel() == 1:
            self._step_scalar(group, p, self.state[p], factor)
        else:
            self._step_tensor(group, p, self.state[p], factor)

    def _step_tensor(self, group: dict, p: Tensor, state: dict, factor: Tensor | None) -> None:
        grad = self._fp32_grad(p, factor)
        step = state["step"]
        new: dict[str, Tensor] = {"delta": state["delta"] * group["betas"][0]}
        period = group["size_update_period"]
        new["scale_grads"] = state["scale_grads"].clone()
        new["scale_grads"].select(0, step % period).copy_((p.float() * grad).sum())
        rms = state["param_rms"]
        if step % period == period - 1:
            rms = new["param_rms"] = p.detach().float().pow(2).mean().sqrt()
            if step > 0:
                self._size_update(group, p, state, new, rms)
        new["exp_avg_sq"], update = self._tensor_update(group, grad, state, rms)
        new["delta"].add_(update)
        new_p = p + new["delta"].to(p.dtype)
        for key, value in new.items():
            state[key].copy_(value)
        p.copy_(new_p)
        state["step"] = step + 1

    @staticmethod
    def _size_update(group: dict, p: Tensor, state: dict, new: dict[str, Tensor],
                     param_rms: Tensor) -> None:
        """Learn the overall size of ``p`` from the accumulated ``sum(p * grad)``."""
        beta1, beta2 = group["betas"]
        size_lr = group["lr"] * group["scalar_lr_scale"]
        scale_grads = new["scale_grads"]
        period = scale_grads.shape[0]
        beta2_corr = beta2**period  # updated once per period: its statistics decay faster
        scale_exp_avg_sq = state["scale_exp_avg_sq"] * beta2_corr
        scale_exp_avg_sq.add_(scale_grads.pow(2).mean(), alpha=1 - beta2_corr)
        new["scale_exp_avg_sq"] = scale_exp_avg_sq
        size_step = (state["step"] + 1) // period
        bias_correction2 = 1 - beta2_corr**size_step
        denom = scale_exp_avg_sq.sqrt() + group["eps"]
        scale_step = -size_lr * (bias_correction2**0.5) * scale_grads.sum() / denom
        # Too small: stop shrinking. Too large: shrink at the maximum rate.
        scale_step = torch.where(param_rms < group["param_min_rms"],
                                 torch.zeros_like(scale_step), scale_step)
        scale_step = torch.where(param_rms > group["param_max_rms"],
                                 torch.full_like(scale_step, -size_lr * period), scale_step)
        new["delta"].add_(p.float() * scale_step, alpha=1 - beta1)

    @staticmethod
    def _tensor_update(group: dict, grad: Tensor, state: dict,
                       param_rms: Tensor) -> tuple[Tensor, Tensor]:
        """(new exp_avg_sq, the addition to delta): the update relative to the RMS."""
        beta1, beta2 = group["betas"]
        exp_avg_sq = state["exp_avg_sq"] * beta2
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (state["step"] + 1)
        if bias_correction2 < 0.99:
            denom = (exp_avg_sq * (1.0 / bias_correction2)).sqrt_()
        else:
            denom = exp_avg_sq.sqrt()
        denom.add_(group["eps"])
        alpha = param_rms.clamp(min=group["param_min_rms"]) * (-group["lr"] * (1 - beta1))
        return exp_avg_sq, grad / denom * alpha
