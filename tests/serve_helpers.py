"""A live `rdlm serve` app for the server's tests: uvicorn in a thread of the test process on a real
127.0.0.1 socket (the server `rdlm serve` runs), a tiny random model with a trained tokenizer."""

import socket
import threading
import time
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
