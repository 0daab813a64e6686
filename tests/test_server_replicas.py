"""Scale-out on Ray Serve: two replicas of the server (a process, a model and one thread each)
behind one API answer exactly as the model does alone, and /metrics covers both (then, one
killed, the one left)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import CHAT, TEXT, TIMEOUT, answer
from prometheus_client import generate_latest
from prometheus_client.core import Metric

from delspec.cli import main
from delspec.decoding.generate import generate
from delspec.errors import ConfigError
from delspec.server.metrics import MergedMetrics, Metrics
from delspec.server.replicas import ReplicaSpec, replicas_serving
from delspec.weights.loading import LoadedModel

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "1, 2, 3,"]


def samples(metrics: str) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in (line.rsplit(" ", 1) for line in metrics.splitlines() if line[0] != "#")
    }


def merged(replicas: list[list[Metric]]) -> dict[str, float]:
    """The samples of `MergedMetrics`, as /metrics renders them."""
    return samples(generate_latest(MergedMetrics(replicas)).decode())


def test_two_replicas_answer_as_the_model_and_metrics_cover_both(smollm2: LoadedModel) -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is the delspec[ray] extra")
    import ray
    from ray import serve

    requests = [
        (TEXT, {"prompt": p, "max_tokens": 8, "temperature": 0, "stream": i % 2 == 0})
        for i, p in enumerate(PROMPTS)
    ]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    requests.append((CHAT, chat))
    spec = ReplicaSpec("default", threads=1, app_options={"max_batch": 2, "max_queue": 8})
    with replicas_serving(spec, 2) as url, ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: answer(url, *r)[0], requests))
        named = httpx.post(
            url + TEXT, json={"model": "default", "prompt": "Hi", "max_tokens": 1}, timeout=TIMEOUT
        )
        scraped = [samples(httpx.get(url + "/metrics", timeout=TIMEOUT).text) for _ in range(4)]
        handle = serve.get_deployment_handle("Replica", "delspec")
        parts = handle.broadcast("local_metrics").results()
        # a replica killed: /metrics still answers, for the one left (Serve restarts the other
        # only after loading its model, seconds later)
        name = next(a["name"] for a in ray.util.list_named_actors(True) if "#Replica#" in a["name"])
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        after = httpx.get(url + "/metrics", timeout=TIMEOUT)
        left = handle.broadcast("local_metrics").results(return_exceptions=True)
    expected = [
        generate(smollm2, b.get("prompt") or b["messages"], strategy="ar", max_new_tokens=8).text
        for _, b in requests
    ]
    assert got == expected
    assert named.status_code == 200  # the model named as it was started
    assert len(parts) == 2
    texts = sum(path == TEXT for path, _ in requests) + 1  # and the one naming the model
    served = 'delspec_requests_total{endpoint="/v1/completions",status="200"}'
    # whichever replica answers /metrics, it counts the requests of both
    for metrics in scraped:
        assert metrics["delspec_replicas"] == 2
        assert metrics[served] == texts
        assert metrics["delspec_time_to_first_token_seconds_count"] >= len(requests)
    each = [merged([part]) for part in parts]
    assert sum(part.get(served, 0) for part in each) == texts
    # the last scrape, taken when all was done: counters and histograms are the replicas' sums,
    # `busy` their maximum, the last speed their mean (only /metrics' own count moved since)
    last = scraped[-1]
    summed = [k for k in last if k.split("{")[0].endswith(("_total", "_bucket", "_count", "_sum"))]
    assert len(summed) > 20
    for key in (key for key in summed if "/metrics" not in key):
        assert last[key] == pytest.approx(sum(part.get(key, 0) for part in each)), key
    assert last["delspec_busy"] == 0 and last["delspec_queue_depth"] == 0
    speeds = [part["delspec_tokens_per_second"] for part in each]
    assert last["delspec_tokens_per_second"] == pytest.approx(sum(speeds) / 2)
    survivor = [part for part in left if not isinstance(part, BaseException)]
    assert after.status_code == 200 and len(survivor) == 1
    assert samples(after.text)["delspec_replicas"] == 1
    assert samples(after.text).get(served, 0) == merged(survivor).get(served, 0)


def test_merged_metrics_sum_counts_and_queues_average_last_speeds_and_max_busy() -> None:
    replicas = []
    for requests, speed, active in ((1, 10.0, 1), (2, 30.0, 0)):
        metrics = Metrics(4)
        for _ in range(requests):
            metrics.count_request(TEXT, 200)
        metrics.observe_batch(2)
        metrics.tokens_per_s.set(speed)
        replicas.append(list(metrics.current(queue_depth=1, active=active).collect()))
    got = merged(replicas)
    served = f'delspec_requests_total{{endpoint="{TEXT}",status="200"}}'
    created = served.replace("_total", "_created")
    assert got["delspec_replicas"] == 2
    assert got[served] == 3 and got["delspec_queue_depth"] == 2 and got["delspec_active"] == 1
    assert got['delspec_batch_size_bucket{le="2.0"}'] == 2
    assert got["delspec_batch_size_count"] == 2 and got["delspec_batch_size_sum"] == 4
    assert got["delspec_tokens_per_second"] == 20 and got["delspec_busy"] == 1
    assert got[created] == min(merged([part])[created] for part in replicas)
    text = generate_latest(MergedMetrics(replicas)).decode()
    assert text.count("# TYPE delspec_busy gauge") == 1
    assert text.count("# TYPE delspec_batch_size histogram") == 1


def test_merged_metrics_of_no_replica_say_so() -> None:
    assert merged([]) == {"delspec_replicas": 0}


def test_replicas_without_ray_say_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    refused = pytest.raises(ConfigError, match=r"pip install 'delspec\[ray\]'")
    with refused, replicas_serving(ReplicaSpec("default"), 2):
        pass


def test_bad_replica_settings_are_refused_in_one_line(capsys) -> None:
    # (--replicas 0 is refused as the command line is parsed: test_cli)
    assert main(["serve", "--replicas", "2", "--model", "/no/such.gguf"]) == 2  # before Ray
    assert "does not exist" in capsys.readouterr().err


def test_an_unreachable_ray_cluster_is_refused_at_once(capsys) -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is the delspec[ray] extra")
    assert main(["serve", "--replicas", "1", "--ray-address", "127.0.0.1:1"]) == 2
    assert "no Ray cluster answers at 127.0.0.1:1" in capsys.readouterr().err
