"""Static steps: model calls whose every tensor has a fixed shape and lives on the device, so the host
asks nothing inside them and CUDA can capture them once as a graph and replay it (docs/inference.md,
"the decode engine").

`ContinuousBatch` (rdlm.inference.batching) runs its decoding rows' core iteration this way, and its
`Lockstep` (rdlm.inference.runner.lockstep) a whole token; each holds one `StaticSteps`, the cache of its captured
graphs.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from rdlm.inference.execution.cpu_compile import compile_forced


class StaticSteps:
    """Runs static bodies: eagerly on the CPU, on CUDA through a CUDA graph captured on a body's first
    use and keyed by what the body runs. `static` False marks an engine that takes its eager path
    instead (`resolve_compile`); `runs` counts the bodies run (eager or replayed), so a caller can tell
    the static path was taken."""

    def __init__(self, device: torch.device, static: bool, shared_pool: bool = False) -> None:
        self.device, self.static = device, static
        self.graphs = static and device.type == "cuda"
        # One memory pool for all of this engine's graphs (their scratch memory is not multiplied by their
        # number): safe when every graph's outputs are read before another of them replays.
        self.pool = torch.cuda.graph_pool_handle() if self.graphs and shared_pool else None
        self.graphed: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # key -> (graph, its outputs)
        self.capture_seconds = 0.0
        self.runs = 0

    def run(self, key: tuple, body: Callable[[], tuple], idempotent: bool = True) -> tuple:
        """Run a static body. A replay's outputs are the graph's own tensors, overwritten by the next
        replay. The first call runs the body once to warm up (allocator, cuBLAS workspaces), captures it,
        then replays it; a body that updates its inputs in place (`idempotent=False`) is not replayed
        after the warm-up that already did its work. A capture that fails (a CUDA error inside it) leaves
        the warm-up's outputs and makes every later run eager, with a warning."""
        self.runs += 1
        if not self.graphs:
            return body()
        if key in self.graphed:
            graph, outputs = self.graphed[key]
            graph.replay()
            return outputs
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            warm = body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a collection inside the capture that frees another graph's memory would invalidate it
        try:
            with torch.cuda.graph(graph, pool=self.pool):  # collects garbage first
                outputs = body()
        except RuntimeError as err:  # the capture failed (the warm-up ran): this engine goes on eagerly
            self.graphs = False
            self.capture_seconds += time.perf_counter() - t0
            warnings.warn(
                f"capturing a CUDA graph failed, so this engine runs its static steps eagerly "
                f"from now on (the same results, without graphs): {err}",
                RuntimeWarning,
                stacklevel=2,
            )
            return warm
        finally:
            if collecting:
                gc.enable()
        self.graphed[key] = (graph, outputs)
        self.capture_seconds += time.perf_counter() - t0
        if not idempotent:
            return warm
        graph.replay()
        return outputs


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """The static decode step: on by default on CUDA (captured in CUDA graphs). On the CPU only when asked
    for (`generate` and `rdlm serve` ask where it pays), where its core iteration is compiled by inductor
    unless RDLM_COMPILE=0 (rdlm.inference.execution.cpu_compile.cpu_compiled); RDLM_COMPILE=force turns it on there by
    default."""
    if compile is None:
        return device.type == "cuda" or (device.type == "cpu" and compile_forced())
    return bool(compile)


def resolve_sync_every(sync_every: int | None, device: torch.device) -> int:
    """Iterations (or batch steps) between the host's looks at the exit flags: `sync_every` when given; else
    1 on the CPU, where a look waits for nothing (the work is done when a call returns) and rows that
    exited leave the calls at once, and 4 on an accelerator, where each look drains the queued work."""
    if sync_every is None:
        return 1 if device.type == "cpu" else 4
    return sync_every


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a clock read after it counts that work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimes:
    """Seconds per named phase of an engine's steps, accumulated while `on` (the device synchronized around
    each phase, so a phase counts its own queued work); `take` hands them over."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.device = device
        self.seconds: dict[str, float] | None = {} if on else None

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        if self.seconds is None:
            yield
            return
        sync(self.device)
        t0 = time.perf_counter()
        yield
        sync(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """The seconds per phase accumulated since the last call (empty when off)."""
        if not self.seconds:
            return {}
        taken, self.seconds = self.seconds, {}
        return taken
