"""Random and malformed input, seeded: request bodies to both completion endpoints of a real
server on loopback, and command lines and standard input to `delspec generate` (in-process, and
twice as a process of its own). No 5xx, no traceback; the server still answers /health."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import CHAT, TEXT, TIMEOUT, tiny_lm

import delspec.weights.loading
from delspec.cli import main
from delspec.server import create_app, serving
from delspec.weights.loading import LoadedModel

SEED = 60
BODIES = 300  # requests to each endpoint
COMMAND_LINES = 150

# characters random text is made of: ASCII, controls, CJK, emoji (several code points); and, in
# some texts, a lone surrogate (what "\ud800" in JSON and bytes that are not UTF-8 on a command
# line become)
CHARACTERS = "aZ 09.,:-_{}[]\"'\\\n\t\x00\x7f" + "北京首都，é€" + "👍🏽💡"
SURROGATES = "\ud800\udc00\udce9\udfff"
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs",
    "delspec", "user", "unknown_field",
]  # fmt: skip


def text(rng: random.Random, longest: int = 12) -> str:
    chars = [rng.choice(CHARACTERS) for _ in range(rng.randint(0, longest))]
    if rng.random() < 0.15:
        chars.insert(rng.randint(0, len(chars)), rng.choice(SURROGATES))
    return "".join(chars)


def value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value (of Python's JSON: NaN and infinities included)."""
    kinds = ["text", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "text":
        return text(rng)
    if kind == "int":
        return rng.choice([-1, 0, 1, 2, 3, 20, 21, 255, 2**31, 2**63, -(2**63), 10**30])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, 1.5, 2.5, -0.1, 1e308, float("nan"), float("inf")])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["role", "content", "type", "text", "include_usage", "strategy", *FIELDS]
    return {rng.choice([*keys, text(rng)]): value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def plausible(rng: random.Random, field: str) -> Any:
    """A value of the kind `field` takes, often a valid one."""
    conversation = [
        {"role": rng.choice(["system", "user", "assistant"]), "content": text(rng)}
        for _ in range(rng.randint(1, 3))
    ]
    choices = {
        "model": ["tiny", text(rng)],
        "prompt": [text(rng), [1, 2, 3], []],
        "messages": [conversation, [{"role": "user", "content": [{"type": "text", "text": "a"}]}]],
        "max_tokens": [1, 3],
        "max_completion_tokens": [2],
        "temperature": [0, 0.7, 2],
        "top_p": [0.5, 1],
        "top_k": [0, 5],
        "seed": [0, 7],
        "stop": [text(rng, 3), [text(rng, 2), "\n"]],
        "n": [1],
        "stream": [True, False],
        "stream_options": [{"include_usage": True}, {"include_usage": False}],
        "logprobs": [True, False, 2],
        "top_logprobs": [2],
        "delspec": [
            {"strategy": "ar"},
            {"strategy": "static", "exit_layer": 2},
            {"preset": "paper"},
        ],
    }
    return rng.choice(choices.get(field, [text(rng)]))


def body(rng: random.Random, chat: bool) -> bytes:
    """A request body: random bytes, a JSON value that is no object, or a request with a few
    random fields, of the kind they take or of any kind. Replies stay short: max_tokens is
    never dropped."""
    roll = rng.random()
    if roll < 0.1:
        return rng.randbytes(rng.randint(0, 40))
    if roll < 0.2:
        return json.dumps(value(rng)).encode()
    request: dict[str, Any] = {"max_tokens": rng.randint(1, 3), "temperature": 0}
    if chat:
        request["messages"] = [{"role": "user", "content": text(rng) or "hi"}]
    else:
        request["prompt"] = text(rng) or "hi"
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        request[field] = plausible(rng, field) if rng.random() < 0.6 else value(rng)
        if field in ("max_tokens", "max_completion_tokens") and request[field] is None:
            request[field] = 2  # None would reply up to the context: a slow test, not a finding
    raw = json.dumps(request)  # lone surrogates as \\ud800 escapes
    if rng.random() < 0.1:
        raw = raw[: rng.randint(0, len(raw))]  # cut short: not JSON
    return raw.encode()


@pytest.fixture(scope="module")
def tiny(smollm2: LoadedModel) -> LoadedModel:
    return tiny_lm(smollm2)


@pytest.fixture(scope="module")
def url(tiny: LoadedModel) -> Iterator[str]:
    with serving(create_app(tiny, max_queue=4)) as address:
        yield address


def check_reply(response: httpx.Response, sent: bytes) -> None:
    """A 2xx or 4xx, with a complete JSON body, or a complete stream without a server error."""
    assert response.status_code < 500, (sent, response.status_code, response.text)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), (sent, events)
        for event in events[:-1]:
            assert "error" not in json.loads(event), (sent, event)
        return
    reply = response.json()
    if response.status_code >= 400:
        assert set(reply["error"]) == {"message", "type", "param", "code"}, (sent, reply)
        assert reply["error"]["type"] != "server_error", (sent, reply)


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_random_bodies_get_no_server_errors(url: str, path: str) -> None:
    rng = random.Random(f"{SEED}{path}")
    content_types = ["application/json"] * 8 + ["text/plain", None]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for _ in range(BODIES):
            sent = body(rng, path == CHAT)
            kind = rng.choice(content_types)
            headers = {"content-type": kind} if kind else {}
            check_reply(http.post(path, content=sent, headers=headers), sent)
        assert http.get("/health").json()["status"] == "ok"
        ok = http.post(path.replace(CHAT, TEXT), json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


GENERATE_OPTIONS = [
    "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--stop", "--strategy",
    "--exit-layer", "--draft-length", "--option", "--draft-vocab", "--int8-draft", "--preset",
    "--adapters", "--threads", "--chat", "--json", "--no-context-vocab", "--bogus",
]  # fmt: skip
SWITCHES = {"--chat", "--json", "--no-context-vocab"}


def command_line(rng: random.Random) -> tuple[list[str], bytes]:
    """`generate`'s arguments, a few of them random, and bytes for standard input (read when
    the prompt is -). Every reply is short: --max-new-tokens 3 comes first, and a random one
    after it is small, or invalid."""
    prompt = rng.choice(["-", text(rng), "Hi"])
    argv = ["generate", prompt, "--max-new-tokens", "3"]
    for _ in range(rng.randint(0, 3)):
        option = rng.choice(GENERATE_OPTIONS)
        argv.append(option)
        if option not in SWITCHES:
            number = rng.choice(["-1", "0", "1", "2", "3.5", "1e9", "99999999999999999999"])
            argv.append(rng.choice([number, text(rng), "", "auto", "static", "x=y"]))
    if "--max-new-tokens" in argv[4:]:
        at = argv.index("--max-new-tokens", 4) + 1
        if at < len(argv) and argv[at].isdigit() and int(argv[at]) > 3:
            argv[at] = "3"
    stdin = rng.choice([rng.randbytes(rng.randint(0, 20)), text(rng).encode("utf-8", "replace")])
    return argv, stdin


def test_random_command_lines_end_in_a_message_not_a_traceback(
    tiny: LoadedModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delspec.weights.loading, "load_model", lambda *args, **kwargs: tiny)
    rng = random.Random(SEED)
    for _ in range(COMMAND_LINES):
        argv, stdin = command_line(rng)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse: a usage message
            code = exit_info.code
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            assert err.startswith(("delspec: error: ", "usage: delspec")), (argv, err)


@pytest.mark.parametrize(
    "argv",
    [
        [b"generate", b"caf\xe9 \xff\xfe", b"--max-new-tokens", b"2"],
        [b"generate", b"Hi", b"--stop", b"\xc3", b"--seed", b"-1"],
        [b"serve", b"--port", b"99999"],
    ],
)
def test_bytes_that_are_not_utf8_on_a_real_command_line(argv: list[bytes]) -> None:
    command = [sys.executable.encode(), b"-m", b"delspec.cli", *argv]
    done = subprocess.run(command, capture_output=True, timeout=300, env=os.environ)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and "Traceback" not in err
    assert err.startswith(("delspec: error: ", "usage: delspec")), err
