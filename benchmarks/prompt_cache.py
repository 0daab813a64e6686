"""Time to first token of each turn of a chat about a document, with the server's prompt cache
and cold.

Two servers in this process on loopback (one slot each, `--strategy` for every request): one
as `delspec serve` runs by default (the prompt cache on), one that keeps no evicted prefix and
whose slot is given an unrelated prompt before every turn, so that each turn is a cold start
(its reported cached tokens are checked to be 0). Turn 1 gives `--articles` ACL papers' first
~300 words each (~1,700 tokens for 4) and asks for a one-sentence summary of the first; each
later turn asks for the next one's, so the history grows by a reply and a question a turn.
Each turn goes to both servers (which first alternates), streamed; the time to the first piece
of text is taken, and the replies must be identical (greedy). Writes `results.json` and
`table.md` to `--out`.

    python benchmarks/prompt_cache.py --out benchmarks/results/prompt-cache-zen4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

from delspec import load_model
from delspec.bench.environment import model_info, run_environment
from delspec.bench.tasks import load_task
from delspec.server import create_app, serving

FLUSH = {"prompt": "Zebra", "max_tokens": 1}  # shares no token with the chat's prompts


def streamed(url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """Seconds to the first piece of text, the text and the usage of a streamed chat."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
    return first if first is not None else time.perf_counter() - start, text, usage


def run(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_model(args.model)
    articles = [p.text.removeprefix("Article: ").removesuffix("\nSummary:") for p in
                load_task("summarization", args.articles)]  # fmt: skip
    document = "\n\n".join(f"Article {i}: {a}" for i, a in enumerate(articles, 1))
    options = {"max_batch": 1}
    cached_app = create_app(lm, **options)
    cold_app = create_app(lm, prompt_cache_mb=0, **options)
    rows = []
    with serving(cached_app) as cached_url, serving(cold_app) as cold_url:
        chat: list[dict[str, str]] = []
        for turn in range(1, args.turns + 1):
            question = f"Summarize article {(turn - 1) % len(articles) + 1} in one sentence."
            content = f"{document}\n\n{question}" if turn == 1 else question
            chat.append({"role": "user", "content": content})
            body = {"messages": chat, "max_tokens": args.max_tokens, "temperature": 0}
            body["delspec"] = {"strategy": args.strategy}
            got: dict[str, tuple[float, str, dict[str, Any]]] = {}
            for name in ("cold", "cached") if turn % 2 else ("cached", "cold"):
                if name == "cold":
                    httpx.post(cold_url + "/v1/completions", json=FLUSH, timeout=60)
                got[name] = streamed(cold_url if name == "cold" else cached_url, body)
            cold_usage, cached_usage = got["cold"][2], got["cached"][2]
            assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
            assert got["cold"][1] == got["cached"][1], f"turn {turn}: the replies differ"
            rows.append({
                "turn": turn,
                "prompt_tokens": cached_usage["prompt_tokens"],
                "cached_tokens": cached_usage["prompt_tokens_details"]["cached_tokens"],
                "ttft_cold_s": round(got["cold"][0], 4),
                "ttft_cached_s": round(got["cached"][0], 4),
                "identical": True,
            })  # fmt: skip
            print(rows[-1], flush=True)
            chat.append({"role": "assistant", "content": got["cached"][1]})
    return {
        "environment": run_environment(lm),
        "model": model_info(lm),
        "strategy": args.strategy,
        "max_tokens": args.max_tokens,
        "articles": args.articles,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"# Prompt cache: time to first token by turn, {result['model']['name']}",
        "",
        f"Turn 1: {result['articles']} articles and a question; later turns: a question each.",
        "",
        f"{env['date']} · {env['cpu']} · {env['threads']} thread(s) · `{result['strategy']}`, "
        f"greedy, {result['max_tokens']} tokens a reply · one slot per server, cold and cached "
        "turns alternate first; every reply identical both ways",
        "",
        "| turn | prompt tokens | cached tokens | TTFT cold s | TTFT cached s | cached / cold |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ratio = row["ttft_cached_s"] / row["ttft_cold_s"]
        lines.append(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | "
            f"{row['ttft_cold_s']:.3f} | {row['ttft_cached_s']:.3f} | {ratio:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--articles", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--strategy", default="del-fast")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "table.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
