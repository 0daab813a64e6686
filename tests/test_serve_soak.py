"""`bench-serve --soak` and `--stress` against a real server on loopback (the tiny model with
SmolLM2's tokenizer, in this process): a correct server shows no 5xx and no answer that
differs from its solo answer, and every reported figure is measured."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import pytest
from helpers import PROMPTS, tiny_lm

from delspec.bench.serve_soak import soak, write_soak
from delspec.bench.serve_stress import big_bodies, long_join, stress_table
from delspec.server import create_app
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel


def test_a_short_soak_finds_a_correct_server_correct(smollm2: LoadedModel, tmp_path: Path) -> None:
    app = create_app(tiny_lm(smollm2), max_batch=4, max_body_mb=0.25, prefill_chunk=32)
    with running(app) as url:
        result = asyncio.run(
            soak(url, 5.0, pid=os.getpid(), clients=2, max_tokens=8, long_tokens=100,
                 max_body_mb=0.25, prompts=PROMPTS)
        )  # fmt: skip
    assert set(result.requests) == {"normal", "long prompt", "vanishing", "hostile"}
    assert all(count > 0 for count in result.requests.values())
    assert (result.server_errors, result.unexpected, result.wrong_answers) == (0, 0, 0), (
        result.examples
    )
    assert result.vanished == result.requests["vanishing"]
    assert result.wall_s >= 5.0  # it ran for its duration
    assert len(result.samples) >= 4
    assert all(s.rss_mib is not None and s.rss_mib > 10 for s in result.samples)
    assert result.queue_depth_max is not None and result.queue_depth_max >= 0
    assert result.rss_growth_pct is not None and math.isfinite(result.rss_growth_pct)
    write_soak(result, {"model": "tiny", "date": "today", "cpu": "cpu", "serve_args": ""}, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | 0 | 0 |" in table and (tmp_path / "results.json").stat().st_size > 0


@pytest.mark.parametrize("chunk", [16])
def test_stress_measures_a_long_prompt_joining_and_big_bodies(
    smollm2: LoadedModel, chunk: int
) -> None:
    app = create_app(tiny_lm(smollm2), max_batch=3, max_body_mb=1.0, prefill_chunk=chunk)
    with running(app) as url:
        joined = asyncio.run(long_join(url, 2, 100, 8, PROMPTS))
        bodies = asyncio.run(big_bodies(url, 2, 1, 0.5, PROMPTS[0]))
    assert joined.wrong_answers == 0 and not joined.errors
    assert joined.long_prompt_tokens is not None and 80 < joined.long_prompt_tokens < 240
    assert 0 < joined.gap_before_p50_ms <= joined.gap_before_max_ms
    assert joined.gap_during_max_s > 0 and joined.long_first_token_s > 0
    assert bodies.statuses == {"400": 2}  # read, tokenized, too long for the context
    assert bodies.health_polls > 0 and 0 < bodies.health_p50_ms <= bodies.health_p99_ms
    assert bodies.small_chats > 0 and bodies.wrong_answers == 0 and not bodies.errors
    lines = stress_table({"long_prompt_joins": vars(joined), "big_bodies": vars(bodies)})
    assert "joins 2 running streams" in "\n".join(lines)


@pytest.mark.slow
def test_bench_serve_turns_reuses_the_history_and_answers_as_cold(tmp_path: Path, capsys) -> None:
    """`delspec bench-serve --turns`, as a user runs it: two `delspec serve` processes on the
    embedded model; the cached server's later turns reuse the history, the cold one's none, and
    both give the same replies."""
    from delspec.cli import main

    out = tmp_path / "turns"
    argv = ["bench-serve", "--turns", "2", "--setups", "ar", "--max-tokens", "4", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    first, second = result["rows"]
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 1500
    assert second["prompt_tokens"] > first["prompt_tokens"] > 0
    assert second["cached_tokens"] >= first["prompt_tokens"]  # the whole first turn, at least
    assert second["cached_tokens"] < second["prompt_tokens"]
    assert first["identical"] and second["identical"]
    assert all(row["ttft_cold_s"] > 0 and row["ttft_cached_s"] > 0 for row in result["rows"])
    assert "| 2 |" in (out / "table.md").read_text()
    assert "wrote results.json, table.md" in capsys.readouterr().out


def test_bench_serve_turns_refuses_a_url(capsys) -> None:
    from delspec.cli import main

    code = main(["bench-serve", "--turns", "2", "--url", "http://127.0.0.1:9"])
    assert code != 0
    assert "--turns starts its own two servers" in capsys.readouterr().err
