"""`delspec bench-serve --turns N`: what the prompt cache saves a chat whose history grows.

Two servers, each `delspec serve` in a process of its own with one slot (`--max-batch 1`): one
as users run it (the prompt cache on), one with `--prompt-cache-mb 0` whose slot is given an
unrelated one-token prompt before every turn, so that each of its turns is a cold start (its
reported cached tokens are checked to be 0). Turn 1 gives `articles` papers' first ~300 words
(the summarization task's: 5 by default, ~2,100 tokens with SmolLM2's tokenizer) and asks for a
one-sentence summary of the first; each later turn asks for the next one's, so the history
grows by a reply and a question a turn. Each turn goes to both servers (which one first
alternates), streamed and greedy; reported per turn: prompt and cached tokens, each server's
time to the first piece of text, and whether the replies are identical (they must be: the
cache is exact).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from delspec.bench.serve_clients import Streamed, stream_chat
from delspec.bench.serve_load import TIMEOUT, describe, serve_process
from delspec.bench.tasks import load_task
from delspec.decode_config import DEFAULT_STRATEGY

FLUSH = {"prompt": "Zebra", "max_tokens": 1}  # shares no first token with the chat's prompts


async def _streamed(url: str, body: dict[str, Any]) -> Streamed:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        return await stream_chat(http, url, body)


def streamed(url: str, body: dict[str, Any]) -> Streamed:
    """A streamed chat `body` to the server at `url` (with its usage chunk); RuntimeError for
    an error."""
    out = asyncio.run(
        _streamed(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    if out.error is not None:
        raise RuntimeError(f"the server failed a turn: {out.error}")
    if out.first_token_s is None:
        raise RuntimeError("a turn's reply had no text: no time to its first token")
    return out


def document(articles: int) -> str:
    """The first `articles` summarization articles, numbered."""
    texts = [
        p.text.removeprefix("Article: ").removesuffix("\nSummary:")
        for p in load_task("summarization", articles)
    ]
    return "\n\n".join(f"Article {i}: {text}" for i, text in enumerate(texts, 1))


def run_turns(
    serve_args: list[str],
    turns: int,
    *,
    articles: int = 5,
    max_tokens: int = 32,
    strategy: str | None = None,
) -> dict[str, Any]:
    """The measurement (see the module docstring) with servers started from `serve_args`
    (model, weights, threads, ...) and `strategy` for both (None: the server's default)."""
    own = ["--max-batch", "1"] + (["--strategy", strategy] if strategy else [])
    text = document(articles)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        cached, _ = stack.enter_context(serve_process([*serve_args, *own], "the cached server"))
        cold, _ = stack.enter_context(
            serve_process([*serve_args, *own, "--prompt-cache-mb", "0"], "the cold server")
        )
        urls = {"cached": cached, "cold": cold}
        chat: list[dict[str, str]] = []
        for turn in range(1, turns + 1):
            question = f"Summarize article {(turn - 1) % articles + 1} in one sentence."
            content = f"{text}\n\n{question}" if turn == 1 else question
            chat.append({"role": "user", "content": content})
            body = {"messages": chat, "max_tokens": max_tokens, "temperature": 0}
            got: dict[str, Streamed] = {}
            for name in ("cold", "cached") if turn % 2 else ("cached", "cold"):
                if name == "cold":
                    httpx.post(cold + "/v1/completions", json=FLUSH, timeout=TIMEOUT)
                got[name] = streamed(urls[name], body)
            cold_cached = got["cold"].usage["prompt_tokens_details"]["cached_tokens"]
            if cold_cached:
                raise RuntimeError(f"turn {turn}: the cold server reused {cold_cached} tokens")
            usage = got["cached"].usage
            rows.append({
                "turn": turn,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "ttft_cold_s": round(got["cold"].first_token_s, 4),
                "ttft_cached_s": round(got["cached"].first_token_s, 4),
                "identical": got["cold"].text == got["cached"].text,
            })  # fmt: skip
            print(
                f"turn {turn}: {rows[-1]['prompt_tokens']} prompt tokens, "
                f"{rows[-1]['cached_tokens']} cached; TTFT cold {rows[-1]['ttft_cold_s']:.3f} s, "
                f"cached {rows[-1]['ttft_cached_s']:.3f} s",
                flush=True,
            )
            chat.append({"role": "assistant", "content": got["cached"].text})
        where = describe(cached, serve_args)
    return {
        "environment": where,
        "strategy": strategy or DEFAULT_STRATEGY,
        "max_tokens": max_tokens,
        "articles": articles,
        "rows": rows,
    }


def turns_table(result: dict[str, Any]) -> str:
    """The measurement as Markdown."""
    env = result["environment"]
    lines = [
        f"# delspec bench-serve --turns: time to first token by turn, {env['model']}",
        "",
        f"{env['date']} · {env['cpu']} · `delspec serve {env['serve_args']}` (all cores) · "
        f"`{result['strategy']}`, greedy, at most {result['max_tokens']} tokens a reply · turn "
        f"1: {result['articles']} articles and a question, later turns a question each · one "
        "slot per server; which server answers a turn first alternates.",
        "",
        "| turn | prompt tokens | cached tokens | TTFT cold s | TTFT cached s | cached / cold "
        "| replies identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ratio = row["ttft_cached_s"] / row["ttft_cold_s"]
        lines.append(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | "
            f"{row['ttft_cold_s']:.3f} | {row['ttft_cached_s']:.3f} | {ratio:.2f}x | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def write_turns(result: dict[str, Any], out: Path) -> None:
    """results.json and table.md in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "table.md").write_text(turns_table(result))
