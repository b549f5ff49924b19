"""`normbench generate` end to end against a small OpenAI-compatible server started here on
127.0.0.1, which answers with fixed completions: a good Triton kernel (checked under
TRITON_INTERPRET=1), code that does not import, an empty answer, prose without code, HTTP 500,
and one that answers too late. Samples are written into a tmp folder (--out-root)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from harness import cli
from impls.llm.generate import chat_completions_url, extract_code_block, main, store_sample

REPO = Path(__file__).resolve().parent.parent
PROMPT = REPO / "prompts" / "triton-rmsnorm.v1.md"
CHECK_SHAPES = "3x7,4x64:column-slice"  # two small shapes keep the interpreted check quick

GOOD_KERNEL = """import torch
import triton
import triton.language as tl


@triton.jit
def _fwd(X, W, Y, RSTD, stride_x, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _bwd(DY, X, W, RSTD, DX, DW_ROWS, stride_dy, stride_x, N, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    xhat = x * rstd
    g = dy
    if HAS_W:
        g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.sum(g * xhat, axis=0) / N
    tl.store(DX + row * N + cols, (rstd * (g - xhat * c)).to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_ROWS + row * N + cols, dy * xhat, mask=mask)


def rmsnorm_fwd(x, weight, eps):
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    w = weight if weight is not None else x
    _fwd[(M,)](x, w, y, rstd, x.stride(0), N, eps, HAS_W=weight is not None, BLOCK=triton.next_power_of_2(N))
    return y, rstd


def rmsnorm_bwd(dy, x, weight, rstd):
    M, N = x.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dw_rows = torch.empty((M, N), dtype=torch.float32, device=x.device)
    w = weight if weight is not None else x
    _bwd[(M,)](dy, x, w, rstd, dx, dw_rows, dy.stride(0), x.stride(0), N,
               HAS_W=weight is not None, BLOCK=triton.next_power_of_2(N))
    return dx, (dw_rows.sum(0).to(x.dtype) if weight is not None else None)
"""
BROKEN_KERNEL = "import torch\nimport triton\n\n@triton.jit\ndef _fwd(X, N):\n    row = tl.program_id(0\n"


def fenced(code: str) -> str:
    return f"Here is the module:\n\n```python\n{code}```\n\nIt reads x once and writes y once.\n"


# ---------------------------------------------------------------- the fake endpoint
class _Handler(BaseHTTPRequestHandler):
    """POST /<behaviour>/v1/chat/completions; the behaviour is the first path segment."""

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        behaviour = self.path.strip("/").split("/")[0]
        server.requests.append({"path": self.path, "body": body})
        if behaviour == "error":
            return self._send(500, b'{"error": "model not loaded"}\n')
        if behaviour == "slow":
            server.release.wait(10)  # longer than the client's timeout; released when the test ends
        content = {
            "good": fenced(GOOD_KERNEL),
            "slow": fenced(GOOD_KERNEL),
            "broken": fenced(BROKEN_KERNEL),
            "empty": "",
            "prose": "I would write a Triton kernel that loads each row, but here is only the idea.",
            "truncated": "```python\nimport torch\ndef rmsnorm_fwd(",
        }[behaviour]
        reply = {
            "id": "cmpl-test",
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20},
        }
        self._send(200, json.dumps(reply).encode())

    def _send(self, code, payload: bytes):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout test)
            pass

    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)  # port 0: a free port
    server.daemon_threads = True
    server.requests = []
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    # bounded: the server shuts itself down after two minutes even if the test process hangs
    watchdog = threading.Timer(120, server.shutdown)
    watchdog.daemon = True
    watchdog.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.release.set()
    watchdog.cancel()
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMBENCH_LLM_CACHE", str(tmp_path / "cache"))


def generate(url: str, out_root: Path, *extra: str) -> int:
    return main(
        ["--prompt", str(PROMPT), "--endpoint", url, "--model", "test/Tiny-Triton", "--out-root", str(out_root), *extra]
    )


def entries(out_root: Path) -> list[str]:
    """Everything in the output folder, hidden entries included (a half-written sample would be one)."""
    return sorted(p.name for p in out_root.iterdir()) if out_root.exists() else []


# ---------------------------------------------------------------- end to end
def test_good_answer_is_stored_and_passes_the_check(endpoint, tmp_path, capsys):
    server, base = endpoint
    out = tmp_path / "llm"
    rc = generate(f"{base}/good", out, "--temperature", "0.2", "--max-tokens", "4096", "--shapes", CHECK_SHAPES)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (name,) = entries(out)
    assert name.startswith("triton-rmsnorm-tiny-triton-") and name.endswith("-1")
    assert f"{name} (first-shot): PASS: 4/4 passed" in printed
    folder = out / name
    assert (folder / "raw.py").read_text() == GOOD_KERNEL
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["sampling"] == {"temperature": 0.2, "max_tokens": 4096}
    assert meta["generator"] == {"model": "test/Tiny-Triton", "endpoint": f"{base}/good", "tool": "normbench generate"}
    assert meta["completion"]["finish_reason"] == "stop" and meta["completion"]["usage"]["completion_tokens"] == 20
    # what the server got: the prompt file verbatim as the one user message, on the documented URL
    request = server.requests[-1]
    assert request["path"] == "/good/v1/chat/completions"
    assert request["body"]["messages"] == [{"role": "user", "content": PROMPT.read_text()}]
    assert request["body"]["model"] == "test/Tiny-Triton" and request["body"]["temperature"] == 0.2


def test_code_that_does_not_import_is_stored_and_reported(endpoint, tmp_path, capsys):
    _, base = endpoint
    out = tmp_path / "llm"
    rc = generate(f"{base}/broken", out, "--shapes", CHECK_SHAPES)
    printed = capsys.readouterr().out
    assert rc == 1
    (name,) = entries(out)  # the verbatim first output is a result (a first-shot failure): kept
    (line,) = [ln for ln in printed.splitlines() if ln.startswith(name)]
    assert "ERROR" in line and "does not import" in line and "SyntaxError" in line


@pytest.mark.parametrize(
    "behaviour,message",
    [
        ("empty", "empty completion"),
        ("prose", "no ```python code block"),
        ("truncated", "never closed"),
        ("error", "HTTP 500"),
    ],
)
def test_bad_answers_leave_nothing_behind(endpoint, tmp_path, behaviour, message):
    _, base = endpoint
    out = tmp_path / "llm"
    with pytest.raises(ValueError, match=message):
        generate(f"{base}/{behaviour}", out, "--no-check")
    assert entries(out) == []


def test_timeout(endpoint, tmp_path):
    _, base = endpoint
    with pytest.raises(ValueError, match=r"did not answer within 0.3 s"):
        generate(f"{base}/slow", tmp_path / "llm", "--timeout", "0.3", "--no-check")
    assert entries(tmp_path / "llm") == []


def test_unreachable_endpoint(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="cannot reach"):
        generate(f"http://127.0.0.1:{port}", tmp_path / "llm", "--no-check")
    assert entries(tmp_path / "llm") == []


def test_cli_reports_errors_in_one_line(endpoint, tmp_path, capsys):
    _, base = endpoint
    argv = ["--prompt", str(PROMPT), "--endpoint", f"{base}/error", "--model", "m", "--out-root", str(tmp_path)]
    rc = cli.main(["generate", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "HTTP 500" in err
    assert cli.main(["generate", "--", "--prompt", str(PROMPT), "--model", "m"]) == 2  # no --endpoint ('--' is fine)
    assert "needs --endpoint" in capsys.readouterr().err


def test_bad_check_options_are_refused_before_asking(endpoint, tmp_path):
    server, base = endpoint
    before = len(server.requests)
    with pytest.raises(ValueError, match="bad shape 'smok'"):
        generate(f"{base}/good", tmp_path / "llm", "--shapes", "smok")
    with pytest.raises(ValueError, match="unknown dtype 'bf8'"):
        generate(f"{base}/good", tmp_path / "llm", "--dtypes", "bf8")
    assert len(server.requests) == before and entries(tmp_path / "llm") == []


def test_several_samples_are_numbered(endpoint, tmp_path, capsys):
    _, base = endpoint
    out = tmp_path / "llm"
    assert generate(f"{base}/good", out, "--samples", "2", "--no-check") == 0
    assert generate(f"{base}/good", out, "--no-check") == 0
    assert [n.rsplit("-", 1)[1] for n in entries(out)] == ["1", "2", "3"]


# ---------------------------------------------------------------- storing answers made elsewhere
def test_store_completion_and_add_fix_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "llm"
    answer = tmp_path / "answer.md"
    answer.write_text(fenced(GOOD_KERNEL.replace("return y, rstd", "return y.float(), rstd")))
    sampling = '{"temperature": "default", "context": "fresh, prompt only"}'
    rc = main(
        ["--store-completion", str(answer), "--prompt", str(PROMPT), "--model", "claude-test", "--date", "2026-02-03"]
        + ["--sampling", sampling, "--out-root", str(out), "--no-check"]
    )
    assert rc == 0
    folder = out / "triton-rmsnorm-claude-test-20260203-1"
    meta = json.loads((folder / "metadata.json").read_text())
    assert (
        meta["sampling"] == {"temperature": "default", "context": "fresh, prompt only"} and meta["date"] == "2026-02-03"
    )
    fixed = tmp_path / "fixed.py"
    fixed.write_text(GOOD_KERNEL)
    rc = main(
        [
            "--add-fix",
            str(folder),
            "--fixed",
            str(fixed),
            "--reason",
            "dtype: y returned as fp32",
            "--slug",
            "dtype",
            "--no-check",
        ]
    )
    assert rc == 0 and "recorded" in capsys.readouterr().out
    assert json.loads((folder / "metadata.json").read_text())["fixes"] == [
        {"patch": "patches/01-dtype.patch", "reason": "dtype: y returned as fp32"}
    ]
    assert (folder / "patches" / "01-dtype.patch").read_text().startswith("# dtype: y returned as fp32\n--- a/raw.py\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the sample is checked")
def test_gluon_sample_cannot_be_checked_without_a_gpu(tmp_path, capsys):
    """A Gluon sample (here of the fused add + RMSNorm, an op name holding an underscore) has no CPU
    path: without a GPU it is stored and reported as not checked, and that is not a failure."""
    out = tmp_path / "llm"
    answer = tmp_path / "answer.md"
    code = "import torch\n\n\ndef add_rmsnorm_fwd(x, residual, weight, eps):\n    raise RuntimeError\n"
    answer.write_text(fenced(code))
    prompt = REPO / "prompts" / "gluon-add_rmsnorm.v1.md"
    rc = main(["--store-completion", str(answer), "--prompt", str(prompt), "--model", "m", "--out-root", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (name,) = entries(out)
    assert name.startswith("gluon-add_rmsnorm-m-") and name.endswith("-1")
    (line,) = [ln for ln in printed.splitlines() if ln.startswith(name)]
    assert "NOT CHECKED" in line and "cannot be checked here" in line and "cuda" in line, line


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "llm"
    real_write = Path.write_text

    def failing_write(self, text, *a, **k):
        if self.name == "metadata.json":
            raise OSError("disk full")
        return real_write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", failing_write)
    with pytest.raises(OSError, match="disk full"):
        store_sample(PROMPT, fenced(GOOD_KERNEL), "m", out_root=out)
    assert entries(out) == []


# ---------------------------------------------------------------- pieces
def test_endpoint_url_rule():
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("https://h/api/v1/chat/completions") == "https://h/api/v1/chat/completions"
    with pytest.raises(ValueError, match="http"):
        chat_completions_url("h:8000")


def test_extract_code_block():
    assert extract_code_block("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```\n") == ("x = 1\n", 2)
    assert extract_code_block("```bash\nls\n```\n```py\nx = 1\n```") == ("x = 1\n", 1)
    assert extract_code_block("<think>```python\nnot this\n```</think>\n````python\nx = '```'\n````\n") == (
        "x = '```'\n",
        1,
    )
    with pytest.raises(ValueError, match="no ```python"):
        extract_code_block("```\nx = 1\n```")
    with pytest.raises(ValueError, match="empty"):
        extract_code_block("```python\n```")
