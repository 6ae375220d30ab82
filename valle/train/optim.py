"""Optimizers and learning-rate schedules for the VALL-E trainer.

* ``ScaledAdam``: the idea of icefall's ScaledAdam (Daniel Povey), written anew.
  Each non-scalar parameter's Adam update is scaled by the parameter's RMS, so
  the relative change per step is the same whatever the tensor's magnitude; the
  overall size of each tensor is learned separately (a scalar "scale" update
  driven by ``sum(p * grad)``); scalars get plain Adam with a smaller lr. No
  weight decay. Gradients are clipped against ``clipping_scale`` times the
  median of recent (RMS-weighted) gradient norms.
* the learning-rate schedules are in ``valle.train.schedulers``.

Rules this module keeps because the trainer holds ``param.grad`` as views into
flat all-reduce buffers and allows one host sync per step:

1. ``p.grad`` is only read (never reassigned, never set to None); clipping
   works on a scaled temporary.
2. ``step()`` performs no host sync: no ``.item()``/``.cpu()``/``.tolist()``
   and no Python branch on a tensor value; clipping factors are tensors.
3. ScaledAdam creates the state of every parameter of a group on its first
   ``step()`` (grad or no grad), so every rank holds the same structure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "ScaledAdam",
    "Adam",
    "ResumableUpdate",
    "UpdateProgress",
    "build_optimizer",
    "clip_grad_norm_",
    "scale_and_clip_",
    "OPTIMIZERS",
]

OPTIMIZERS = ("ScaledAdam", "AdamW", "Adam")

# icefall re-estimates the clipping threshold early (with a 2x margin) because
# the gradient norm moves fast at the start of training.
_IRREGULAR_THRESHOLD_STEPS = (10, 20, 40)


def _lower_median(x: Tensor) -> Tensor:
    """Median of the finite entries of a 1-D tensor, NaN if none; on device, no sync."""
    finite = torch.isfinite(x)
    # Non-finite entries (the NaN fill of an unused slot) sort to the end.
    masked = torch.where(finite, x, torch.full_like(x, float("inf")))
    sorted_x = torch.sort(masked).values
    count = finite.sum()
    idx = torch.clamp((count - 1) // 2, min=0).view(1)
    med = sorted_x.gather(0, idx).squeeze(0)
    return torch.where(count > 0, med, torch.full_like(med, float("nan")))


@dataclass
class UpdateProgress:
    """Where an interrupted step() resumes: the parameter group and the unit (chunk)
    in it whose update was not committed yet."""

    group: int = 0
    unit: int = 0
    factor: Tensor | None = None  # ScaledAdam: this group's clipping factor, once computed
    factor_ready: bool = False


class ResumableUpdate:
    """An optimizer whose step() commits chunk by chunk and records how far it got: after
    an out-of-memory error part-way, calling step() again finishes the update with the
    result of one clean call. `reset_update()` forgets a half-done step (its state is
    then repaired from another rank)."""

    progress: UpdateProgress | None = None

    def begin_update(self) -> UpdateProgress:
        """The progress of the step in flight: a new one, or the interrupted one's."""
        if self.progress is None:
            self.progress = UpdateProgress()
        return self.progress

    def reset_update(self) -> None:
        self.progress = None

    @property
    def resuming(self) -> bool:
        """True after an error part-way through step(): the next step() finishes it."""
        return self.progress is not None


class ScaledAdam(ResumableUpdate, Optimizer):
    """Adam whose update is proportional to each parameter's RMS.

    Args:
      params: parameters, ``(name, parameter)`` pairs, or param groups.
      lr: learning rate (typically 0.01-0.05; much larger than for Adam,
        because the update is relative to the parameter's size).
      clipping_scale: clip the gradient when its RMS-weighted norm exceeds
        ``clipping_scale`` times the median of the last
        ``clipping_update_period`` norms; ``None`` disables clipping.
      betas: momentum and second-moment decay.
      scalar_lr_scale: lr factor for scalar parameters and for the learned
        size of the non-scalar ones.
      eps: Adam epsilon.
      param_min_rms / param_max_rms: bounds for the learned size of a tensor.
      scalar_max: scalars are clamped to [-scalar_max, scalar_max].
      size_update_period: the tensor size (scale) is updated every this many steps.
      clipping_update_period: the clipping threshold is re-estimated every
        this many steps.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-2,
        clipping_scale: float | None = None,
        betas: tuple[float, float] = (0.9, 0.98),
        scalar_lr_scale: float = 0.1,
        eps: float = 1.0e-8,
        param_min_rms: float = 1.0e-5,
        param_max_rms: float = 3.0,
        scalar_max: float = 10.0,
        size_update_period: int = 4,
        clipping_update_period: int = 100,
        chunk_mb: float = 64.0,
    ) -> None:
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        if clipping_scale is not None and clipping_scale <= 0:
            raise ValueError(f"clipping_scale must be positive or None, got {clipping_scale}")
        defaults = dict(
            lr=lr,
            clipping_scale=clipping_scale,
            betas=betas,
            scalar_lr_scale=scalar_lr_scale,
            eps=eps,
            param_min_rms=param_min_rms,
            param_max_rms=param_max_rms,
            scalar_max=scalar_max,
            size_update_period=size_update_period,
            clipping_update_period=clipping_update_period,
        )
        super().__init__(params, defaults)
        # The tensor parameters of a group are updated together, in chunks of about
        # chunk_mb, with multi-tensor kernels (a few launches per chunk instead of ~20
        # per parameter). The per-parameter reference the tests compare against is
        # tests/train/scaled_adam_reference.py.
        self.chunk_bytes = int(chunk_mb * (1 << 20))

    # ----------------------------------------------------------------- state

    def _init_group_state(self, group: dict) -> None:
        """Create the state of every parameter of ``group`` that has none yet."""
        params = group["params"]
        for p in params:
            state = self.state[p]
            if len(state) > 0:
                continue
            state["step"] = 0
            # Momentum of the update (the change applied to p), fp32.
            state["delta"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if p.numel() > 1:
                rms = p.detach().float().pow(2).mean().sqrt()
                state["param_rms"] = rms
                state["scale_exp_avg_sq"] = torch.zeros_like(rms)
                state["scale_grads"] = torch.zeros(
                    group["size_update_period"], device=p.device, dtype=torch.float32
                )
        first = self.state[params[0]]
        if "model_norms" not in first:
            dev = params[0].device
            # Group-level clipping state lives in the first parameter's state
            # (as in icefall) so the ordinary state_dict carries it.
            first["model_norms"] = torch.full(
                (group["clipping_update_period"],), float("nan"), device=dev
            )
            # torch.full, not torch.tensor: no host-to-device copy (and sync).
            first["clip_threshold"] = torch.full((), float("inf"), device=dev)
            first["clip_factor"] = torch.full((), 1.0, device=dev)
            first["grad_norm"] = torch.full((), 0.0, device=dev)
            first["num_clipped"] = torch.full((), 0.0, device=dev)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, then restore each state tensor's saved dtype.

        torch's loader casts floating state to the parameter's dtype; our
        statistics are fp32 whatever the parameter is, so undo that cast.
        """
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if index in saved:
                    for key, value in saved[index].items():
                        cur = self.state[p].get(key)
                        if isinstance(value, Tensor) and isinstance(cur, Tensor):
                            if cur.dtype != value.dtype:
                                self.state[p][key] = cur.to(value.dtype)
                index += 1

    # -------------------------------------------------------------- clipping

    def _clipping_factor(self, group: dict) -> Tensor | None:
        """Compute the clipping factor for ``group`` as a 0-dim device tensor.

        Returns None when clipping is disabled. The factor is 0 when the
        gradient norm is not finite (the gradient is then ignored, as icefall
        does), else ``min(1, threshold / norm)``.
        """
        clipping_scale = group["clipping_scale"]
        if clipping_scale is None:
            return None
        params = group["params"]
        first = self.state[params[0]]
        step = first["step"]
        period = group["clipping_update_period"]
        scalar_lr_scale = group["scalar_lr_scale"]

        # A gradient matters in proportion to the parameter's size, since the update is
        # relative to it.
        weighted = self._weighted_norms(params, scalar_lr_scale)
        if not weighted:
            return None
        # Computed out of place, then committed with in-place copies (which allocate
        # nothing): an OOM in here leaves the clipping state as it was.
        tot_norm = torch.linalg.vector_norm(torch.stack(weighted))
        finite = torch.isfinite(tot_norm)
        norms = first["model_norms"].clone()
        norms.select(0, step % period).copy_(
            torch.where(finite, tot_norm, torch.full_like(tot_norm, float("nan")))
        )
        threshold = first["clip_threshold"]
        irregular = step in _IRREGULAR_THRESHOLD_STEPS and step < period
        if (step > 0 and step % period == 0) or irregular:
            median = _lower_median(norms)
            threshold = median * (clipping_scale * (2.0 if irregular else 1.0))
            threshold = torch.where(
                torch.isnan(threshold), torch.full_like(threshold, float("inf")), threshold
            )
        factor = torch.clamp(threshold / (tot_norm + 1.0e-20), max=1.0)
        factor = torch.where(finite, factor, torch.zeros_like(factor))
        clipped = (factor < 1.0).float()
        first["model_norms"].copy_(norms)
        first["clip_threshold"].copy_(threshold)
        first["grad_norm"].copy_(tot_norm)
        first["clip_factor"].copy_(factor)
        first["num_clipped"].add_(clipped)
        return first["clip_factor"]

    def _weighted_norms(self, params: list[Tensor], scalar_lr_scale: float) -> list[Tensor]:
        """Each gradient's norm times its parameter's RMS (scalars: scalar_lr_scale), with
        one multi-tensor norm and one multiply."""
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return []
        norms = torch._foreach_norm([p.grad for p in with_grad], dtype=torch.float32)
        scalar_weight = None
        weights = []
        for p in with_grad:
            if p.numel() > 1:
                weights.append(self.state[p]["param_rms"])
            else:
                if scalar_weight is None:  # a fill kernel, no host-to-device copy
                    scalar_weight = torch.full((), scalar_lr_scale, device=p.device)
                weights.append(scalar_weight)
        return torch._foreach_mul(norms, weights)

    def clipping_stats(self) -> dict[str, Tensor]:
        """Last grad norm, clip factor, threshold and clipped-step count, as
        device tensors of the first group (read them when you sync anyway)."""
        group = self.param_groups[0]
        first = self.state[group["params"][0]]
        if "model_norms" not in first:
            return {}
        return {
            "grad_norm": first["grad_norm"],
            "clip_factor": first["clip_factor"],
            "clip_threshold": first["clip_threshold"],
            "num_clipped": first["num_clipped"],
        }

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One update. Resumable: every parameter's update is computed out of place and
        then committed with in-place copies, so an out-of-memory error part-way leaves
        each parameter (and the clipping state) either updated or untouched, and calling
        step() again finishes the ones left, with the same result as one clean call."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        progress = self.begin_update()
        for gi in range(progress.group, len(self.param_groups)):
            group = self.param_groups[gi]
            self._init_group_state(group)
            if not progress.factor_ready:
                progress.factor, progress.factor_ready = self._clipping_factor(group), True
            units = self._units(group["params"])
            for ui in range(progress.unit, len(units)):
                self._step_unit(group, units[ui], progress.factor)
                progress.unit = ui + 1
            progress.group, progress.unit = gi + 1, 0
            progress.factor, progress.factor_ready = None, False
        self.reset_update()
        return loss

    def _units(self, params: list[Tensor]) -> list[list[Tensor]]:
        """What one commit covers: a single scalar parameter, or a chunk of tensor
        parameters of one device/dtype/step."""
        units: list[list[Tensor]] = []
        chunk: list[Tensor] = []
        size = 0
        for p in params:
            if p.numel() == 1:
                units.append([p])
                continue
            nbytes = p.numel() * 4
            first = chunk[0] if chunk else None
            if first is not None and (size + nbytes > self.chunk_bytes or p.device != first.device
                                      or p.dtype != first.dtype
                                      or self.state[p]["step"] != self.state[first]["step"]):
                units.append(chunk)
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            units.append(chunk)
        return units

    def _step_unit(self, group: dict, unit: list[Tensor], factor: Tensor | None) -> None:
        if len(unit) == 1 and unit[0].numel() == 1:
            self._step_scalar(group, unit[0], self.state[unit[0]], factor)
        else:
            self._step_chunk(group, unit, factor)

    @staticmethod
    def _fp32_grad(p: Tensor, factor: Tensor | None) -> Tensor:
        """p's (clipped) fp32 gradient as a new tensor; p.grad (a view into the sync
        buffer) is only read. No gradient this step: zero, which keeps every rank's
        state identical (the momentum still decays and moves p)."""
        if p.grad is None:
            return torch.zeros_like(p, dtype=torch.float32)
        if p.grad.is_sparse:
            raise RuntimeError("ScaledAdam does not support sparse gradients")
        if factor is not None:
            # nan_to_num: when the norm is not finite factor is 0 and inf*0 = nan.
            return torch.nan_to_num_(p.grad.float() * factor, nan=0.0, posinf=0.0, neginf=0.0)
        return p.grad.float()

    def _step_scalar(self, group: dict, p: Tensor, state: dict, factor: Tensor | None) -> None:
        """Plain Adam with the smaller scalar lr, p clamped to [-scalar_max, scalar_max]."""
        grad = self._fp32_grad(p, factor)
        # Prepare: every new value out of place (this is where memory is allocated) ...
        delta = state["delta"] * group["betas"][0]
        exp_avg_sq, update = self._scalar_update(group, grad, state)
        delta.add_(update)
        new_p = p.clamp(min=-group["scalar_max"], max=group["scalar_max"])
        new_p.add_(delta.to(p.dtype))
        # ... commit: in-place copies only, which allocate nothing.
        state["delta"].copy_(delta)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        p.copy_(new_p)
        state["step"] = state["step"] + 1

    def _step_chunk(self, group: dict, params: list[Tensor], factor: Tensor | None) -> None:
        """The update of a chunk of tensor parameters (all at the same step), with
        multi-tensor kernels; the per-parameter scalars (RMS, size statistics) are
        stacked into vectors. Prepared out of place, then committed without allocating."""
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise RuntimeError("ScaledAdam does not support sparse gradients")
        states = [self.state[p] for p in params]
        step = states[0]["step"]
        beta1, beta2 = group["betas"]
        period = group["size_update_period"]
        grads = _chunk_fp32_grads(params, factor)
        pf = [p.float() for p in params]  # p itself when fp32
        # Prepare: every new value out of place ...
        new_delta = torch._foreach_mul([s["delta"] for s in states], beta1)
        scale_grads = torch.stack([s["scale_grads"] for s in states])  # (n, period)
        scale_grads.select(1, step % period).copy_(torch.stack(
            [torch.dot(a.reshape(-1), g.reshape(-1)) for a, g in zip(pf, grads)]))
        rms = torch.stack([s["param_rms"] for s in states])
        new_rms = new_size = None
        if step % period == period - 1:
            norms = torch._foreach_norm(pf)
            torch._foreach_mul_(norms, [p.numel() ** -0.5 for p in params])
            rms = new_rms = torch.stack(norms)
            if step > 0:
                new_size = _size_update_chunk(group, pf, states, scale_grads, rms, new_delta)
        new_sq = torch._foreach_mul([s["exp_avg_sq"] for s in states], beta2)
        torch._foreach_addcmul_(new_sq, grads, grads, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (step + 1)
        if bias_correction2 < 0.99:
            denom = torch._foreach_mul(new_sq, 1.0 / bias_correction2)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(new_sq)
        torch._foreach_add_(denom, group["eps"])
        # The update (grad / denom * alpha) is relative to each parameter's RMS; alpha
        # folded into the denominator, so it costs one pass less.
        alpha = rms.clamp(min=group["param_min_rms"]) * (-group["lr"] * (1 - beta1))
        torch._foreach_div_(denom, list(alpha.unbind(0)))
        torch._foreach_addcdiv_(new_delta, grads, denom)
        denom = None
        delta_in_p = new_delta if params[0].dtype == torch.float32 else \
            [d.to(params[0].dtype) for d in new_delta]
        # ... commit: in-place adds, copies and hand-overs only, which allocate nothing.
        torch._foreach_add_(params, delta_in_p)
        torch._foreach_copy_([s["scale_grads"] for s in states], list(scale_grads.unbind(0)))
        if new_rms is not None:
            torch._foreach_copy_([s["param_rms"] for s in states], list(new_rms.unbind(0)))
        if new_size is not None:
            torch._foreach_copy_([s["scale_exp_avg_sq"] for s in states],
                                 list(new_size.unbind(0)))
        for s, delta, sq in zip(states, new_delta, new_sq):
            s["delta"], s["exp_avg_sq"], s["step"] = delta, sq, step + 1

    def _scalar_update(self, group: dict, grad: Tensor, state: dict) -> tuple[Tensor, Tensor]:
        beta1, beta2 = group["betas"]
        lr = group["lr"] * group["scalar_lr_scale"]
        exp_avg_sq = state["exp_avg_sq"] * beta2
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        bias_correction2 = 1 - beta2 ** (state["step"] + 1)
        denom = (exp_avg_sq / bias_correction2).sqrt_().add_(group["eps"])
        return exp_avg_sq, (grad / denom) * (-lr * (1 - beta1))

    def materialize_state(self) -> None:
        """Create every parameter's state now rather than at the first step, so its
        layout is fixed from the start (an in-place repair broadcast needs that)."""
        for group in self.param_groups:
            self._init_group_state(group)


def _chunk_fp32_grads(params: list[Tensor], factor: Tensor | None) -> list[Tensor]:
    """The chunk's fp32 (clipped) gradients as views of one new flat buffer: the same
    elementwise arithmetic as _fp32_grad, in three kernels instead of 2-3 per
    parameter; p.grad (a view into the sync buffer) is only read."""
    flat = torch.cat([(p.grad if p.grad is not None
                       else torch.zeros_like(p, dtype=torch.float32)).reshape(-1).float()
                      for p in params])
    if factor is not None:
        flat.mul_(factor)
        # factor is 0 when the norm is not finite, and inf*0 = nan.
        torch.nan_to_num_(flat, nan=0.0, posinf=0.0, neginf=0.0)
    return [g.view_as(p) for g, p in zip(flat.split([p.numel() for p in params]), params)]


def _size_update_chunk(group: dict, pf: list[Tensor], states: list[dict], scale_grads: Tensor,
                       param_rms: Tensor, new_delta: list[Tensor]) -> Tensor:
    """Learn each tensor's overall size from the accumulated ``sum(p * grad)``, on
    (n,) vectors; adds to new_delta in place, returns the new scale_exp_avg_sq."""
    beta1, beta2 = group["betas"]
    size_lr = group["lr"] * group["scalar_lr_scale"]
    period = scale_grads.shape[1]
    beta2_corr = beta2**period
    scale_exp_avg_sq = torch.stack([s["scale_exp_avg_sq"] for s in states]) * beta2_corr
    scale_exp_avg_sq.add_(scale_grads.pow(2).mean(dim=1), alpha=1 - beta2_corr)
    size_step = (states[0]["step"] + 1) // period
    bias_correction2 = 1 - beta2_corr**size_step
    denom = scale_exp_avg_sq.sqrt() + group["eps"]
    scale_step = -size_lr * (bias_correction2**0.5) * scale_grads.sum(dim=1) / denom
    scale_step = torch.where(param_rms < group["param_min_rms"],
                             torch.zeros_like(scale_step), scale_step)
    scale_step = torch.where(param_rms > group["param_max_rms"],
                             torch.full_like(scale_step, -size_lr * period), scale_step)
    torch._foreach_add_(new_delta, torch._foreach_mul(pf, list(scale_step.unbind(0))),
                        alpha=1 - beta1)
    return scale_exp_avg_sq


class Adam(ResumableUpdate, Optimizer):
    """Adam / AdamW (``decoupled=True``), resumable like ScaledAdam.

    Parameters are updated in chunks of about ``chunk_mb``. Where torch has a
    fused Adam kernel (CUDA, CPU) a chunk is one launch of it, in place: the
    kernel allocates nothing, so it cannot fail half-way. Otherwise (``fused=False``)
    the chunk's new values are computed out of place with foreach kernels and
    committed with in-place copies. Either way an out-of-memory error leaves every
    chunk updated or untouched; the next step() call finishes the rest. The
    arithmetic is torch.optim.AdamW's (tested against it).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                 chunk_mb: float = 64.0, fused: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        super().__init__(params, defaults)
        self.chunk_bytes = int(chunk_mb * (1 << 20))
        # fused: torch's fused Adam(W) kernel (one launch per chunk, allocation-free, so
        # it commits the chunk at once); None: wherever the kernel exists.
        self.fused = fused

    @staticmethod
    def fused_supported(device: torch.device) -> bool:
        return device.type in ("cuda", "cpu") and hasattr(torch, "_fused_adamw_")

    def materialize_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)

    def _chunks(self, params: list[Tensor]) -> list[list[Tensor]]:
        chunks: list[list[Tensor]] = [[]]
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if chunks[-1] and (size + nbytes > self.chunk_bytes
                               or p.device != chunks[-1][0].device or p.dtype != chunks[-1][0].dtype):
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += nbytes
        return [c for c in chunks if c]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.materialize_state()
        progress = self.begin_update()
        for gi in range(progress.group, len(self.param_groups)):
            group = self.param_groups[gi]
            chunks = self._chunks([p for p in group["params"] if p.grad is not None])
            for ci in range(progress.unit, len(chunks)):
                chunk = chunks[ci]
                fused = self.fused if self.fused is not None else self.fused_supported(chunk[0].device)
                (self._update_chunk_fused if fused else self._update_chunk)(group, chunk)
                progress.unit = ci + 1
            progress.group, progress.unit = gi + 1, 0
        self.reset_update()
        return loss

    def _update_chunk(self, group: dict, params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        if wd and not group["decoupled"]:
            grads = torch._foreach_add(grads, params, alpha=wd)
        steps = [s["step"] + 1 for s in states]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        # Prepare (allocates) ...
        new_avg = torch._foreach_lerp(exp_avg, grads, 1 - beta1)
        new_sq = torch._foreach_mul(exp_avg_sq, beta2)
        torch._foreach_addcmul_(new_sq, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(new_sq)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**k) for k in steps])
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(new_avg, denom)
        torch._foreach_mul_(update, [-lr / (1 - beta1**k) for k in steps])
        new_p = torch._foreach_mul(params, 1 - lr * wd) if wd and group["decoupled"] else \
            torch._foreach_mul(params, 1.0)
        torch._foreach_add_(new_p, update)
        # ... commit, allocating nothing: the moments by handing the new tensors to the
        # state (no copy), the parameters in place (other objects hold them).
        torch._foreach_copy_(params, new_p)
        for s, k, avg, sq in zip(states, steps, new_avg, new_sq):
            s["step"], s["exp_avg"], s["exp_avg_sq"] = k, avg, sq


    def _update_chunk_fused(self, group: dict, params: list[Tensor]) -> None:
        """torch's fused Adam(W) kernel, in place. It allocates nothing, so it cannot run
        out of memory part-way: the launch is itself the commit, and everything that
        allocates (the step counts as device tensors: fills, no host-to-device copy)
        comes before it."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        steps = [s["step"] + 1 for s in states]
        counts = {k: torch.full((), float(k), dtype=torch.float32, device=params[0].device)
                  for k in set(steps)}
        kernel = torch._fused_adamw_ if group["decoupled"] else torch._fused_adam_
        kernel(params, [p.grad for p in params], [s["exp_avg"] for s in states],
               [s["exp_avg_sq"] for s in states], [], [counts[k] for k in steps],
               lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
               eps=group["eps"], amsgrad=False, maximize=False)
        for s, k in zip(states, steps):
            s["step"] = k


# --------------------------------------------------------------------------
# Gradient clipping for the Adam family


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm before clipping as a 0-dim tensor (no host sync). Grads
    are modified in place, never replaced. A non-finite norm leaves them
    non-finite: the step's vote is what skips such a step.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return scale_and_clip_(grads, 1.0, max_norm)


@torch.no_grad()
def scale_and_clip_(grads: Sequence[Tensor], factor: float, max_norm: float,
                    norms: Sequence[Tensor] | None = None) -> Tensor:
    """``grads *= factor``, then clipped to a global L2 norm of at most ``max_norm``:
    one norm pass and one multiply (``norms``: the per-tensor norms of ``grads`` when
    the caller already has them). Everything allocates before the multiply, the only
    mutation, so an OOM leaves the gradients as they were. Returns the scaled norm
    before clipping (0-dim, no host sync)."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first_device = grads[0].device
    if norms is None or len(by_device) > 1:
        norms = []
        for device_grads in by_device.values():
            norms.extend(n.float().to(first_device) for n in torch._foreach_norm(device_grads))
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) * factor
    coef = torch.clamp(max_norm / (total + 1.0e-6), max=1.0) * factor
    for device, device_grads in by_device.items():
        torch._foreach_mul_(device_grads, coef.to(device))
    return total


# --------------------------------------------------------------------------
# Factories


@dataclass(frozen=True)
class OptimizerRecipe:
    """The optimizer settings the VALL-E recipes fix and the trainer has no flag for (its
    config carries them: ``TrainConfig.optimizer_recipe``): betas (0.9, 0.95); ScaledAdam's
    clipping_scale 2.0 with a threshold re-estimated every 1000 steps; the Adam family's eps."""

    betas: tuple[float, float] = (0.9, 0.95)
    clipping_scale: float | None = 2.0
    clipping_update_period: int = 1000
    eps: float = 1e-8


RECIPE = OptimizerRecipe()


def build_optimizer(
    name: str,
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    base_lr: float,
    weight_decay: float = 1e-2,
    betas: tuple[float, float] = RECIPE.betas,
    clipping_scale: float | None = RECIPE.clipping_scale,
    clipping_update_period: int = RECIPE.clipping_update_period,
    eps: float = RECIPE.eps,
) -> Optimizer:
    """Build the optimizer over ``named_params`` (the trained stage's parameters).

    Defaults follow the VALL-E recipes (``OptimizerRecipe``); ScaledAdam takes no weight
    decay; AdamW's default weight_decay is 0.01 (the trainer passes --weight-decay); Adam
    takes none.
    """
    named_params = list(named_params)
    if not named_params:
        raise ValueError("build_optimizer: no parameters to optimise")
    if name == "ScaledAdam":
        return ScaledAdam(
            named_params,
            lr=base_lr,
            betas=betas,
            clipping_scale=clipping_scale,
            clipping_update_period=clipping_update_period,
        )
    if name == "AdamW":
        return Adam([p for _, p in named_params], lr=base_lr, betas=betas,
                    weight_decay=weight_decay, eps=eps, decoupled=True)
    if name == "Adam":
        return Adam([p for _, p in named_params], lr=base_lr, betas=betas, eps=eps)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
