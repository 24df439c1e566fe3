"""The README and every docs page are run as a user would run them, so no example can drift from the code.

Each page's ```bash and ```python blocks run in order, top to bottom, in a fresh directory of their own
(holding links to what the repository ships and the examples use: `examples/`, `tests/` for its fixtures,
`benchmarks/`, and `.venv`, the environment this test runs in). A block may be preceded by markers, HTML
comments that the rendered page does not show:

    <!-- docs-test: slow: REASON -->        needs minutes: runs only under `pytest -m slow`
    <!-- docs-test: skip: REASON -->        never runs here (a GPU, the network, hours, this test suite)
    <!-- docs-test: fragment: REASON -->    a python block that is not a program of its own
    <!-- docs-test: continues -->           a python block that goes on from the page's previous one
    <!-- docs-test: server -->              `rdlm serve`: started in the background for the rest of the page
    <!-- docs-test: tiny: OLD => NEW -->    the test runs the block with OLD replaced by NEW (smaller settings)
    <!-- docs-test: warns: REGEX -->        a warning the page explains (any other warning fails the block)

In the fast run a slow block is left out, so no later block may need what it makes (give such a block a
`tiny` form instead); `tiny` forms are run in the slow run too. The pages in LONG_PAGES (over 40 s each) run
whole, with their slow blocks, only in the slow run; the README and the other pages run in every run. A server
listens on a free port, which replaces the page's 8000 from the server block on. Pages run side by side
(RDLM_DOCS_TEST_WORKERS, default the CPU count up to 4), each command on one thread; in a run of more than the
docs tests, the fast run goes on in the background from the end of collection, one page at a time, and its
tests run last (`Background`). Every `rdlm` command of every block, whatever its
markers, must parse with today's command line, and every relative link must name a file and heading that
exist.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rdlm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHIPPED = ("examples", "tests", "benchmarks")       # linked into each page's directory
MARKER = re.compile(r"<!-- docs-test: ([a-z]+)(?::\s*(.*?))?\s*-->$")
MODES = {"slow", "skip", "fragment", "continues", "server"}
NEED_REASON = {"slow", "skip", "fragment"}
# A warning is a line that says so ("warning:", "WARNING: ...", a Python "FutureWarning: ..."); a block may
# print only those its page explains, named by `warns` markers.
WARNING = re.compile(r"\bwarn(ing)?\b|\wWarning: ", re.I)
PORT = re.compile(r"(?<=:)8000\b|(?<=--port )8000\b")


@dataclass
class Block:
    page: Path
    line: int                       # of the opening fence, 1-based
    lang: str                       # bash | python
    text: str
    mode: str = "run"
    reason: str = ""
    tiny: list[tuple[str, str]] = field(default_factory=list)
    warns: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def script(self) -> str:
        """The block as the test runs it: with its `tiny` replacements."""
        text = self.text
        for old, new in self.tiny:
            assert old in text, f"{self.where}: tiny marker's text is not in the block: {old!r}"
            text = text.replace(old, new)
        return text


def parse_markers(block: Block, comments: list[str]) -> None:
    for comment in comments:
        kind, value = MARKER.match(comment).groups()
        value = value or ""
        if kind == "tiny":
            old, sep, new = value.partition(" => ")
            assert sep and old, f"{block.where}: a tiny marker reads `tiny: OLD => NEW`"
            block.tiny.append((old, new))
        elif kind == "warns":
            block.warns.append(value)
        elif kind in MODES:
            assert block.mode == "run", f"{block.where}: two modes ({block.mode}, {kind})"
            assert value or kind not in NEED_REASON, f"{block.where}: `{kind}` must say why"
            block.mode, block.reason = kind, value
        else:
            pytest.fail(f"{block.where}: unknown docs-test marker {kind!r}")


def page_blocks(page: Path) -> list[Block]:
    """The page's bash and python blocks with their markers, in order."""
    lines = page.read_text().splitlines()
    blocks, comments, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if MARKER.match(line.strip()):
            comments.append(line.strip())
        elif line.strip().startswith("<!-- docs-test"):
            pytest.fail(f"{page.name}:{i + 1}: not a docs-test marker: {line.strip()}")
        elif line.startswith("```"):
            lang, start = line[3:].strip(), i
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            if lang in ("bash", "python"):
                block = Block(page, start + 1, lang, "\n".join(lines[start + 1:i]) + "\n")
                parse_markers(block, comments)
                assert block.mode != "server" or lang == "bash", f"{block.where}: a server block is bash"
                assert block.mode not in ("fragment", "continues") or lang == "python", block.where
                blocks.append(block)
            else:
                assert not comments, f"{page.name}:{start + 1}: docs-test markers before a ```{lang} block"
            comments = []
        elif line.strip():
            assert not comments, f"{page.name}:{i + 1}: docs-test markers must sit right before a block"
        i += 1
    return blocks


def commands(block: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [" ".join(re.sub(r"(^|\s)#.*$", "", line).split()) for line in text.splitlines()]
    return [line for line in lines if line]


def rdlm_argv(line: str) -> list[str] | None:
    """The arguments after `rdlm` (or `python -m rdlm`, `torchrun ... -m rdlm`) in a command line."""
    words = shlex.split(re.sub(r"\$\w+", "/x", line))
    for i, word in enumerate(words):
        if word == "rdlm" or word.endswith("/rdlm"):     # rdlm, .venv/bin/rdlm, python -m rdlm, torchrun -m rdlm
            argv = words[i + 1:]
            for j, arg in enumerate(argv):       # a redirection or a following command ends it
                if arg.startswith((">", "<")) or arg in ("&&", "||", "|", ";", "&"):
                    return argv[:j]
            return argv
    return None


ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]


# -- what the pages must hold ------------------------------------------------------------------------------

def test_the_readme_keeps_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "```bash\nbash scripts/setup.sh && .venv/bin/rdlm demo\n```" in readme
    assert "```bash\nbash scripts/setup.sh && .venv/bin/python -m pytest\n```" in readme


def test_the_readme_is_a_quick_start_that_lists_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 320
    index = readme.split("## Documentation", 1)[1]
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in index, f"README's Documentation index does not list docs/{page.name}"


def test_the_docs_cover_every_command():
    found = {argv[0] for block in ALL_BLOCKS if block.lang == "bash" for line in commands(block.text)
             if (argv := rdlm_argv(line))}
    assert found >= {"demo", "train", "generate", "chat", "serve", "eval", "lm-eval", "analyze", "convert",
                     "data", "tokenizer", "retrofit", "info"}


def test_every_rdlm_command_in_the_docs_parses():
    parser = build_parser()
    checked = 0
    for block in ALL_BLOCKS:
        if block.lang != "bash":
            continue
        for line in commands(block.text):
            argv = rdlm_argv(line)
            if argv is None or argv[:1] == ["lm-eval"]:      # lm-eval: the harness's own flags
                continue
            try:
                args = parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{block.where}: does not parse: rdlm {' '.join(argv)}")
            assert args.func is not None
            checked += 1
    assert checked >= 60


def test_every_skip_says_why_and_every_tiny_marker_applies():
    for block in ALL_BLOCKS:
        block.script()                                       # asserts every OLD is in its block
        if block.mode in NEED_REASON:
            assert len(block.reason) >= 10, f"{block.where}: say why the block is {block.mode}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and (m := re.match(r"#+ (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower().replace("`", "")).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_every_relative_link_names_a_page_and_heading_that_exist():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to a missing file: {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in heading_anchors(dest), f"{page.name}: link to a missing heading: {target}"


def test_code_and_tests_point_to_pages_that_exist():
    """Docstrings, comments and messages name docs pages (`docs/x.md#anchor`), not the README's sections."""
    for path in [*ROOT.glob("rdlm/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]:
        if path == Path(__file__):
            continue
        text = path.read_text()
        assert "README.md#" not in text and "README, " not in text, f"{path.relative_to(ROOT)} cites the README"
        for page, anchor in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", text):
            assert (ROOT / "docs" / page).exists(), f"{path.relative_to(ROOT)}: docs/{page} does not exist"
            if anchor:
                assert anchor in heading_anchors(ROOT / "docs" / page), f"{path.relative_to(ROOT)}: #{anchor}"


# -- running the pages -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PageRun:
    """One page's blocks run in order in `workdir`; a server block's process lives until `close`."""

    def __init__(self, page: Path, workdir: Path, slow: bool, environ: dict[str, str] | None = None):
        self.page, self.workdir, self.slow = page, workdir, slow
        for name in SHIPPED:
            (workdir / name).symlink_to(ROOT / name)
        (workdir / ".venv").symlink_to(sys.prefix)          # the docs' `.venv/bin/...`: this environment
        bindir, base = Path(sys.executable).parent, dict(os.environ if environ is None else environ)
        self.env = {**base, "PATH": f"{bindir}{os.pathsep}{base['PATH']}",
                    "VIRTUAL_ENV": sys.prefix, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                    "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "MPLBACKEND": "Agg",
                    "TOKENIZERS_PARALLELISM": "false"}
        self.env.pop("PYTHONPATH", None)
        self.port = free_port()
        self.server: subprocess.Popen | None = None
        self.python_chain: list[str] = []                   # the python blocks a `continues` goes on from
        self.ran: list[str] = []

    def source(self, block: Block) -> str:
        return PORT.sub(str(self.port), block.script())

    def run(self, block: Block) -> None:
        if block.mode in ("skip", "fragment") or (block.mode == "slow" and not self.slow):
            return
        if block.lang == "python" and block.mode != "continues":
            self.python_chain = []
        if block.mode == "server":
            return self.start_server(block)
        if block.lang == "python":
            self.python_chain.append(self.source(block))
            argv = [sys.executable, "-c", "\n".join(self.python_chain)]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", self.source(block)]
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=self.workdir, env=self.env, capture_output=True, text=True,
                                  timeout=900, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{block.where}: still running after {e.timeout} s\n{block.text}")
        assert done.returncode == 0, (f"{block.where}: exit status {done.returncode}\n{block.script()}\n"
                                      f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
        unexplained = [line for line in done.stderr.splitlines() + done.stdout.splitlines()
                       if WARNING.search(line) and not any(re.search(w, line) for w in block.warns)]
        assert not unexplained, (f"{block.where}: warns, and the page does not say what it means "
                                 f"(explain it and add a `warns` marker):\n" + "\n".join(unexplained[:5]))
        self.ran.append(f"{block.where} ({time.monotonic() - started:.1f} s)")

    def start_server(self, block: Block) -> None:
        (line,) = commands(self.source(block))
        self.log = open(self.workdir / "server.log", "w")
        self.server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.workdir, env=self.env,
                                       stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.server.poll() is None, f"{block.where}: the server exited\n" + self.server_log()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    self.ran.append(f"{block.where} (server)")
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"{block.where}: the server did not answer /health in 120 s\n" + self.server_log())

    def server_log(self) -> str:
        return (self.workdir / "server.log").read_text()[-3000:]

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)         # the server finishes in-flight requests and exits
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        if self.server is not None:
            self.log.close()


def run_page(page: Path, workdir: Path, slow: bool, stop: threading.Event | None = None,
             environ: dict[str, str] | None = None) -> list[str]:
    runner = PageRun(page, workdir, slow, environ)
    try:
        for block in page_blocks(page):
            if stop is not None and stop.is_set():
                pytest.fail(f"{page.name}: stopped before {block.where} (the test session ended)")
            runner.run(block)
    finally:
        runner.close()
    return runner.ran


ran_summaries: dict[tuple[Path, bool], str] = {}  # per page run (fast or slow): its time and blocks (run_pages)


def page_id(page: Path) -> str:
    return page.name


def run_pages(pages: list[Path], root: Path, slow: bool, workers: int | None = None,
              stop: threading.Event | None = None, environ: dict[str, str] | None = None) -> dict[Path, str | None]:
    """Each page in a directory of its own, several at a time (their commands are one-threaded processes, so
    pages side by side use the cores a single page leaves idle); None for a page that ran, else why not."""
    def one(page: Path) -> str | None:
        workdir = root / page.stem
        workdir.mkdir()
        started = time.monotonic()
        try:
            ran = run_page(page, workdir, slow, stop, environ)
        except BaseException as e:                          # pytest.fail raises a BaseException
            return str(e)
        # kept for the page's own test to print (shown by `pytest -s`): printed here, from the background thread,
        # it would land in whichever test's captured output is current (seen failing a test that reads capsys)
        ran_summaries[page, slow] = f"{page.name} ({time.monotonic() - started:.0f} s): " + ", ".join(ran)
        return None

    workers = int(os.environ.get("RDLM_DOCS_TEST_WORKERS", workers or min(4, os.cpu_count() or 1)))
    longest_first = sorted(pages, key=lambda page: -len(page_blocks(page)))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(zip(longest_first, pool.map(one, longest_first)))


def selected_pages(request: pytest.FixtureRequest, test_name: str) -> list[Path]:
    return [item.callspec.params["page"] for item in request.session.items
            if item.originalname == test_name and hasattr(item, "callspec")]


class Background:
    """The fast run of the selected pages, started when collection ends (tests/conftest.py) in a thread of its
    own with one page at a time, while the rest of the suite runs: the pages' commands are processes of one
    thread each, so they take the core the suite's own process leaves idle. Their tests run last and wait for
    it. The commands get the environment as it was before any test (a test's monkeypatched variable is not
    theirs). Asked to stop (the session ends early), it stops between two blocks."""

    def __init__(self, pages: list[Path], root: Path):
        self.stop, self.result = threading.Event(), Future[dict[Path, str | None]]()
        self.environ = dict(os.environ)
        self.thread = threading.Thread(target=self.run, args=(pages, root), name="docs-pages", daemon=True)
        self.thread.start()

    def run(self, pages: list[Path], root: Path) -> None:
        try:
            self.result.set_result(run_pages(pages, root, slow=False, workers=1, stop=self.stop,
                                             environ=self.environ))
        except BaseException as e:
            self.result.set_exception(e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


background: Background | None = None


def start_in_background(pages: list[Path], root: Path) -> None:
    global background
    background = Background(pages, root)


def stop_background() -> None:
    if background is not None:
        background.close()


@pytest.fixture(scope="module")
def fast_runs(request, tmp_path_factory) -> dict[Path, str | None]:
    if background is not None:
        return background.result.result()
    return run_pages(selected_pages(request, "test_page_runs_top_to_bottom"), tmp_path_factory.mktemp("docs"),
                     slow=False)


@pytest.fixture(scope="module")
def slow_runs(request, tmp_path_factory) -> dict[Path, str | None]:
    return run_pages(selected_pages(request, "test_page_runs_with_its_slow_blocks"),
                     tmp_path_factory.mktemp("docs-slow"), slow=True)


# Pages whose fast run took over 40 s on a 2-core machine (47 s to 2.6 min each, two pages at a time, load 2):
# together two thirds of the suite's time on the docs. They run whole under `pytest -m slow`.
LONG_PAGES = {"analysis.md", "demo.md", "experiments.md", "fine-tuning.md", "generation.md", "integrations.md",
              "model-families.md", "quantization.md", "retrofit.md", "training.md"}


def test_the_long_pages_are_pages():
    assert LONG_PAGES <= {page.name for page in PAGES} and "README.md" not in LONG_PAGES


@pytest.mark.parametrize("page", [page for page in PAGES if page.name not in LONG_PAGES], ids=page_id)
def test_page_runs_top_to_bottom(page, fast_runs):
    """Every block not marked slow, skip or fragment runs as the page writes it (or in its tiny form)."""
    if fast_runs[page] is not None:
        pytest.fail(fast_runs[page], pytrace=False)
    print(ran_summaries[page, False])


SLOW_PAGES = [page for page in PAGES if page.name in LONG_PAGES or any(b.mode == "slow" for b in page_blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES, ids=page_id)
def test_page_runs_with_its_slow_blocks(page, slow_runs):
    """The same, with the blocks that need minutes; the long pages run here only."""
    if slow_runs[page] is not None:
        pytest.fail(slow_runs[page], pytrace=False)
    print(ran_summaries[page, True])
