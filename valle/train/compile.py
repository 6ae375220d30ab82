"""--compile: torch.compile of the model's training forward and loss.

The one entry point is `TrainingCompiler.wrap(module)`, which ResilientStep applies to
the module it calls (the model, or its DDP wrapper) and which returns something called
exactly like it. Only training forwards go through the compiled module (the module in
train mode, gradients on); validation and inference stay eager, so they neither
recompile nor wait for a compile. AOTAutograd compiles the matching backward, so
`loss.backward()` runs compiled code too; the optimizer is not compiled.

Shapes. Bucketed batches have a new (rows, text length, frames) almost every step. To
keep that from recompiling every batch:

* the time dimensions of text, audio and prompt are padded up to a multiple of
  `pad_multiple` (32 by default) with the pad ids the collate functions use. The
  model masks every column past a row's length (key masks, IGNORE targets, per-row
  positions), so the loss and gradients are those of the unpadded batch (tested:
  tests/train/test_compile.py); only the compute per step grows a little;
* those dimensions are marked dynamic (`torch._dynamo.maybe_mark_dynamic`) and the
  row count is left to dynamo's automatic dynamic shapes, so one graph serves every
  grid point; the padding still bounds the number of distinct shapes (guards on
  sizes 0/1 and the like) and gives kernels aligned lengths.

Compile time is reported through dynamo's compile callbacks: `listeners` hear the
start and end of every compile (the trainer pauses its stall watchdog and logs), and
`stats` counts compiles, recompiles (a compile after the first compiled step ran)
and the seconds spent compiling.

Fault injection and OOM recovery see no difference: named-phase faults are raised
outside the compiled module; an OOM raised inside it (by the allocator, or by the
allocation-level injector, whose TorchDispatchMode sees the ops the compiled code
dispatches) propagates as a normal exception to ResilientStep's guard.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from valle.train.batching import AUDIO_PAD, TEXT_PAD

logger = logging.getLogger(__name__)

DEFAULT_PAD_MULTIPLE = 32
# Positional inputs of the model's forward: (text, text_lens, audio, audio_lens).
_TEXT, _AUDIO = 0, 2


class Pausable(Protocol):
    """Told when a compile starts and ends (the stall watchdog: a compile is no stall)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class CompileStats:
    compiles: int = 0  # dynamo frame compiles (a graph break adds one per frame)
    recompiles: int = 0  # compiles after the first compiled call had finished
    backward_compiles: int = 0  # lazily compiled backward graphs
    seconds: float = 0.0  # wall time spent compiling (forward and backward)
    shapes: set[tuple[int, ...]] = field(default_factory=set)  # padded input shapes seen

    def summary(self) -> str:
        return (f"{self.compiles} compiles ({self.recompiles} recompiles, "
                f"{self.backward_compiles} backward), {self.seconds:.1f} s compiling, "
                f"{len(self.shapes)} padded shapes")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def pad_time(x: torch.Tensor | None, multiple: int, value: int) -> torch.Tensor | None:
    """`x` (B, L, ...) with L padded up to a multiple of `multiple` with `value`."""
    if x is None or multiple <= 1:
        return x
    extra = round_up(x.shape[1], multiple) - x.shape[1]
    if extra == 0:
        return x
    # F.pad pads the last dimension first: (0, 0) per trailing dimension, then L.
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra), value=value)


def pad_inputs(args: tuple, kwargs: dict[str, Any], multiple: int) -> tuple[tuple, dict[str, Any]]:
    """The forward's inputs with text, audio and prompt time dimensions on the grid."""
    args = list(args)
    args[_TEXT] = pad_time(args[_TEXT], multiple, TEXT_PAD)
    args[_AUDIO] = pad_time(args[_AUDIO], multiple, AUDIO_PAD)
    kwargs = dict(kwargs)
    kwargs["prompt_features"] = pad_time(kwargs.get("prompt_features"), multiple, AUDIO_PAD)
    languages = kwargs.get("text_languages")
    if languages is not None and languages.dim() == 2:  # per token: padded like the text
        kwargs["text_languages"] = pad_time(languages, multiple, 0)
    return tuple(args), kwargs


def mark_time_dynamic(args: tuple, kwargs: dict[str, Any]) -> None:
    """One graph for every length: dim 1 of the sequence inputs is symbolic."""
    for x in (args[_TEXT], args[_AUDIO], kwargs.get("prompt_features"),
              kwargs.get("text_languages")):
        if x is not None and x.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(x, 1)


class TrainingCompiler:
    """Compiles the training forward of the modules ResilientStep calls (see module doc)."""

    def __init__(self, pad_multiple: int = DEFAULT_PAD_MULTIPLE, dynamic: bool = True,
                 backend: str = "inductor", mode: str | None = None, eager: bool = False):
        self.pad_multiple = pad_multiple
        self.eager = eager  # the same path (padding, stacked metrics) without torch.compile
        self.dynamic = dynamic
        self.backend, self.mode = backend, mode
        self.stats = CompileStats()
        self.listeners: list[Pausable] = []
        self._compiled: dict[tuple[int, int], Callable[..., Any]] = {}
        self._calls = 0  # compiled calls that finished
        self._started: float | None = None
        self._lock = threading.Lock()
        self._installed = False
        # Now, at set-up, not in the first step: importing torch._dynamo and the backend
        # (inductor) takes seconds, tens of them on a busy host, and a rank importing in
        # its first step keeps its peers waiting in the step's collectives (which time out
        # at --collective-timeout) - while at set-up every rank imports before its vote.
        self._install_callbacks()
        torch._dynamo.lookup_backend(backend)
        if backend == "inductor":
            importlib.import_module("torch._inductor.compile_fx")  # lookup_backend defers it

    # -- the hook ResilientStep calls --------------------------------------------

    def wrap(self, module: nn.Module) -> Callable[..., Any]:
        """A callable with `module`'s signature: compiled in training, eager otherwise."""
        def forward(*args: Any, train_stage: int = 0, **kwargs: Any) -> Any:
            if not (module.training and torch.is_grad_enabled()):
                return module(*args, train_stage=train_stage, **kwargs)
            return self._call_compiled(module, train_stage, args, kwargs)

        return forward

    def _call_compiled(self, module: nn.Module, train_stage: int, args: tuple,
                       kwargs: dict[str, Any]) -> Any:
        args, kwargs = pad_inputs(args, kwargs, self.pad_multiple)
        if self.dynamic:
            mark_time_dynamic(args, kwargs)
        self.stats.shapes.add((*args[_TEXT].shape, *args[_AUDIO].shape))
        compiled = self._compiled.get((id(module), train_stage))
        if compiled is not None:
            out = compiled(*args, **kwargs)
        else:
            # Making the compiled callable and its first call set up dynamo and the
            # backend (imports, seconds) before any compile callback: all of it is
            # compile time for the watchdog.
            logger.info("--compile: compiling the training forward, loss and backward (first "
                        "step; minutes on CPU, the stall watchdog is paused meanwhile)")
            self._pause()
            try:
                compiled = self._compile(module, train_stage)
                out = compiled(*args, **kwargs)
            finally:
                self._resume()
            self._compiled[(id(module), train_stage)] = compiled
        self._calls += 1
        return out

    def _compile(self, module: nn.Module, train_stage: int) -> Callable[..., Any]:
        """The compiled forward of `module` in `train_stage`. The stage is a constant of
        the compiled code, not an input: as an input dynamo would make the int symbolic
        after the first change and compile one graph for all stages."""
        self._install_callbacks()  # again after a close()

        def training_forward(*args: Any, **kwargs: Any) -> Any:
            loss, metrics = module(*args, train_stage=train_stage, **kwargs)
            # The metrics leave the graph as one fresh tensor. Returned as they are, a
            # detached metric (nar_loss = nar.detach()) and the loss (0 + nar in stage 2)
            # become one buffer once inductor drops the no-op add and detach, and
            # AOTAutograd then marks that buffer non-differentiable: the loss came back
            # without a grad_fn (torch 2.9.1, inductor only; tests/train/test_compile.py).
            stacked = (torch.stack([v.float() for v in metrics.values()]) if metrics
                       else loss.new_zeros(0))
            return loss, tuple(metrics), stacked

        compiled = training_forward if self.eager else torch.compile(
            training_forward, backend=self.backend, mode=self.mode,
            dynamic=None if self.dynamic else False)

        def forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, keys, stacked = compiled(*args, **kwargs)
            return loss, dict(zip(keys, stacked.unbind(0)))

        return forward

    def _pause(self) -> None:
        for listener in self.listeners:
            listener.pause()

    def _resume(self) -> None:
        for listener in self.listeners:
            listener.resume()

    # -- compile events ------------------------------------------------------------

    def _install_callbacks(self) -> None:
        if self._installed:
            return
        handler = compile_callback_handler()
        if handler is None:
            logger.warning("--compile: this torch has no dynamo compile callbacks; compile "
                           "time is not reported and the stall watchdog is not paused")
        else:
            handler.register_start_callback(self._on_start)
            handler.register_end_callback(self._on_end)
        self._installed = True

    def close(self) -> None:
        """Unregister the compile callbacks (they are process-wide)."""
        handler = compile_callback_handler()
        if self._installed and handler is not None:
            for remove, callback in ((handler.remove_start_callback, self._on_start),
                                     (handler.remove_end_callback, self._on_end)):
                try:
                    remove(callback)
                except ValueError:
                    pass
        self._installed = False

    def _on_start(self, args: Any) -> None:
        lazy_backward = "BACKWARD" in str(getattr(args, "callback_trigger", ""))
        with self._lock:
            if lazy_backward:
                self.stats.backward_compiles += 1
            else:
                self.stats.compiles += 1
                self.stats.recompiles += self._calls > 0
            self._started = time.monotonic()
        if self._calls > 0 and not lazy_backward:
            logger.info("--compile: recompiling (a new input shape or guard; %s)",
                        self.stats.summary())
        self._pause()

    def _on_end(self, args: Any) -> None:
        with self._lock:
            if self._started is not None:
                self.stats.seconds += time.monotonic() - self._started
                self._started = None
        self._resume()


def compile_callback_handler() -> Any:
    """torch._dynamo's compile start/end callback registry (torch 2.6 to 2.11 at least),
    or None where this torch has none."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None:
        try:
            from torch._dynamo.callback import callback_handler as handler
        except ImportError:
            return None
    if not (hasattr(handler, "register_start_callback")
            and hasattr(handler, "register_end_callback")):
        return None
    return handler


def attach_compiler(step: Any, watchdog: Pausable | None, pad_multiple: int,
                    backend: str = "inductor", allocation_injector: bool = False
                    ) -> TrainingCompiler:
    """--compile: make `step` (a ResilientStep) call its model through a TrainingCompiler
    whose compiles pause `watchdog`; returns the compiler (its stats are logged).

    `allocation_injector`: some rank runs the allocation-level injector (alloc@, the
    sweep's census). Under its TorchDispatchMode dynamo compiles nothing (docs/oom.md), so
    that rank would run eagerly while the others spend minutes compiling, and wait for
    them in the step's collectives past --collective-timeout. Every rank then takes the
    --compile path (padding, stacked metrics) without torch.compile, in step."""
    if allocation_injector:
        logger.warning("--compile with the allocation-level fault injector (alloc@, "
                       "--count-allocations): torch.compile cannot run under it, so every "
                       "rank runs the model eagerly (padding and all) to stay in step")
    compiler = TrainingCompiler(pad_multiple=pad_multiple, backend=backend,
                                eager=allocation_injector)
    if watchdog is not None:
        compiler.listeners.append(watchdog)
    step.settings.wrap_forward = compiler.wrap
    return compiler


def compile_note(compiler: TrainingCompiler | None) -> str:
    """The progress line's compile part ("" without --compile)."""
    return f" | compile: {compiler.stats.summary()}" if compiler is not None else ""
