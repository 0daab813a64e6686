"""Decode-size products on GGUF blocks: delspec's compiled kernels against torch's best, and
against the memory limit and llama.cpp on the shapes of the models people run.

Two modes:

- the offline models (default): for every (GGUF type, part shape) the two models hold (their
  real blocks) and M rows of activations, times `BlockWeight.__call__` against torch's kernels
  on the same tensor (int4pack for 4/5-bit types, int8pack, float32 `F.linear`) and the
  machine's streaming read bandwidth;
- `--synthetic SHAPE[,SHAPE]` (large_model.py's shapes: Q4_K layers, a Q6_K head, Q5_0 and Q8_0
  where rows hold no whole 256-value block): every layer's products of one kind timed in turn
  (the weights stream from memory as in a step), M = 1 (alone, and twinned: the two-row loop on
  the row and its copy), 2, 4, 8, at 1 and 2 threads, as GB/s-equivalent and % of the read
  bandwidth measured at the same thread count; beside them llama-bench's tg (token generation)
  on the same synthetic GGUF file (`--llama-bench PATH`, or `llama-bench` on PATH: build it for
  this CPU, e.g. llama.cpp's CMake with its native CPU flags, or the comparison is with a slower
  peer than users run).

Writes `summary.json` and `table.md` to `--out`.

    python benchmarks/block_products.py --quick --out /tmp/kq
    python benchmarks/block_products.py --synthetic qwen2-1.5b,llama3.2-1b --out /tmp/ks
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from delspec import load_model
from delspec.bench.environment import read_bandwidth
from delspec.cache import cache_dir
from delspec.kernels.blocks import BlockWeight
from delspec.kernels.build import cpu_name, library
from delspec.kernels.layers import set_twin_row

MODELS = ("default", "gemma3-270m")
FULL_M, QUICK_M = (1, 2, 4, 8, 16), (1, 8)
_T = gguf.GGMLQuantizationType
INT4_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_0, _T.Q5_1, _T.Q5_K})
SIMD_NAMES = {2: "VNNI", 1: "AVX2", 0: "portable C"}
GOAL_BANDWIDTH, GOAL_SPEEDUP, GOAL_M8 = 0.6, 1.5, 2.0
# Relative error (vs a float product) beyond which a kernel is miscalled, not just lossy.
TOLERANCE = {"ours": 0.05, "torch": 0.25}
ROLES = ("head", "largest layer", "layer")

Product = Callable[[Tensor, Tensor], Tensor]  # (float32 x, bfloat16 x) -> x @ w.T


@dataclass
class Group:
    """All of a model's parts of one GGUF type and shape, each as a one-part weight."""

    model: str
    qtype: gguf.GGMLQuantizationType
    rows: int
    cols: int
    role: str  # one of ROLES
    weights: list[BlockWeight] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of one part's blocks."""
        return self.weights[0].nbytes


def model_groups(name: str) -> list[Group]:
    """The (type, shape) groups of the parts that `name`'s products multiply."""
    lm = load_model(name, weights="native")
    model, head = lm.model, lm.model.head_weight
    groups: dict[tuple[gguf.GGMLQuantizationType, int, int], Group] = {}
    for weight in model.block_weights:
        if weight is model.embed_blocks and weight is not head:
            continue  # an untied embedding is looked up, never multiplied
        for part in weight.parts:
            key = (part.qtype, part.rows, weight.cols)
            group = groups.setdefault(key, Group(lm.name, *key, role="layer"))
            group.weights.append(BlockWeight([part], weight.cols))
            if weight is head:
                group.role = "head"
    layers = [g for g in groups.values() if g.role == "layer"]
    max(layers, key=lambda g: g.nbytes).role = "largest layer"
    return list(groups.values())


def order(group: Group) -> tuple:
    """Heads first, then the largest layer tensor, then by type and shape."""
    return (ROLES.index(group.role), group.qtype.name, group.rows, group.cols)


def float_product(w: Tensor) -> Product:
    return lambda x, xb: F.linear(x, w)


def int8_product(w: Tensor) -> Product:
    """torch's per-row int8 kernel on `w` requantised (bf16 activations)."""
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    q = torch.div(w, scale[:, None]).round_().to(torch.int8)
    scale = scale.to(torch.bfloat16)
    return lambda x, xb: torch._weight_int8pack_mm(xb, q, scale)


def int4_product(w: Tensor) -> Product:
    """torch's int4 kernel (group 32, bf16 activations) on a min-max 4-bit requantisation."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    low = blocks.amin(-1)
    scale = ((blocks.amax(-1) - low) / 15).clamp(min=1e-12)
    q = ((blocks - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1)
    zeros = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous()
    scales_zeros = scales_zeros.to(torch.bfloat16)
    return lambda x, xb: torch._weight_int4pack_mm_for_cpu(xb, packed, 32, scales_zeros)


def int4_fits(group: Group) -> bool:
    """Whether torch's int4 kernel takes this tensor: 4/5-bit, N % 16 == 0, K % 32 == 0."""
    return group.qtype in INT4_TYPES and group.rows % 16 == 0 and group.cols % 32 == 0


def kernels(group: Group) -> dict[str, list[Product]]:
    """Ours and torch's products for each of the group's parts, checked against float."""
    floats = [w.dequantize() for w in group.weights]
    products: dict[str, list[Product]] = {"ours": [lambda x, xb, w=w: w(x) for w in group.weights]}
    if int4_fits(group):
        products["int4pack"] = [int4_product(w) for w in floats]
    products["int8pack"] = [int8_product(w) for w in floats]
    products["f32 F.linear"] = [float_product(w) for w in floats]
    x = torch.randn(2, group.cols)
    reference = F.linear(x, floats[0])
    for name, fns in products.items():
        error = float((fns[0](x, x.bfloat16()).float() - reference).norm() / reference.norm())
        if error > TOLERANCE["ours" if name == "ours" else "torch"]:
            raise SystemExit(f"{name} on {group.qtype.name} {group.rows}x{group.cols}: {error=}")
    return products


def per_product_us(fns: list[Product], x: Tensor, xb: Tensor, repeats: int) -> float:
    """Median time of one product, each timing a sweep over all `fns` (one product each)."""
    for fn in fns:
        fn(x, xb)
    sweeps = []
    for _ in range(repeats):
        start = time.perf_counter()
        for fn in fns:
            fn(x, xb)
        sweeps.append((time.perf_counter() - start) / len(fns))
    return statistics.median(sweeps) * 1e6


def bench_group(group: Group, ms: tuple[int, ...], repeats: int, context: dict) -> list[dict]:
    """One row per M for `group`."""
    products = kernels(group)
    rows, m1_us = [], 0.0
    for m in ms:
        x = torch.randn(m, group.cols)
        xb = x.bfloat16()
        times = {name: per_product_us(fns, x, xb, repeats) for name, fns in products.items()}
        us = times.pop("ours")
        m1_us = us if m == 1 else m1_us
        best = min(times, key=times.__getitem__)
        row = {
            "model": group.model,
            "role": group.role,
            "type": group.qtype.name,
            "rows": group.rows,
            "cols": group.cols,
            "parts": len(group.weights),
            "part_bytes": group.nbytes,
            "M": m,
            "us": round(us, 1),
            "weight_gb_per_s": round(group.nbytes / us / 1e3, 2),
            "torch_us": {name: round(t, 1) for name, t in times.items()},
            "torch_best_us": round(times[best], 1),
            "torch_best": best,
            "speedup_vs_torch": round(times[best] / us, 2),
            "m_over_m1": round(us / m1_us, 2),
            **context,
        }
        row["goal"] = goal(row)
        rows.append(row)
    return rows


def goal(row: dict) -> str | None:
    """'pass', 'fail: ...' or None where no goal applies (see the table's header)."""
    failures = []
    if row["M"] == 1 and row["role"] != "layer":
        share = row["weight_gb_per_s"] / row["bandwidth_gb_per_s"]
        if share < GOAL_BANDWIDTH:
            failures.append(f"{share:.0%} of bandwidth")
        if row["speedup_vs_torch"] < GOAL_SPEEDUP:
            failures.append(f"{row['speedup_vs_torch']:.2f}x torch")
    elif row["M"] == 8:
        if row["m_over_m1"] > GOAL_M8:
            failures.append(f"{row['m_over_m1']:.2f}x M=1")
    else:
        return None
    return f"fail: {', '.join(failures)}" if failures else "pass"


def table(rows: list[dict], context: dict, repeats: int, quick: bool) -> str:
    """The Markdown report of `rows`."""
    bandwidth = context["bandwidth_gb_per_s"]
    lines = [
        "# GGUF block kernels vs torch: decode-size products",
        "",
        f"CPU: {context['cpu']}; threads: {context['threads']}; SIMD: {context['simd_name']} "
        f"(level {context['simd']}); streaming read bandwidth: {bandwidth:.1f} GB/s (the "
        "fastest of 5 sums and 5 maxima of a 1 GiB float32 tensor); "
        f"torch {torch.__version__}; median of {repeats} timings after a warm-up"
        + ("; quick mode: LM heads and largest layer tensors" if quick else "")
        + ".",
        "",
        "Times are per product. Each (type, shape) is timed cycling over all the model's parts "
        "of that type and shape (`parts`, one product per call), so layer tensors stream from "
        "memory as in a decode step instead of sitting in cache; a group whose parts together "
        "fit in the last-level cache (see `MB`) may still be partly cache-resident. torch's "
        "kernels get bf16 activations converted beforehand (their only vectorised x86 path) "
        "and weights requantised from the dequantised blocks (int4pack: min-max per group of "
        "32, int8pack: per row), which keeps their speed but not the file's exact values.",
        "",
        f"Goals: at M=1 on the LM heads and each model's largest layer tensor, >= "
        f"{GOAL_BANDWIDTH:.0%} of bandwidth ({GOAL_BANDWIDTH * bandwidth:.1f} GB/s) and >= "
        f"{GOAL_SPEEDUP}x torch's best; at M=8 (every tensor), <= {GOAL_M8:g}x our M=1 time.",
        "",
        "| model | tensor | type | rows x cols | parts | MB | M | us | GB/s | % bw "
        "| torch best | torch us | vs torch | M/M1 | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        megabytes = r["parts"] * r["part_bytes"] / 1e6
        lines.append(
            f"| {r['model']} | {r['role']} | {r['type']} | {r['rows']}x{r['cols']} "
            f"| {r['parts']} | {megabytes:.1f} | {r['M']} | {r['us']:.1f} "
            f"| {r['weight_gb_per_s']:.2f} | {r['weight_gb_per_s'] / bandwidth:.0%} "
            f"| {r['torch_best']} | {r['torch_best_us']:.1f} | {r['speedup_vs_torch']:.2f}x "
            f"| {r['m_over_m1']:.2f} | {r['goal'] or ''} |"
        )
    return "\n".join(lines) + "\n"


SYNTHETIC_M = (1, 2, 4, 8)
SYNTHETIC_THREADS = (1, 2)


def synthetic_groups(shape: str) -> dict[str, tuple[gguf.GGMLQuantizationType, int, int, int]]:
    """large_model.py's `shape` as delspec multiplies it: per kind of product (q/k/v and
    gate/up fused, as the loader fuses them), (type, rows, cols, how many in a step)."""
    from large_model import SHAPES, block_type

    layers, hidden, ffn, heads, kv_heads, vocab = SHAPES[shape]
    kv = hidden // heads * kv_heads
    groups = {
        "qkv": (_T.Q4_K, hidden + 2 * kv, hidden, layers),
        "output": (_T.Q4_K, hidden, hidden, layers),
        "gate/up": (_T.Q4_K, 2 * ffn, hidden, layers),
        "down": (_T.Q4_K, hidden, ffn, layers),
        "head": (_T.Q6_K, vocab, hidden, 1),
    }
    return {
        kind: (block_type(t, cols), rows, cols, n) for kind, (t, rows, cols, n) in groups.items()
    }


def synthetic_weights(qtype, rows: int, cols: int, count: int) -> list[BlockWeight]:
    """`count` weights of random blocks with sane scales (large_model.py's)."""
    from large_model import _random_tensor

    rng = np.random.default_rng(rows * 7 + cols)
    blocks = (torch.from_numpy(_random_tensor(rng, (rows, cols), qtype)) for _ in range(count))
    return [BlockWeight.from_blocks(qtype, b, cols) for b in blocks]


def llama_bench_tg(binary: str | None, path: Path, threads: int) -> float | None:
    """llama-bench's tg128 tokens/s on `path` at `threads` threads (best of its repetitions'
    mean), or None without a llama-bench."""
    if binary is None:
        return None
    command = [binary, "-m", str(path), "-p", "0", "-n", "128", "-t", str(threads), "-r", "2"]
    done = subprocess.run([*command, "-o", "json"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"llama-bench failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(json.loads(done.stdout)[0]["avg_ts"])


def delspec_decode(path: Path, threads: int) -> float | None:
    """delspec `ar` decode tokens/s on `path` (128 new tokens, greedy), in its own process as a
    user runs it; None if it failed."""
    command = ["delspec", "generate", "The quick brown fox", "--model", str(path)]
    command += ["--strategy", "ar", "--threads", str(threads), "--max-new-tokens", "128", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"delspec failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return 1e3 / json.loads(done.stdout)["stats"]["decode_ms_per_token"]


PEER_TURNS = 3  # llama-bench and delspec take turns this many times; the medians are kept


def peer_and_ar(llama_bench: str | None, path: Path, threads: int) -> tuple[float | None, ...]:
    """llama-bench's tg128 and delspec's `ar` decode tokens/s, taking turns `PEER_TURNS` times
    (a shared host's speed drifts; turns spread the drift over both): each one's median."""
    tgs, ars = [], []
    for _ in range(PEER_TURNS):
        tgs.append(llama_bench_tg(llama_bench, path, threads))
        ars.append(delspec_decode(path, threads))
    tgs, ars = [t for t in tgs if t is not None], [a for a in ars if a is not None]
    return (statistics.median(tgs) if tgs else None), (statistics.median(ars) if ars else None)


def bench_synthetic(shape: str, repeats: int, llama_bench: str | None) -> dict:
    """One shape's rows (per product kind, threads and M) and whole-step figures."""
    from large_model import write_model

    path = cache_dir() / "benchmarks" / f"synthetic-{shape}.gguf"
    if not path.is_file():
        print(f"writing {path} (once)...", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, shape)
    groups = synthetic_groups(shape)
    weights = {kind: synthetic_weights(*spec) for kind, spec in groups.items()}
    step_bytes = sum(w.nbytes for ws in weights.values() for w in ws)
    rows, steps = [], {}
    for threads in SYNTHETIC_THREADS:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth()
        step_us = dict.fromkeys(SYNTHETIC_M, 0.0)
        for kind, (qtype, n, k, count) in groups.items():
            fns = [lambda x, xb, w=w: w(x) for w in weights[kind]]
            timed = {}
            for m, twin in [(1, False), (1, True), *((m, False) for m in SYNTHETIC_M[1:])]:
                x = torch.randn(m, k)
                before = set_twin_row(twin)
                timed[m, twin] = per_product_us(fns, x, x, repeats)
                set_twin_row(bool(before))
            # one row as decoding takes it where the machine measured right: the faster way
            m1_us = min(timed[1, False], timed[1, True])
            step_us[1] += m1_us * count
            for (m, twin), us in timed.items():
                if m > 1:
                    step_us[m] += us * count
                gb_s = weights[kind][0].nbytes / us / 1e3
                rows.append({
                    "shape": shape, "product": kind, "type": qtype.name, "rows": n, "cols": k,
                    "count": count, "threads": threads, "M": "1, twinned" if twin else m,
                    "us": round(us, 1), "weight_gb_per_s": round(gb_s, 2),
                    "bandwidth_gb_per_s": round(bandwidth, 2),
                    "share_of_bandwidth": round(gb_s / bandwidth, 3),
                    "m_over_m1": round(us / m1_us, 2),
                })  # fmt: skip
        tg, ar = peer_and_ar(llama_bench, path, threads)
        steps[threads] = {
            "bandwidth_gb_per_s": round(bandwidth, 2),
            "products_ms": {m: round(us / 1e3, 2) for m, us in step_us.items()},
            "products_gb_per_s": round(step_bytes / step_us[1] / 1e3, 2),
            "llama_bench_tg": None if tg is None else round(tg, 2),
            "delspec_ar_decode": None if ar is None else round(ar, 2),
            # llama.cpp's weights per token read at its tg rate (the file's tensor bytes)
            "llama_gb_per_s": None if tg is None else round(path.stat().st_size * tg / 1e9, 2),
        }
        print(json.dumps({"shape": shape, "threads": threads, **steps[threads]}), flush=True)
    return {
        "shape": shape,
        "file": str(path),
        "step_bytes": step_bytes,
        "rows": rows,
        "steps": steps,
    }


def synthetic_table(reports: list[dict], context: dict) -> str:
    """The Markdown report of `--synthetic` runs."""
    lines = [
        "# GGUF block products at the memory limit: synthetic model shapes",
        "",
        f"CPU: {context['cpu']}; SIMD: {context['simd_name']}; llama-bench: "
        f"{context['llama_bench'] or 'none'} ({context['llama_build'] or 'build unknown'}); "
        f"{context['date']}.",
        "",
        "Per product kind, every layer's product timed in turn (weights streaming from memory), "
        "median of repeated sweeps. GB/s is the weight bytes read per second; % bw is that over "
        "the streaming read bandwidth measured at the same thread count (the fastest of sums and "
        "maxima of a 1 GiB float32 tensor). One row is timed alone and twinned (run as two rows, "
        "the row and its copy, as decoding does where the machine measured that faster: "
        "`dl_set_twin_row`); M/M1 and the step's M=1 take the faster of the two. The step line "
        "adds every product of one token (M rows); llama.cpp's line is llama-bench's tg128 on "
        "the same synthetic GGUF file, as weights read per second (file bytes x tokens/s).",
        "",
    ]
    for report in reports:
        megabytes = report["step_bytes"] / 1e6
        lines += [f"## {report['shape']} ({megabytes:.0f} MB of products a step)", ""]
        lines += ["| threads | product | type | rows x cols | M | us | GB/s | % bw | M/M1 |"]
        lines += ["|---|---|---|---|---|---|---|---|---|"]
        for r in report["rows"]:
            lines.append(
                f"| {r['threads']} | {r['product']} | {r['type']} | {r['rows']}x{r['cols']} "
                f"| {r['M']} | {r['us']:.0f} | {r['weight_gb_per_s']:.1f} "
                f"| {r['share_of_bandwidth']:.0%} | {r['m_over_m1']:.2f} |"
            )
        header = (
            "| threads | read GB/s | products ms a step, M=1 / 2 / 4 / 8 | products GB/s (% bw) "
            "| llama.cpp tg128 tok/s | llama.cpp GB/s (% bw) | products' tok/s bound / llama.cpp "
            "| delspec `ar` decode tok/s | `ar` / llama.cpp |"
        )
        lines += ["", header, "|---" * 9 + "|"]
        for threads, step in report["steps"].items():
            bw, ms = step["bandwidth_gb_per_s"], step["products_ms"]
            tg, lgb = step["llama_bench_tg"], step["llama_gb_per_s"]
            ar = step["delspec_ar_decode"]
            bound = 1e3 / ms[1] if ms[1] else 0.0
            lines.append(
                f"| {threads} | {bw:.1f} | {' / '.join(f'{v:.1f}' for v in ms.values())} "
                f"| {step['products_gb_per_s']:.1f} ({step['products_gb_per_s'] / bw:.0%}) "
                f"| {tg if tg is not None else '-'} "
                f"| {f'{lgb:.1f} ({lgb / bw:.0%})' if lgb is not None else '-'} "
                f"| {f'{bound / tg:.2f}x' if tg else '-'} "
                f"| {ar if ar is not None else '-'} | {f'{ar / tg:.2f}x' if tg and ar else '-'} |"
            )
        lines.append("")
    return "\n".join(lines)


def llama_build(binary: str | None) -> str | None:
    """The instruction-set options llama-bench was built with (the GGML_* CPU options its CMake
    cache turned on, e.g. "AVX2 AVX512 AVX512_VNNI"), or None where that cache is not beside it."""
    if binary is None:
        return None
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    try:
        text = cache.read_text()
    except OSError:
        return None
    options = re.findall(r"^GGML_(NATIVE|AVX\w*|FMA|F16C|AMX\w*|BMI2):BOOL=ON$", text, re.M)
    return " ".join(options) or "no x86 extensions"


def main_synthetic(args: argparse.Namespace) -> None:
    lib = library()
    if lib is None:
        sys.exit("the compiled GGUF kernels are unavailable here (see the notice above)")
    binary = args.llama_bench or shutil.which("llama-bench")
    context = {
        "cpu": cpu_name(),
        "simd_name": SIMD_NAMES.get(lib.dl_simd_level(), "unknown"),
        "llama_bench": binary,
        "llama_build": llama_build(binary),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    reports = []
    with torch.inference_mode():
        for shape in args.synthetic.split(","):
            reports.append(bench_synthetic(shape, args.repeats or 7, binary))
            gc.collect()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({**context, "reports": reports}, indent=1))
    report = synthetic_table(reports, context)
    (args.out / "table.md").write_text(report + "\n")
    print(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", metavar="SHAPE[,SHAPE]", help="large_model.py's shapes")
    parser.add_argument("--llama-bench", help="llama-bench built for this CPU (--synthetic)")
    parser.add_argument("--quick", action="store_true", help="LM heads + largest layers, M=1, 8")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernels")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="timings per median (default 15, quick 5)")
    args = parser.parse_args()
    if args.synthetic:
        main_synthetic(args)
        return
    repeats = args.repeats or (5 if args.quick else 15)
    ms = QUICK_M if args.quick else FULL_M
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lib = library()
    if lib is None:
        sys.exit("the compiled GGUF kernels are unavailable here (see the notice above)")
    context = {
        "bandwidth_gb_per_s": round(read_bandwidth(), 2),
        "cpu": cpu_name(),
        "threads": args.threads,
        "simd": lib.dl_simd_level(),
    }
    context["simd_name"] = SIMD_NAMES.get(context["simd"], "unknown")
    print(f"read bandwidth {context['bandwidth_gb_per_s']} GB/s", file=sys.stderr, flush=True)
    rows: list[dict] = []
    with torch.inference_mode():
        for name in MODELS:
            groups = sorted(model_groups(name), key=order)
            for group in groups:
                if args.quick and group.role == "layer":
                    continue
                print(
                    f"{group.model} {group.qtype.name} {group.rows}x{group.cols} "
                    f"x{len(group.weights)}",
                    file=sys.stderr,
                    flush=True,
                )
                rows += bench_group(group, ms, repeats, context)
                gc.collect()
            del groups
            gc.collect()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    report = table(rows, context, repeats, args.quick)
    (args.out / "table.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
