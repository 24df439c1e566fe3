"""`rdlm serve` with its batch in a process of its own (ServeConfig.engine_process, `rdlm serve --engine-process`): the same
answers as the batch in the server's thread, requests cancelled and ended there, and a child that dies replaced
without taking the server down. A live server on 127.0.0.1; every wait is bounded."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from rdlm.inference.server.app import create_app  # noqa: E402
from rdlm.inference.execution.cpu_compile import SINGLE_THREAD_ROWS  # noqa: E402
from rdlm.inference.server.engine import engine_process  # noqa: E402
from rdlm.inference.server.config import ServeConfig  # noqa: E402
from tests.serve_helpers import (  # noqa: E402,F401
    DEFAULTS, ROOT, LiveServer, ask_concurrently, free_port, httpx, model_dir, wait_gone, wait_until)


@pytest.fixture(scope="module")
def live(model_dir):
    with LiveServer(model_dir, engine_process=True) as server:
        yield server


def test_the_batch_runs_in_a_child_process_and_answers_as_generate(live):
    worker = live.app.state.worker
    child = worker.engine.process
    assert child.is_alive() and child.pid != os.getpid()
    with pytest.raises(AttributeError, match="engine process"):
        worker.batch  # noqa: B018 (the batch is not in this process)
    ids = live.tokenizer.encode("the cat", add_bos=True)
    out = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
    assert out.choices[0].text == live.expected(ids, stop_tokens=(live.tokenizer.eos_id,))[0]
    assert out.usage.model_extra["latent_iterations"] == 4 * out.usage.completion_tokens
    ask_concurrently(live)  # depths, exits, budgets and sampling side by side in the child's batch


def test_metrics_come_back_from_the_child(live):
    live.client().completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0)
    text = httpx.get(live.url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["rdlm_generated_tokens_total"] >= 3
    assert values["rdlm_batch_step_seconds_total"] > 0
    assert values["rdlm_time_to_first_token_seconds_count"] >= 1 and values["rdlm_prefill_seconds_count"] >= 1
    wait_until(lambda: "rdlm_batch_size 0.0" in httpx.get(live.url + "/metrics", timeout=10).text,
               what="the batch gauge never came back to 0")


def test_a_disconnected_stream_frees_its_row_in_the_child(live):
    worker = live.app.state.worker
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "the", "max_tokens": 80, "num_steps": 16,
                            "stream": True}) as response:
        assert next(response.iter_lines()).startswith("data: ")
    wait_until(lambda: not worker.pending and not worker.tickets, what="the cancelled request is still counted")
    wait_until(lambda: "rdlm_batch_size 0.0" in httpx.get(live.url + "/metrics", timeout=10).text,
               what="the child still runs the cancelled row")


def test_a_request_the_batch_refuses_is_a_400_from_the_child(live):
    with pytest.raises(openai.BadRequestError, match="longer|length|context|tokens"):
        live.client().completions.create(model="tiny", prompt="the cat " * 80, max_tokens=8)
    assert live.app.state.worker.pending == 0


def test_a_child_that_dies_fails_its_requests_and_a_new_one_serves_the_next(live):
    worker = live.app.state.worker
    first = worker.engine.process
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "the", "max_tokens": 80, "num_steps": 16,
                            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(first.pid, signal.SIGKILL)
        rest = list(lines)
    assert any("died" in line for line in rest), rest[-3:]  # the stream ends with an error event, not a hang
    wait_until(lambda: worker.engine.process is not first and worker.engine.process.is_alive(), seconds=60,
               what="no new engine process")
    out = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4 and worker.pending == 0


def test_the_child_ends_with_the_server(model_dir):
    with LiveServer(model_dir, engine_process=True) as server:
        child = server.app.state.worker.engine.process
        server.client().completions.create(model="tiny", prompt="the", max_tokens=2)
    assert not child.is_alive()


def test_a_batch_the_child_cannot_build_is_an_error_naming_it(model_dir):
    from rdlm import load_pretrained
    from rdlm.data.tokenizer import Tokenizer

    model, tokenizer = load_pretrained(model_dir).eval(), Tokenizer.from_dir(model_dir)
    with pytest.raises(ValueError, match="max_batch"):
        create_app(model, tokenizer, ServeConfig(defaults=DEFAULTS, max_batch=0, engine_process=True))


def test_the_default_gives_a_process_to_a_compiled_one_thread_batch_with_a_cpu_to_spare(model_dir, monkeypatch):
    from rdlm import load_pretrained
    from rdlm.inference.server import engine

    model = load_pretrained(model_dir).eval()
    monkeypatch.setattr(engine, "available_cpus", lambda: [0, 1])
    monkeypatch.setenv("RDLM_COMPILE", "0")  # an eager batch: its steps use every thread
    assert not engine_process(ServeConfig(), model)
    assert engine_process(ServeConfig(engine_process=True), model)  # asked for
    monkeypatch.setenv("RDLM_COMPILE", "1")  # compiled, at most SINGLE_THREAD_ROWS rows: one thread a step
    assert engine_process(ServeConfig(max_batch=8), model)
    assert not engine_process(ServeConfig(max_batch=SINGLE_THREAD_ROWS + 1), model)
    assert not engine_process(ServeConfig(compile=False), model)
    assert not engine_process(ServeConfig(engine_process=False), model)
    monkeypatch.setattr(engine, "available_cpus", lambda: [3])  # no CPU to spare for the HTTP server
    assert not engine_process(ServeConfig(), model)
    with pytest.raises(ValueError, match="CPU model"):
        engine_process(ServeConfig(engine_process=True), torch.nn.Linear(2, 2, device="meta"))


def _pinned(out) -> None:
    from rdlm.inference.server.engine import pin_to_one_cpu

    out.put((pin_to_one_cpu(), sorted(os.sched_getaffinity(0)), torch.get_num_threads()))


def test_pinning_puts_a_process_on_its_last_cpu_with_one_thread():
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_pinned, args=(out,))
    child.start()
    cpu, cpus, threads = out.get(timeout=60)
    child.join(timeout=30)
    assert cpu == max(os.sched_getaffinity(0)) and cpus == [cpu] and threads == 1


@pytest.mark.slow  # compiles the tiny model's step in the child (tens of seconds with a cold inductor cache)
def test_a_compiled_one_thread_batch_s_process_runs_on_one_cpu_of_its_own(model_dir, monkeypatch):
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("RDLM_COMPILE", "1")  # (the child inherits it; inductor compiles tiny's step once)
    with LiveServer(model_dir, engine_process=None, max_batch=2) as live:
        worker = live.app.state.worker
        assert worker.engine is not None and worker.info.compiled
        cpu = worker.info.cpu
        assert cpu == max(os.sched_getaffinity(0))
        assert os.sched_getaffinity(worker.engine.process.pid) == {cpu}
        assert os.sched_getaffinity(0) != {cpu}  # the server itself is not pinned
        # the prompts' calls measured faster on more threads (none, or some) widen to every CPU it had
        assert worker.info.prompt_cpus == frozenset(os.sched_getaffinity(0))
        out = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0)
        ids = live.tokenizer.encode("the cat", add_bos=True)
        assert out.choices[0].text == live.expected(ids, stop_tokens=(live.tokenizer.eos_id,))[0]


def test_the_child_does_not_outlive_a_killed_server(model_dir):
    """A server killed outright (SIGKILL: no shutdown of its own) leaves no engine process behind."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "rdlm", "serve", str(model_dir), "--port", str(port), "-r", "4",
                             "--engine-process"], env=env, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _serving(port) or proc.poll() is not None, seconds=60, what="rdlm serve did not come up")
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_gone(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_when_no_new_child_can_start_requests_fail_at_once_instead_of_hanging(model_dir):
    def cannot_start():
        raise RuntimeError("the engine process died while starting (exit code 1)")

    with LiveServer(model_dir, engine_process=True) as live:
        engine = live.app.state.worker.engine
        engine._spawn = cannot_start
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_until(lambda: engine.stopping, seconds=30, what="the death was not noticed")
        with pytest.raises(openai.InternalServerError, match="could not be restarted"):
            live.client().completions.create(model="tiny", prompt="the", max_tokens=2)
        assert live.app.state.worker.pending == 0
