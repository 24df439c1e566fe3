"""The continuous batch's core iteration compiled for the CPU (docs/generation.md, "Compiled decoding on the
CPU").

On the CPU a decode step is dozens of small eager ops per core iteration, and at batch 1 its matmuls are
matrix-vector products that MKL runs far below the machine's bandwidth. With the static step on
(`ContinuousBatch(compile=True)`), the step's one core iteration (`StaticStep.iteration`: every shape fixed,
the rows' slots and indices device tensors) is compiled by inductor:

- `freezing`: the weights are constants of the compiled code, so inductor packs them once for its own GEMM
  kernels (`max_autotune` over its C++ GEMM template and ATen's, measured per shape);
- the cache writes stay in place (the `rdlm::put_entries` op of rdlm.inference.cache);
- the weights' stamp (`weights_stamp`): the compiled code holds the weights it was compiled with, so it is
  reused only for the same model object with the same parameter tensors at the same versions (an in-place
  update, a training step, `load_state_dict`, compiles again).

Compiled code is cached by inductor on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under the system's
temporary directory), so a second process with the same model shape compiles in a fraction of the first
one's time. The eager path stays the reference: `compile=False` (the CLI's `--no-compile`) turns the static
step off, and `RDLM_COMPILE=0` keeps it eager (uncompiled).
"""

from __future__ import annotations

import itertools
import os
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

COMPILE_ENV = "RDLM_COMPILE"  # "0": never compile on the CPU (the eager path), whatever a caller asks

# The inductor settings the iteration is compiled under (read when it compiles).
INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}

# Up to this many rows, a compiled CPU step runs on one intra-op thread: its matrix-vector products are bound by
# memory, and a second thread costs a wake-up per op (OMP_WAIT_POLICY=PASSIVE) for no gain (measured on two
# cores: the `small` preset at batch 1, r = 32, 58 tokens/s on one thread against 24 on two).
SINGLE_THREAD_ROWS = 16

# `compile=None` on the CPU compiles where it pays back its compile time (~25 s for a new shape, ~8 s when
# inductor's cache on disk has it, against ~2x faster decoding): a job of at most SINGLE_THREAD_ROWS rows and at
# least this many core iterations per row (512 tokens at r = 32).
COMPILE_MIN_ITERATIONS = 16384
LENGTH_BUCKET = 128  # a compiled engine's cache length is rounded up to this, so calls of other lengths reuse it

_serials = itertools.count(1)


def cpu_compiled(static: bool, device: torch.device) -> bool:
    """Whether an engine's static step is compiled: on the CPU, unless RDLM_COMPILE=0 (which leaves the static
    step eager)."""
    return static and device.type == "cpu" and compile_allowed()


def compile_pays(rows: int, iterations_per_row: int, rounds: bool) -> bool:
    """Whether `compile=None` compiles a CPU job of `rows` rows and `iterations_per_row` core iterations each
    (`rounds`: speculative decoding or the parallel sampler, which do not run the static step)."""
    return (
        compile_allowed() and not rounds and rows <= SINGLE_THREAD_ROWS and iterations_per_row >= COMPILE_MIN_ITERATIONS
    )


@contextmanager
def step_threads(rows: int, compiled: bool) -> Iterator[None]:
    """Run a CPU step of a batch of `rows` rows on one thread where that is faster (`SINGLE_THREAD_ROWS`, the
    compiled step), then restore the thread count."""
    before = torch.get_num_threads()
    if not compiled or rows > SINGLE_THREAD_ROWS or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compile_allowed() -> bool:
    """False when RDLM_COMPILE=0 switches compiling on the CPU off."""
    return os.environ.get(COMPILE_ENV, "1").strip() not in ("0", "false", "no", "off")


def weights_stamp(model: RecurrentDepthLM) -> int:
    """An int that changes when the weights compiled code was frozen with may have: the model object (a serial
    number kept on it), each parameter's storage and its version counter (bumped by every in-place write)."""
    serial = model.__dict__.get("_rdlm_serial")
    if serial is None:
        serial = next(_serials)
        model.__dict__["_rdlm_serial"] = serial
    params = list(model.parameters()) + list(model.buffers())
    return hash((serial, tuple(p.data_ptr() for p in params), tuple(p._version for p in params)))


def _iteration(step: Any) -> tuple[Tensor, Tensor]:
    return step.iteration()


# Compiled functions by weights stamp, the latest few. Each is a copy of `_iteration` with a code object of its
# own, since dynamo keeps compiled code per code object and its guards do not see the values of frozen
# weights: code compiled for other weights is never even looked at. Dropping one frees its code and weights.
KEEP_COMPILED = 4
_compiled: OrderedDict[int, Callable[[Any], tuple[Tensor, Tensor]]] = OrderedDict()


def _compiled_iteration(stamp: int) -> Callable[[Any], tuple[Tensor, Tensor]]:
    fn = _compiled.get(stamp)
    if fn is not None:
        _compiled.move_to_end(stamp)
        return fn
    name = f"_iteration_{next(_serials)}"
    own = types.FunctionType(_iteration.__code__.replace(co_name=name), _iteration.__globals__, name)
    fn = torch.compile(own, fullgraph=True, dynamic=False)
    _compiled[stamp] = fn
    while len(_compiled) > KEEP_COMPILED:
        _compiled.popitem(last=False)
    return fn


class CompiledIteration:
    """`step.iteration()` compiled (see the module doc); `seconds`: time spent compiling (the first call of
    each shape), `failed`: the compiler raised, so the step runs eagerly from then on (with a warning).
    `refresh()` (at every step) re-reads the weights' stamp, so weights changed between steps compile again."""

    def __init__(self, step: Any, model: RecurrentDepthLM) -> None:
        self.step, self.model = step, model
        self.seconds = 0.0
        self.failed = False
        self._fn: Callable[[Any], tuple[Tensor, Tensor]] | None = None
        self._stamp: int | None = None
        self._ready = False  # the current function has compiled this step's shapes
        self.refresh()

    def refresh(self) -> None:
        stamp = weights_stamp(self.model)
        if stamp != self._stamp:
            self._stamp, self._fn, self._ready = stamp, _compiled_iteration(stamp), False

    def __call__(self) -> tuple[Tensor, Tensor]:
        if self.failed or self._fn is None:
            return self.step.iteration()
        if self._ready:
            return self._fn(self.step)
        t0 = time.perf_counter()
        try:
            with torch._inductor.config.patch(INDUCTOR):
                out = self._fn(self.step)
        except Exception as err:  # noqa: BLE001  (any compiler failure: the eager step gives the same results)
            self.failed = True
            warnings.warn(
                f"compiling the decode step failed, so this engine runs it eagerly (the same results, slower): "
                f"{type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.step.iteration()
        finally:
            self.seconds += time.perf_counter() - t0
        self._ready = True
        return out
