"""A live `rdlm serve` app for the server's tests: uvicorn in a thread of the test process on a real
127.0.0.1 socket (the server `rdlm serve` runs), a tiny random model with a trained tokenizer."""

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package itself uses: httpx2 in openai >= 3, httpx before
    import httpx2 as httpx  # noqa: F401
except ImportError:
    import httpx  # noqa: F401

from rdlm import RDLMConfig, RecurrentDepthLM, save_pretrained  # noqa: E402
from rdlm.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from rdlm.inference.generate import GenerationConfig, generate  # noqa: E402
from rdlm.inference.server.app import ServeConfig, create_app  # noqa: E402
from rdlm.inference.server.http_guard import uvicorn_server  # noqa: E402

DEFAULTS = GenerationConfig(num_steps=4, max_new_tokens=8)
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = train_tokenizer(["the cat sat on the mat. the dog sat on the log. 1 2 3 4 5 6 7 8 9. " * 10],
                          vocab_size=300)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("served")
    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=tok.vocab_size)), path)
    tok.save(path)
    return path


class LiveServer:
    """uvicorn in a thread of this process, on a real socket."""

    def __init__(self, model_dir: Path, shutdown_timeout: float = 10.0, adapters: dict | None = None,
                 **config) -> None:
        from rdlm import load_pretrained

        self.model, self.tokenizer = load_pretrained(model_dir).eval(), Tokenizer.from_dir(model_dir)
        if adapters:  # LoRA adapters served by name (rdlm serve --lora NAME=DIR)
            from rdlm.model.lora_serving import load_adapters, read_adapters

            load_adapters(self.model, read_adapters(adapters))
        self.config = ServeConfig(model_name="tiny", defaults=DEFAULTS, max_length=96, num_slots=16, **config)
        self.app = create_app(self.model, self.tokenizer, self.config)
        self.port = free_port()
        self.server = uvicorn_server(self.app, "127.0.0.1", self.port, self.config.header_timeout,
                                     shutdown_timeout=shutdown_timeout, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def expected(self, ids: list[int], **options) -> tuple[str, list[int]]:
        """Text and iterations per token of rdlm.inference.generate for this prompt alone."""
        config = replace(DEFAULTS, **options)
        result = generate(self.model, [ids], config)
        return self.tokenizer.decode(result.tokens[0], skip_special_tokens=True), result.iterations[0]


def ask_concurrently(live: LiveServer) -> None:
    """Six requests with different r, exit criteria, cache budgets and sampling at once; each gets the text
    of its prompt decoded alone."""
    requests = [("the cat", dict(num_steps=3)), ("the dog sat", dict(num_steps=12, exit_criterion="kl",
                                                                      exit_threshold=3e-3)),
                ("1 2 3", dict(num_steps=8, kv_cache_budget=2)), ("on the", dict(num_steps=5, seed=4)),
                ("the mat", dict(num_steps=10, exit_criterion="latent-diff", exit_threshold=0.1)),
                ("log", dict(num_steps=4, temperature=0.8, top_p=0.9, seed=9))]

    def ask(item):
        prompt, fields = item
        extra = {k: v for k, v in fields.items() if k not in ("temperature", "top_p", "seed")}
        out = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body=extra,
                                               temperature=fields.get("temperature", 0),
                                               top_p=fields.get("top_p"), seed=fields.get("seed"))
        return out.choices[0].text

    with ThreadPoolExecutor(len(requests)) as pool:
        texts = list(pool.map(ask, requests))
    for (prompt, fields), text in zip(requests, texts):
        options = dict(fields, stop_tokens=(live.tokenizer.eos_id,))
        if "kv_cache_budget" in options:
            options.update(cache_strategy="shared", cache_slots=options.pop("kv_cache_budget"))
        assert text == live.expected(live.tokenizer.encode(prompt, add_bos=True), **options)[0], prompt


def wait_gone(group: int) -> None:
    """Every process of the group `group` has ended (the engine process with its server)."""
    def gone() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, what="a process of the server's group is still alive")


def wait_until(condition, seconds: float = 20, what: str = "") -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.02)
