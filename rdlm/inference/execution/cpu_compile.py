"""The continuous batch's core iteration compiled for the CPU (docs/generation.md, "Compiled decoding on the
CPU").

On the CPU a decode step is dozens of small eager ops per core iteration, and at batch 1 its matmuls are
matrix-vector products that MKL runs far below the machine's bandwidth. With the static step on
(`ContinuousBatch(compile=True)`), the step's one core iteration (`StaticStep.iteration`: every shape fixed,
the rows' slots and indices device tensors) is compiled by inductor, and so are a token's prelude and its coda
with the head, each over the batch's first rows (`compiled_parts`):

- `freezing`: the weights are constants of the compiled code, so inductor packs them once for its own GEMM
  kernels (`max_autotune` over its C++ GEMM template and ATen's, measured per shape); `cpp_wrapper`: the
  call itself is C++;
- the cache writes stay in place (the `rdlm::put_entries` op of rdlm.inference.execution.cache);
- the weights' stamp (`weights_stamp`): the compiled code holds the weights it was compiled with, so it is
  reused only for the same model object with the same parameter tensors at the same versions (an in-place
  update, a training step, `load_state_dict`, compiles again), in the same mode, configuration and attention
  implementation;
- dynamo's guards are checked in full only at a call of argument shapes the step has not run yet; later
  calls of those shapes check only the guards that tell its compiled entries apart
  (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`). What the full check would catch cannot change
  in between for what rdlm changes: the step's tensors are allocated once for the engine's life, and the model's
  weights (so any layer swapped for one with other parameters: quantized, adapted), mode, configuration and
  attention implementation are in the stamp, whose change compiles a new copy.
  The full check of a core iteration of `small` took ~75-190 µs of a 1.1-4 ms call on an Intel Cascade Lake;
  skipping it decoded 1.06x faster (batch 1 and 4, r = 32; docs/generation.md).

The prompts being prefilled run their core iterations in packed calls of their own (rdlm.inference.runner.prefill),
compiled separately (`CompiledPrompts`): any number of tokens, frozen weights without the GEMM search, each chunk's
attention an opaque op.

Quantized layers (rdlm.model.quantize) compile with the rest: inductor lowers PyTorch's weight-only int8 and
int4 kernels to its own C++ templates or keeps ATen's, whichever it measures faster per shape; a w8a8 layer
computes FBGEMM's product in tensor ops (rdlm.model.w8a8: its quantization of the input and its int32 sums).

A model with LoRA adapters (rdlm.model.lora) is not compiled: each call routes its tokens to their rows'
adapters by swapping the adapted layers' forward, which the compiled code would not see; its static step, when
asked for, runs eagerly, and the defaults (`compile_pays`, `server_compiles`) leave it off.

Compiled code is cached by inductor on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under the system's
temporary directory), so a second process with the same model shape compiles in a fraction of the first
one's time. The eager path stays the reference: `compile=False` (the CLI's `--no-compile`) turns the static
step off, `RDLM_COMPILE=0` keeps it eager (uncompiled), and `RDLM_COMPILE=force` compiles every CPU engine
that `compile=None` leaves to rdlm.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rdlm.inference.execution.cache import PackedCall
from rdlm.inference.execution.model_calls import packed_iteration
from rdlm.model.layers import Attention
from rdlm.model.lora import loaded_adapters
from rdlm.model.quantize import traceable

if TYPE_CHECKING:
    from rdlm.model.lm import RecurrentDepthLM

COMPILE_ENV = "RDLM_COMPILE"  # "0": never compile on the CPU, whatever a caller asks; "force": compile every engine

# The inductor settings the iteration is compiled under (read when it compiles).
# cpp_wrapper: the compiled call's kernel launches in C++, not Python (b1 r32 on the `small` preset: +11%
# tokens/s, the compile 6 s longer).
# The last two keep the autotuner's tables of timings off stderr (the CLI's output).
INDUCTOR = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "cpp_wrapper": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}

# Warnings torch 2.13's compiler raises from its own code while it compiles (nothing a user can act on).
QUIET = (r".*TypedStorage is deprecated.*", r".*torch\.jit\.script_method.* is deprecated.*")

# Up to this many rows, a compiled CPU step runs on one intra-op thread: its products are small, and a second
# thread costs a wake-up per op (OMP_WAIT_POLICY=PASSIVE) for little gain (measured on two cores: the `small`
# preset at batch 1, r = 32, 58 tokens/s on one thread against 24 on two; `benchmarks/bench_cpu_compile.py
# threads`, one thread over two: 1.16x at 32 rows, 1.39x at 24, 0.95x at 64; docs/generation.md).
SINGLE_THREAD_ROWS = 32

# `compile=None` on the CPU compiles where it pays back its compile time (~15-30 s for a new shape, ~12 s when
# inductor's caches on disk have it, against ~2x faster decoding, measured when only the core iteration compiled;
# with the prelude and coda too, the compile takes about twice as long and decoding gains more): a job of at most
# SINGLE_THREAD_ROWS rows and at least this many core iterations per row (512 tokens at r = 32).
COMPILE_MIN_ITERATIONS = 16384
LENGTH_BUCKET = 128  # a compiled engine's cache length is rounded up to this, so calls of other lengths reuse it

# A call of shapes a compiled part has run checks only dynamo's differentiating guards (the module doc); False
# checks them all at every call (benchmarks/bench_cpu_compile.py measures the two).
SKIP_GUARDS = True

_serials = itertools.count(1)


def cpu_compiled(static: bool, device: torch.device, model: RecurrentDepthLM) -> bool:
    """Whether an engine's static step is compiled: on the CPU, unless RDLM_COMPILE=0 or the model holds LoRA
    adapters (either leaves the static step eager)."""
    return static and device.type == "cpu" and compile_allowed() and not loaded_adapters(model)


def compile_pays(rows: int, iterations_per_row: int, rounds: bool, adapters: bool = False) -> bool:
    """Whether `compile=None` compiles a CPU job of `rows` rows and `iterations_per_row` core iterations each
    (`rounds`: speculative decoding or the parallel sampler, which do not run the static step; `adapters`: the
    model holds LoRA adapters, which are not compiled)."""
    if rounds or adapters or not compile_allowed():
        return False
    return compile_forced() or (rows <= SINGLE_THREAD_ROWS and iterations_per_row >= COMPILE_MIN_ITERATIONS)


# `rdlm serve` compiles its step by default for a batch of at most this many rows. Served against the eager step
# on the same random `small` model at r = 8 (2-core AMD EPYC Zen 5, docs/serving.md "Compiled above 16 rows";
# the compiled step then ran on every thread above 16 rows), it gave 1.30x, 1.25x and 1.21x the tokens/s at 24, 32
# and 64 clients with the same time to first token (medians of two runs; with a latent-diff exit at 32 clients,
# 1.23x where it never fired and 1.03x where it did). Larger batches and other CPUs were not measured.
SERVER_COMPILE_ROWS = 64


def server_compiles(rows: int, adapters: bool = False) -> bool:
    """Whether `rdlm serve` compiles a CPU batch of `rows` rows by default: a server lives long enough to pay
    back its compile wherever the compiled step was measured faster (at most SERVER_COMPILE_ROWS rows), or always
    with RDLM_COMPILE=force; never a model with LoRA adapters (`adapters`), which are not compiled."""
    return compile_allowed() and not adapters and (rows <= SERVER_COMPILE_ROWS or compile_forced())


def one_thread_step(rows: int, compiled: bool) -> bool:
    """Whether a CPU step of a batch of `rows` rows runs on one thread (`step_threads`): the compiled step's, up to
    SINGLE_THREAD_ROWS rows."""
    return compiled and rows <= SINGLE_THREAD_ROWS


@contextmanager
def on_threads(threads: int, cpus: set[int] | None = None) -> Iterator[None]:
    """Run on `threads` intra-op threads and, where `cpus` are given, on those CPUs (the calling thread's affinity,
    which the threads it starts inherit, widened for the time: an engine process pinned to one CPU), then restore
    both."""
    before = torch.get_num_threads()
    pinned = os.sched_getaffinity(0) if cpus is not None else None
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


@contextmanager
def step_threads(rows: int, compiled: bool) -> Iterator[None]:
    """Run a CPU step of a batch of `rows` rows on one thread where that is faster (`one_thread_step`), then
    restore the thread count."""
    if not one_thread_step(rows, compiled) or torch.get_num_threads() == 1:
        yield
        return
    with on_threads(1):
        yield


def compile_allowed() -> bool:
    """False when RDLM_COMPILE=0 switches compiling on the CPU off."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def compile_forced() -> bool:
    """RDLM_COMPILE=force: every CPU engine that can compiles (`compile=None` included), whatever it pays."""
    return os.environ.get(COMPILE_ENV, "").strip().lower() == "force"


def weights_stamp(model: RecurrentDepthLM) -> int:
    """An int that changes when what compiled code was made for may have: the model object (a serial number kept
    on it), each parameter's storage and its version counter (bumped by every in-place write), its training mode,
    its configuration and its attention layers' implementation (`set_attention`)."""
    serial = model.__dict__.get("_rdlm_serial")
    if serial is None:
        serial = next(_serials)
        model.__dict__["_rdlm_serial"] = serial
    # One pass over the modules (a step's first act reads this: parameters() and buffers() would walk the tree
    # twice more; on `small` the one pass took ~0.15-0.2 ms against ~0.45 ms)
    parts: list[object] = [serial, model.training, repr(model.config)]
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                parts += (tensor.data_ptr(), tensor._version)
        if isinstance(module, Attention):
            parts.append(module.implementation)
    return hash(tuple(parts))


def _iteration(step: Any, *args: Tensor) -> tuple[Tensor, Tensor]:
    return step.iteration(*args)


def _prelude(step: Any, *args: Tensor) -> Tensor:
    return step.prelude_body(*args)


def _readout(step: Any, *args: Tensor) -> Tensor:
    return step.readout_body(*args)


# Compiled functions by (function, weights stamp), the latest few. Each is a copy of its function with a code
# object of its own, since dynamo keeps compiled code per code object and its guards do not see the values of
# frozen weights: code compiled for other weights is never even looked at. Dropping one frees its code and its
# weights.
KEEP_COMPILED = 8
_compiled: OrderedDict[tuple[str, int], Callable[..., Any]] = OrderedDict()


def _compiled_copy(fn: Callable[..., Any], stamp: int, dynamic: bool = False) -> Callable[..., Any]:
    """`fn` compiled whole for the weights of `stamp` (fixed shapes, or `dynamic` sizes), shared while kept."""
    key = (fn.__name__, stamp)
    compiled = _compiled.get(key)
    if compiled is not None:
        _compiled.move_to_end(key)
        return compiled
    name = f"{fn.__name__}_{next(_serials)}"
    own = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__)
    compiled = torch.compile(own, fullgraph=True, dynamic=dynamic)
    _compiled[key] = compiled
    while len(_compiled) > KEEP_COMPILED:
        _compiled.popitem(last=False)
    return compiled


def _compiling(
    part: Any,
    what: str,
    settings: dict[str, Any],
    compiled: Callable[[], Any],
    eager: Callable[[], Any],
    timed: bool = True,
) -> Any:
    """`compiled()`, a call that may compile, under the inductor `settings` with torch's own warnings from inside
    the compiler kept quiet, its time added to `part.seconds` where `timed`. Where the compiler raises, `part.failed`
    is set, a warning names `what`, and `eager()` gives the same results."""
    t0 = time.perf_counter()
    try:
        with torch._inductor.config.patch(settings), warnings.catch_warnings():
            for message in QUIET:  # torch's own deprecations from inside the compiler, not the user's code
                warnings.filterwarnings("ignore", message=message)
            return compiled()
    except Exception as err:  # noqa: BLE001  (any compiler failure: the eager code gives the same results)
        part.failed = True
        warnings.warn(
            f"compiling {what} failed, so this engine runs it eagerly (the same results, slower): "
            f"{type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return eager()
    finally:
        if timed:
            part.seconds += time.perf_counter() - t0


class Compiled:
    """`fn(owner, *args)` compiled for `model`'s weights (see the module doc); `eager` computes the same where
    the compiler failed. `seconds`: time spent compiling (each new shape's first call), `failed`: the compiler
    raised, so this runs eagerly from then on (with a warning). `refresh()` re-reads the weights' stamp, so
    weights changed since compile again."""

    def __init__(self, fn: Callable[..., Any], owner: Any, model: RecurrentDepthLM, eager: Callable[..., Any]) -> None:
        self.fn, self.owner, self.model, self.eager = fn, owner, model, eager
        self.seconds = 0.0
        self.failed = False
        self._compiled: Callable[..., Any] | None = None
        self._stamp: int | None = None
        self._shapes: set[tuple] = set()  # argument shapes compiled for the current weights
        self.refresh()

    def refresh(self, stamp: int | None = None) -> None:
        stamp = weights_stamp(self.model) if stamp is None else stamp
        if stamp != self._stamp:
            self._stamp, self._compiled, self._shapes = stamp, _compiled_copy(self.fn, stamp), set()

    def __call__(self, *args: Tensor) -> Any:
        if self.failed or self._compiled is None:
            return self.eager(*args)
        shapes = tuple(a.shape for a in args)
        if shapes in self._shapes:  # guards checked in full at these shapes' first call (the module doc)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=SKIP_GUARDS):
                return self._compiled(self.owner, *args)
        compiled = self._compiled
        out = _compiling(
            self, "the decode step", INDUCTOR, lambda: compiled(self.owner, *args), lambda: self.eager(*args)
        )
        self._shapes.add(shapes)
        return out


def compiled_iteration(step: Any, model: RecurrentDepthLM) -> Compiled:
    """`step.iteration()` (rdlm.inference.runner.static_step.StaticStep) compiled; a quantized model's layers are
    made traceable first (a w8a8 layer's FBGEMM weight is opaque to the compiler: rdlm.model.quantize.traceable)."""
    traceable(model)
    return Compiled(_iteration, step, model, step.iteration)


# The packed calls whose attention `rdlm::packed_attention` runs, by handle: (the call, its model), registered for
# the length of one compiled call (`CompiledPrompts`).
_packed_calls: dict[int, tuple[PackedCall, RecurrentDepthLM]] = {}
_handles = itertools.count()


@torch.library.custom_op("rdlm::packed_attention", mutates_args=())
def packed_attention(q: Tensor, k: Tensor, v: Tensor, handle: Tensor, layer: int) -> Tensor:
    """Attention of core layer `layer` over the packed call registered under `handle` (`PackedCall.attend`: each
    chunk against its own cache rows, its keys and values written there first), an op the compiler keeps whole:
    its segments, slices and masks are the call's own, which a compiled graph would otherwise specialize on.
    (It writes the cache, which is not among its arguments: nothing else in the compiled call reads it.)"""
    packed, model = _packed_calls[int(handle)]
    block = model.core[layer]
    assert isinstance(block.attn, Attention)  # (a core layer's)
    return packed.attend(("core", layer, 0), q, k, v, block.attn.attention)


@packed_attention.register_fake
def _packed_attention_fake(q: Tensor, k: Tensor, v: Tensor, handle: Tensor, layer: int) -> Tensor:
    return q.new_empty(q.shape)  # (the real one: contiguous, from one `cat`)


class _OpaquePack:
    """What the compiled call sees of a packed call: attention as `rdlm::packed_attention` over its handle."""

    def __init__(self, handle: Tensor) -> None:
        self.handle = handle

    def attend(self, key: tuple[str, int, int], q: Tensor, k: Tensor, v: Tensor, attention: Any) -> Tensor:
        return torch.ops.rdlm.packed_attention(q, k, v, self.handle, key[1])


# The inductor settings the prompts' iteration is compiled under: frozen weights (inductor packs them for oneDNN's
# GEMMs, about 2x ATen's MKL calls at 8-334 rows on a 2-core AMD EPYC), no GEMM search (its choices would hold for
# one token count only).
PROMPT_INDUCTOR = {"freezing": True}

# Where the step runs on one thread, the prompts' iteration may run on all of them (`CompiledPrompts.wide_from`):
# at warm-up, packed calls of these many tokens are timed on one thread and on all, alternated
# (`CompiledPrompts.measure_threads`), and calls from the fewest tokens where all threads took at most
# PROMPT_THREAD_GAIN of one thread's time, and at every larger size measured, run on all. Whether that pays
# depends on the CPU: on a 2-core AMD EPYC Zen 3 a probe brought bursts of prompts to their first tokens in ~0.75x
# the time (offline), on a Zen 5 two threads took 1.2-2.1x one thread's time at every size (docs/generation.md).
PROMPT_THREAD_TOKENS = (8, 16, 32, 48, 64, 96, 128)
PROMPT_THREAD_GAIN = 0.9
PROMPT_THREAD_ROUNDS = 7


class CompiledPrompts:
    """The prompts' packed core iteration (`ModelCalls.iterate_packed`) compiled for `model`'s weights, whole, with
    the number of tokens a dynamic size: inductor fuses each layer's per-token work (norms, RoPE, the MLP's gate,
    the residual sums) around oneDNN's products with packed weights (`PROMPT_INDUCTOR`), and attention, which runs
    per prompt chunk against its own cache rows, is one opaque op (`rdlm::packed_attention`). Like `Compiled`, the
    code is kept per weights: `refresh()` re-reads their stamp, and weights changed since compile again.
    `seconds`: time spent compiling; `failed`: the compiler raised, so this runs eagerly from then on (with a
    warning). Calls of at least `wide_from` tokens run on `threads` threads (and on `cpus`, where given:
    `on_threads`), chosen by `measure_threads`; compiled code is kept per thread count (dynamo guards on it)."""

    def __init__(self, model: RecurrentDepthLM) -> None:
        self.model = model
        self.seconds = 0.0
        self.failed = False
        self.threads = 1
        self.wide_from: int | None = None
        self.cpus: set[int] | None = None
        # what `measure_threads` measured: tokens -> (median seconds on one thread, on `threads`)
        self.measured: dict[int, tuple[float, float]] = {}
        self._compiled: Callable[..., Any] | None = None
        self._stamp: int | None = None
        # (threads, whether of one token) of the calls compiled (the compiler specializes a size of 1)
        self._sizes: set[tuple[int, bool]] = set()
        self._handle = torch.zeros((), dtype=torch.long)
        self.refresh()

    def refresh(self, stamp: int | None = None) -> None:
        stamp = weights_stamp(self.model) if stamp is None else stamp
        if stamp != self._stamp:
            self._stamp, self._sizes = stamp, set()
            self._compiled = _compiled_copy(packed_iteration, stamp, dynamic=True)

    def __call__(self, states: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, packed: PackedCall) -> Tensor:
        if self.wide_from is not None and states.shape[1] >= self.wide_from:
            with on_threads(self.threads, self.cpus):
                return self._call(states, embedded, cos, sin, packed)
        return self._call(states, embedded, cos, sin, packed)

    def _call(self, states: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, packed: PackedCall) -> Tensor:
        if self.failed or self._compiled is None:
            return packed_iteration(self.model, states, embedded, cos, sin, packed)
        size = (torch.get_num_threads(), states.shape[1] == 1)
        handle = next(_handles)
        _packed_calls[handle] = (packed, self.model)
        self._handle.fill_(handle)
        compiled, hook = self._compiled, _OpaquePack(self._handle)
        try:  # (every call guarded: a later one may compile again, for another dtype, say)
            out = _compiling(
                self,
                "the prompts' iteration",
                PROMPT_INDUCTOR,
                lambda: compiled(self.model, states, embedded, cos, sin, hook),
                lambda: packed_iteration(self.model, states, embedded, cos, sin, packed),
                timed=size not in self._sizes,  # a new size class or thread count: this call compiles
            )
        finally:
            del _packed_calls[handle]
        self._sizes.add(size)
        return out

    def measure_threads(self, threads: int, call: Callable[[int], Any]) -> None:
        """Choose `wide_from` for calls on `threads` threads (module doc, PROMPT_THREAD_TOKENS): `call(tokens)` runs
        one packed iteration of that many tokens through this. None where one thread was as fast at 128 tokens,
        where `threads` is 1, or where the compiler failed."""
        self.threads, self.wide_from, self.measured = threads, None, {}
        if threads < 2 or self.failed:
            return
        times: dict[tuple[int, int], list[float]] = {(t, n): [] for t in PROMPT_THREAD_TOKENS for n in (1, threads)}
        for round_ in range(PROMPT_THREAD_ROUNDS + 1):  # (the first round compiles each and is not counted)
            order = (1, threads) if round_ % 2 else (threads, 1)
            for tokens in PROMPT_THREAD_TOKENS:
                for n in order:
                    start = time.perf_counter()
                    with on_threads(n, self.cpus if n > 1 else None):  # (switching in and back counted)
                        call(tokens)
                    if round_:
                        times[tokens, n].append(time.perf_counter() - start)
        if self.failed:
            return
        self.measured = {
            t: (statistics.median(times[t, 1]), statistics.median(times[t, threads])) for t in PROMPT_THREAD_TOKENS
        }
        for tokens in reversed(PROMPT_THREAD_TOKENS):
            one, wide = self.measured[tokens]
            if wide > PROMPT_THREAD_GAIN * one:
                break
            self.wide_from = tokens


def compiled_parts(step: Any) -> tuple[Compiled, Compiled]:
    """The rest of a token beside `compiled_iteration`: `step.prelude_body()` and `step.readout_body()` compiled
    for the weights of the model the step calls (made traceable by `compiled_iteration` first)."""
    model = step.calls.model
    return Compiled(_prelude, step, model, step.prelude_body), Compiled(_readout, step, model, step.readout_body)
