"""Running average of the trained parameters (icefall's ``model_avg``).

Every ``average_period`` optimizer steps, at step ``s``:

    avg = avg * (1 - w) + cur * w,   w = average_period / s

which makes ``avg`` the mean of the parameters at steps period, 2*period, ...
(the first update, w = 1, copies the current values). The copies are fp32 on
the parameters' device and the update is in place (``_foreach_mul_`` /
``_foreach_add_`` with scalar weights allocate nothing), so it cannot run out
of memory in the middle of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["ModelAverager"]


class ModelAverager:
    """fp32 running average of a fixed, ordered list of named parameters."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        average_period: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if average_period <= 0:
            raise ValueError(f"average_period must be positive, got {average_period}")
        named_params = list(named_params)
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            raise ValueError("ModelAverager: duplicate parameter names")
        self.average_period = int(average_period)
        self.names: list[str] = names
        self._params: list[nn.Parameter] = [p for _, p in named_params]
        with torch.no_grad():
            self._avg: list[Tensor] = [p.detach().to(dtype=dtype, copy=True) for p in self._params]
        # Step of the last update (0: the copies are the initial parameters).
        self.last_step = 0

    # ----------------------------------------------------------------- update

    def due(self, step: int) -> bool:
        """Whether ``update(step)`` would change the average."""
        return step > 0 and step % self.average_period == 0

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Fold the current parameters in when ``step`` is a multiple of the period.

        ``step`` is the number of optimizer steps done (icefall's
        batch_idx_train). Returns True when the average was updated.
        """
        if not self.due(step):
            return False
        weight_cur = self.average_period / step
        weight_avg = 1.0 - weight_cur
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for avg, p in zip(self._avg, self._params):
            avgs, curs = groups.setdefault((avg.device, p.dtype), ([], []))
            avgs.append(avg)
            curs.append(p.detach())
        for avgs, curs in groups.values():
            torch._foreach_mul_(avgs, weight_avg)
            # Mixed dtypes (bf16 params into fp32 copies) take foreach's
            # per-tensor path, which still casts on the fly without a copy.
            torch._foreach_add_(avgs, curs, alpha=weight_cur)
        self.last_step = step
        return True

    # ------------------------------------------------------------------ access

    def tensors(self) -> list[Tensor]:
        """The averaged tensors, in the order of ``named_params`` (hash/broadcast)."""
        return list(self._avg)

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        return list(zip(self.names, self._avg))

    def state_dict(self) -> dict:
        return {
            "average_period": self.average_period,
            "last_step": self.last_step,
            "params": {n: t.detach().clone() for n, t in zip(self.names, self._avg)},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["params"]
        missing = [n for n in self.names if n not in saved]
        if missing:
            raise KeyError(f"ModelAverager.load_state_dict: missing {missing[:5]}")
        for name, avg in zip(self.names, self._avg):
            self._copy_checked(name, avg, saved[name])
        self.last_step = int(state_dict.get("last_step", 0))
        # average_period is a flag: the current one wins if it changed.

    @torch.no_grad()
    def load_from_model_state_dict(self, model_state: dict, strict: bool = True) -> list[str]:
        """Initialise the average from a full model state dict (a checkpoint's
        ``model_avg``). Returns the names not found (raises if ``strict``)."""
        missing = []
        for name, avg in zip(self.names, self._avg):
            if name in model_state:
                self._copy_checked(name, avg, model_state[name])
            else:
                missing.append(name)
        if missing and strict:
            raise KeyError(f"model_avg lacks {missing[:5]} ({len(missing)} in all)")
        return missing

    @staticmethod
    def _copy_checked(name: str, dst: Tensor, src: Tensor) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"averaged {name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
        dst.copy_(src)

    # ------------------------------------------------------------- model views

    def _avg_by_key(self, model: nn.Module) -> dict[str, Tensor]:
        """Map model state-dict keys to averaged tensors.

        Matching is by parameter identity first, so a wrapped model (a
        ``module.`` prefix) still gets the averaged values; then by name.
        """
        by_id = {id(p): avg for p, avg in zip(self._params, self._avg)}
        out: dict[str, Tensor] = {}
        for key, p in model.named_parameters(remove_duplicate=False):
            if id(p) in by_id:
                out[key] = by_id[id(p)]
        if not out:
            out = dict(zip(self.names, self._avg))
        return out

    def averaged_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """``model.state_dict()`` with the trained parameters replaced by their
        averages (cast to each entry's dtype, on CPU-or-wherever the model is).
        Entries not averaged (other stage, buffers) keep the model's values."""
        state = model.state_dict()
        for key, avg in self._avg_by_key(model).items():
            if key in state:
                state[key] = avg.detach().to(dtype=state[key].dtype, copy=True)
        return state

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the averages into ``model``'s parameters (e.g. a copy for eval)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for key, avg in self._avg_by_key(model).items():
            if key in params:
                params[key].copy_(avg)
            else:
                raise KeyError(f"copy_to: model has no parameter {key!r}")
