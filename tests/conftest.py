"""Shared fixtures: the offline environment, the tiny model built in code, and a stub LLM judge
(an OpenAI-compatible server on loopback)."""

import atexit
import json
import os
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Without these, any hub lookup hangs for about 50 s before failing on a machine without network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# trackio (the tests that report to it) writes to a folder of this run, not the user's, removed
# when the run ends.
_TRACKIO_DIR = tempfile.mkdtemp(prefix="trackio-tests-")
atexit.register(shutil.rmtree, _TRACKIO_DIR, True)
os.environ.setdefault("TRACKIO_DIR", _TRACKIO_DIR)

import pytest  # noqa: E402

from trl_grpo_ext.tiny import build_tiny_tokenizer, save_tiny  # noqa: E402

# Files whose tests run the Python tool's sandbox and then check that no sandbox process, folder
# or cgroup is left on the machine. Under pytest-xdist (`make test`), they run on one worker, one
# after another, so that one file's check never counts another file's sandbox at work.
SANDBOX_FILES = {"test_run_python.py", "test_tools.py", "test_tool_formats.py", "test_recipe.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (each file's tests on one worker, its module fixtures built once), with
    the files of SANDBOX_FILES as one file."""
    from xdist.scheduler import LoadFileScheduling

    class SandboxFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return "sandbox" if os.path.basename(scope) in SANDBOX_FILES else scope

    return SandboxFilesTogether(config, log)


_XDIST_WORKER = False


def pytest_configure(config):
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    """With PYTEST_FAILURES_LOG set, each failure's report is appended to that file as it
    happens: a run stopped at a time limit (a lent GPU's session) still has the tracebacks that
    pytest prints only at the end. Under pytest-xdist the controller writes them."""
    if not _XDIST_WORKER:
        _note_untested(report)
    path = os.environ.get("PYTEST_FAILURES_LOG")
    if path and report.failed and not _XDIST_WORKER:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


# Why a mechanism of run_python's sandbox went untested (its cases skipped), said loudly at the
# end of the run: a green run must not hide a mechanism that never ran.
UNTESTED_MECHANISM = "run_python mechanism untested"
_untested: set[str] = set()


def _note_untested(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if UNTESTED_MECHANISM in reason:
            _untested.add(reason.split(UNTESTED_MECHANISM, 1)[1].lstrip(": "))


def pytest_terminal_summary(terminalreporter):
    for reason in sorted(_untested):
        terminalreporter.write_sep("!", f"{UNTESTED_MECHANISM}: {reason}", red=True, bold=True)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Folder holding the tiny model and tokenizer, loadable with any `from_pretrained`."""
    return save_tiny(tmp_path_factory.mktemp("tiny-model"), seed=0)


class StubJudge:
    """A threaded HTTP server answering `POST /v1/chat/completions` with `reply(body)`: a string
    (the judge's reply), or an `(status, text)` pair; `GET /v1/models` lists `models`. It records
    every request body and the most requests it held at once."""

    def __init__(self, reply, delay: float = 0.0, together: int = 0, models=("judge",)):
        self.reply, self.delay, self.models = reply, delay, list(models)
        # with `together`, requests are held until that many are in flight (5 s at most)
        self.barrier = threading.Barrier(together, timeout=5) if together else None
        self.bodies, self.headers = [], []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                found = self.path == "/v1/models"
                listing = {"object": "list", "data": [{"id": model} for model in stub.models]}
                data = json.dumps(listing if found else {}).encode()
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                with stub.lock:
                    stub.bodies.append(body)
                    stub.headers.append(dict(self.headers))
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                try:
                    if stub.barrier is not None:
                        try:
                            stub.barrier.wait()
                        except threading.BrokenBarrierError:
                            stub.barrier.reset()
                    time.sleep(stub.delay)
                    answer = stub.reply(body) if self.path == "/v1/chat/completions" else (404, "")
                    status, text = answer if isinstance(answer, tuple) else (200, None)
                    if text is None:
                        text = json.dumps(
                            {
                                "choices": [{"message": {"role": "assistant", "content": answer}}],
                                "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                            }
                        )
                    data = text.encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def stub_factory():
    """`make(reply, ...)`: a `StubJudge` on loopback, closed after the test."""
    stubs = []

    def make(reply, delay=0.0, together=0, models=("judge",)):
        stubs.append(StubJudge(reply, delay, together, models))
        return stubs[-1]

    yield make
    for stub in stubs:
        stub.close()
