"""`rdlm serve`: a live server on 127.0.0.1, spoken to with the official `openai` client and plain HTTP.
Every wait is bounded (client timeouts, joins with timeouts)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from rdlm.inference.generate import generate  # noqa: E402
from tests.serve_helpers import (  # noqa: E402,F401
    DEFAULTS, ROOT, LiveServer, ask_concurrently, free_port, httpx, model_dir, wait_gone)


@pytest.fixture(scope="module")
def live(model_dir):
    with LiveServer(model_dir) as server:
        yield server


def test_models_health_and_a_completion_equal_to_generate(live):
    client = live.client()
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(live.url + "/health", timeout=10).json()["status"] == "ok"
    out = client.completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0)
    ids = live.tokenizer.encode("the cat", add_bos=True)
    text, steps = live.expected(ids, max_new_tokens=6, stop_tokens=(live.tokenizer.eos_id,))
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(steps)
    assert out.usage.model_extra["latent_iterations"] == sum(steps)


def test_chat_streamed_equals_chat_whole_and_uses_the_template(live):
    client = live.client()
    messages = [{"role": "user", "content": "the dog"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                           extra_body={"num_steps": 6})
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, stream=True,
                                                 extra_body={"num_steps": 6}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    ids = live.tokenizer.apply_chat_template(messages)
    text, _ = live.expected(ids, max_new_tokens=7, num_steps=6,
                            stop_tokens=(live.tokenizer.end_turn_id, live.tokenizer.eos_id))
    assert whole.choices[0].message.content == text


def test_a_stream_sends_each_token_as_it_arrives_even_while_its_text_is_held_back(live):
    """A stop string longer than the completion's text holds all of it back until the end; the tokens still
    arrive as they are made, one chunk each with its logprobs (as vLLM streams), not all at the end."""
    body = {"model": "tiny", "prompt": "the cat", "stream": True, "max_tokens": 24, "temperature": 0,
            "logprobs": 0, "num_steps": 16, "stop": ["#" * 40], "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    used = events[-1]["usage"]["completion_tokens"]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1] * used  # a chunk per token
    before_end = [c for c in chunks if c["finish_reason"] is None]
    assert before_end and all(c["text"] == "" for c in before_end)  # tokens came while the text was held
    whole = httpx.post(live.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_concurrent_clients_at_different_depths_each_get_their_tokens_alone(live):
    """A busy batch: requests with different r, exit criteria and sampling join and leave between
    iterations; each still gets exactly the tokens of its prompt decoded alone."""
    ask_concurrently(live)


def test_the_static_step_serves_each_client_its_tokens_alone(model_dir):
    """compile=True (`rdlm serve --compile`): the batch's core iterations run as its fixed-shape static step."""
    with LiveServer(model_dir, compile=True) as live:
        ask_concurrently(live)
    assert live.app.state.worker.batch.step_runner.static_step.steps.runs > 0


def test_logprobs_and_iterations_per_token_equal_generate_s(live):
    client = live.client()
    ids = live.tokenizer.encode("the cat", add_bos=True)
    options = dict(max_new_tokens=6, stop_tokens=(live.tokenizer.eos_id,), num_steps=8, exit_criterion="kl",
                   exit_threshold=1e-3, logprobs=3)
    events = []
    offline = generate(live.model, [ids], replace(DEFAULTS, **options), on_token=events.append)
    extra = dict(num_steps=8, exit_criterion="kl", exit_threshold=1e-3)
    out = client.completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body=extra)
    lp = out.choices[0].logprobs
    kept = [e for e in events if e.token != live.tokenizer.eos_id]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in kept], abs=1e-5)
    assert lp.model_extra["latent_iterations"] == [e.iterations for e in kept]
    assert [top for top in lp.top_logprobs] == [{live.tokenizer.token_text(t): v for t, v in e.top} for e in kept]
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy
               for i, top in enumerate(lp.top_logprobs))
    joined = b"".join(live.tokenizer.token_bytes(t) for t in offline.tokens[0] if t != live.tokenizer.eos_id)
    assert joined.decode(errors="replace") == out.choices[0].text  # the tokens' bytes make up the text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt="the cat", max_tokens=6, temperature=0, logprobs=3, stream=True, extra_body=extra)
        if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == lp.tokens                 # streamed pieces make up the whole
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset
    assert out.usage.model_extra["mean_latent_iterations"] == pytest.approx(sum(offline.iterations[0]) / len(offline.iterations[0]))
    # chat, whole and streamed: one entry per token with its alternatives and iterations, the same numbers
    messages = [{"role": "user", "content": "the dog"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logprobs=True,
                                           top_logprobs=2, extra_body=extra)
    content = whole.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(1 <= c.model_extra["latent_iterations"] <= 8 for c in content)
    stops = (live.tokenizer.end_turn_id, live.tokenizer.eos_id)
    chat_ids = live.tokenizer.apply_chat_template(messages)
    alone = generate(live.model, [chat_ids], replace(DEFAULTS, max_new_tokens=5, stop_tokens=stops, logprobs=2,
                                                     num_steps=8, exit_criterion="kl", exit_threshold=1e-3))
    kept = [t for t in alone.tokens[0] if t not in stops]
    assert [c.logprob for c in content] == pytest.approx(alone.logprobs[0][:len(kept)], abs=1e-5)
    # the tokens' bytes make up their text (special tokens included, which the message's content skips)
    assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace") == live.tokenizer.decode(kept)
    streamed = [c for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                               logprobs=True, top_logprobs=2, stream=True,
                                                               extra_body=extra)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    no = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert no.choices[0].logprobs is None


def test_a_depth_budget_per_request_is_honoured(live):
    client = live.client()
    ids = live.tokenizer.encode("the cat", add_bos=True)
    for budget in (dict(max_latent_iterations=12), dict(target_mean_iterations=2.5)):
        out = client.completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0,
                                        extra_body=dict(num_steps=8, **budget))
        text, steps = live.expected(ids, max_new_tokens=6, stop_tokens=(live.tokenizer.eos_id,), num_steps=8, **budget)
        assert out.choices[0].text == text and out.usage.model_extra["latent_iterations"] == sum(steps)
        assert sum(steps) <= 12 if "max_latent_iterations" in budget else sum(steps) <= 2.5 * len(steps)


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "x", "num_steps": 0}, 400, "num_steps"),
    ({"model": "tiny", "prompt": "x", "exit_criterion": "klx"}, 400, "unknown exit criterion"),
    ({"model": "tiny", "prompt": list(range(90)), "max_tokens": 20}, 400, "exceeds the context of 96"),
    ({"model": "tiny", "prompt": "x", "num_steps": 40}, 400, "core cache slots"),
    ({"model": "tiny", "prompt": "x", "colour": 1}, 400, "unknown field 'colour'"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": [99999]}, 400, "outside the vocabulary"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "target_mean_iterations": 0.5}, 400, "target_mean_iterations"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "needs logprobs"),
    ("{not json", 400, "not valid JSON"),
])
def test_bad_requests_get_openai_errors_and_disturb_nobody(live, body, status, fragment):
    client = live.client()
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.completions.create, model="tiny", prompt="the cat", max_tokens=8)
        data = body if isinstance(body, str) else json.dumps(body)
        endpoint = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        reply = httpx.post(live.url + endpoint, content=data, timeout=30,
                           headers={"content-type": "application/json"})
        assert good.result(timeout=60).choices[0].finish_reason in ("length", "stop")
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_the_parallel_sampler_is_served_beside_other_requests(live):
    """A request with `sampler: parallel` runs its wavefront in its own row of the served batch, a step at a
    time, while other requests decode beside it: each gets the text `generate` gives it alone."""
    client = live.client()
    ids = live.tokenizer.encode("the cat", add_bos=True)
    with ThreadPoolExecutor(2) as pool:
        wave = pool.submit(client.completions.create, model="tiny", prompt="the cat", max_tokens=8, temperature=0,
                           extra_body=dict(sampler="parallel", num_steps=4))
        plain = pool.submit(client.completions.create, model="tiny", prompt="the cat", max_tokens=8, temperature=0)
        wave, plain = wave.result(timeout=60), plain.result(timeout=60)
    eos = (live.tokenizer.eos_id,)
    assert wave.choices[0].text == live.expected(ids, max_new_tokens=8, stop_tokens=eos, sampler="parallel",
                                                 num_steps=4)[0]
    assert plain.choices[0].text == live.expected(ids, max_new_tokens=8, stop_tokens=eos)[0]


def test_a_disconnected_stream_frees_its_row(live):
    worker = live.app.state.worker
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "the", "max_tokens": 80, "num_steps": 16,
                            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 20
    while worker.pending or worker.batch.busy:
        assert time.time() < deadline, "the cancelled request still holds its row"
        time.sleep(0.05)


def test_metrics_count_tokens_iterations_and_time_to_first_token(live):
    live.client().completions.create(model="tiny", prompt="the", max_tokens=3,
                                     extra_body={"exit_criterion": "kl", "exit_threshold": 1.0, "num_steps": 8})
    text = httpx.get(live.url + "/metrics", timeout=10).text
    for name in ("rdlm_generated_tokens_total", "rdlm_iterations_per_token_bucket", "rdlm_early_exits_total",
                 "rdlm_time_to_first_token_seconds_count", "rdlm_queue_length", "rdlm_batch_size",
                 'rdlm_requests_total{endpoint="/v1/completions",status="200"}'):
        assert name in text, name
    exits = [line for line in text.splitlines() if line.startswith("rdlm_early_exits_total")]
    assert float(exits[0].split()[-1]) >= 2            # a threshold of 1.0 exits at min_steps
    if sys.platform.startswith("linux"):               # the process's memory and descriptors, to watch for leaks
        assert "process_resident_memory_bytes" in text and "process_open_fds" in text


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_the_first_token_s_time_splits_into_the_wait_for_the_step_and_the_prefill(live):
    """Each request's time to its first token counts once in each part; the parts happen inside the TTFT (the
    same clock: submission, taken into the batch, first token, then its hand-over to the stream)."""
    names = ("rdlm_step_wait_seconds", "rdlm_prefill_seconds", "rdlm_time_to_first_token_seconds")
    before = httpx.get(live.url + "/metrics", timeout=10).text
    for prompt in ("the", "a b c d e f"):
        live.client().completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"num_steps": 4})
    after = httpx.get(live.url + "/metrics", timeout=10).text
    count = {n: metric(after, n + "_count") - metric(before, n + "_count") for n in names}
    total = {n: metric(after, n + "_sum") - metric(before, n + "_sum") for n in names}
    assert count == dict.fromkeys(names, 2.0)
    wait, prefill, ttft = (total[n] for n in names)
    assert wait >= 0 and prefill > 0 and wait + prefill <= ttft


def test_tokens_cut_by_a_depth_budget_count_apart_from_exits(live):
    """A token whose cap a depth budget lowered below r stopped at its cap, not by an exit: the exit counter
    stays, the budget's counter counts it."""
    before = httpx.get(live.url + "/metrics", timeout=10).text
    live.client().completions.create(model="tiny", prompt="the", max_tokens=4,
                                     extra_body={"num_steps": 8, "max_latent_iterations": 12})
    after = httpx.get(live.url + "/metrics", timeout=10).text
    assert metric(after, "rdlm_early_exits_total") == metric(before, "rdlm_early_exits_total")
    cut = metric(after, "rdlm_budget_capped_tokens_total") - metric(before, "rdlm_budget_capped_tokens_total")
    assert 1 <= cut <= 4     # 12 iterations for 4 tokens at r = 8: the later tokens run fewer than 8


def test_a_profiled_server_with_chunked_prompts_exports_its_phases(model_dir):
    """--profile: seconds per phase of the batch's steps on /metrics; prompts prefilled 3 tokens at a time,
    with rows looking every step and running their coda at once, still give generate's text."""
    with LiveServer(model_dir, profile=True, prefill_chunk=3, exit_sync_every=1, coda_every=1) as live:
        prompt = "the cat sat on the mat. the dog"
        out = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
        ids = live.tokenizer.encode(prompt, add_bos=True)
        assert len(ids) > 6                                             # three chunks or more
        assert out.choices[0].text == live.expected(ids, max_new_tokens=5, stop_tokens=(live.tokenizer.eos_id,))[0]
        text = httpx.get(live.url + "/metrics", timeout=10).text
    seconds = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("rdlm_batch_phase_seconds_total{")}
    assert {"core iteration", "coda and sampling", "prompt coda and first token"} <= set(seconds)
    assert all(v >= 0 for v in seconds.values()) and seconds["core iteration"] > 0
    steps = [line for line in text.splitlines() if line.startswith("rdlm_batch_step_seconds_total ")]
    assert float(steps[0].split()[-1]) >= sum(seconds.values())


def test_a_full_queue_answers_503_with_retry_after(model_dir):
    with LiveServer(model_dir, max_batch=1, max_queue=0) as server:
        slow = threading.Thread(target=lambda: server.client().completions.create(
            model="tiny", prompt="the", max_tokens=80, extra_body={"num_steps": 16}))
        slow.start()
        deadline = time.time() + 20
        while not server.app.state.worker.pending:
            assert time.time() < deadline
            time.sleep(0.01)
        reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        slow.join(timeout=60)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert "capacity" in reply.json()["error"]["message"]


def test_an_api_key_and_a_body_limit_guard_the_api(model_dir):
    with LiveServer(model_dir, api_key="s3cret", max_request_bytes=2000) as live:
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200  # a probe needs no key
        with pytest.raises(openai.AuthenticationError, match="API key"):
            live.client().completions.create(model="tiny", prompt="the cat", max_tokens=2)   # a wrong key
        reply = httpx.get(live.url + "/v1/models", timeout=10)                                # no key
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        keyed = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0, timeout=30)
        out = keyed.completions.create(model="tiny", prompt="the cat", max_tokens=3, temperature=0)
        assert out.choices[0].text == live.expected(live.tokenizer.encode("the cat", add_bos=True), max_new_tokens=3,
                                                    stop_tokens=(live.tokenizer.eos_id,))[0]
        big = json.dumps({"model": "tiny", "prompt": "x" * 3000}).encode()
        auth = {"authorization": "Bearer s3cret", "content-type": "application/json"}
        reply = httpx.post(live.url + "/v1/completions", content=big, headers=auth, timeout=10)
        assert reply.status_code == 413 and "2000 bytes" in reply.json()["error"]["message"]
        chunks = (big[i:i + 500] for i in range(0, len(big), 500))   # no Content-Length: counted as it arrives
        reply = httpx.post(live.url + "/v1/completions", content=chunks, headers=auth, timeout=10)
        assert reply.status_code == 413
        assert keyed.completions.create(model="tiny", prompt="the", max_tokens=2).choices[0].finish_reason


def test_serve_flags_for_a_server_beyond_this_machine(model_dir, capsys):
    from rdlm.cli import main
    from rdlm.cli.serve import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.168.1.4") and not _loopback("example.org")
    for flags, fragment in ((["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
                            (["--api-key", " "], "--api-key is empty"),
                            (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
                            (["--coda-every", "0"], "--coda-every must be >= 1")):
        assert main(["serve", str(model_dir), *flags]) != 0
        assert fragment in capsys.readouterr().err


def test_serve_compile_turns_the_batch_s_static_step_on(model_dir, capsys, monkeypatch):
    """--compile (default: on with CUDA, off on the CPU, where this runs) reaches the batch; its banner says
    which step runs."""
    from rdlm.cli import main

    from rdlm.inference.server.http_guard import Server

    monkeypatch.setattr(Server, "run", lambda self: None)
    for flags, static in (([], "off"), (["--compile"], "on"), (["--no-compile"], "off")):
        assert main(["serve", str(model_dir), *flags]) == 0
        assert f"static step {static})" in capsys.readouterr().err


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_rdlm_serve_shuts_down_cleanly_on_sigterm(model_dir, engine_process):
    """SIGTERM to the server, or to its whole process group (systemd, a terminal's Ctrl-C) where the batch has a
    process of its own: the stream in flight finishes, the server exits 0, no process is left."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RDLM_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "rdlm", "serve", str(model_dir), "--port", str(port),
                             "-r", "4", "--max-new-tokens", "4", "--shutdown-timeout", "5",
                             "--engine-process" if engine_process else "--no-engine-process"],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "rdlm serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": Path(model_dir).name, "prompt": "the cat"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        # a stream in flight when SIGTERM arrives still finishes
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"model": Path(model_dir).name, "prompt": "the", "max_tokens": 40,
                                "num_steps": 12, "stream": True}) as response:
            stream = response.iter_lines()
            first = next(stream)
            if engine_process:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            lines = [first] + [line for line in stream if line]
        assert first.startswith("data: ") and lines[-1] == "data: [DONE]"
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "shut down on SIGTERM" in err and ("its own process" in err) == engine_process, err
        if engine_process:
            wait_gone(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_the_documented_bounds_are_the_declared_ones():
    """docs/production.md's table of every number a request may carry is the declaration's (`bounds`)."""
    from rdlm.inference.server.openai_api import bounds

    text = (ROOT / "docs" / "production.md").read_text()
    table = text.split("<!-- bounds:", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| `")]
    documented = {name.strip().strip("`"): (kind.strip(), values.strip()) for name, kind, values in rows}
    assert documented == bounds()
