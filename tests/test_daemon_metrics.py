"""Prometheus metrics, as vLLM exports them: the `metrics` op answers the text format, which
Prometheus' own parser reads; request histograms and token counters move with each finished
request, gauges tell what runs and what the KV pool holds, and decode steps record their
batch size."""

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from test_daemon import PROMPT, serving

from rocforge_client import connect
from rocforge_rt.profiling.latency import RequestRecord
from rocforge_rt.server.metrics import PREFIX, DaemonMetrics


def parsed(text: str) -> dict[str, float]:
    """Every sample of the exposition by name and labels, e.g. 'x_bucket{le="0.5"}'."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_finished_requests_move_the_histograms_and_token_counters(tiny_model: Path) -> None:
    with serving(tiny_model, max_new_tokens=8) as daemon, connect(daemon.endpoint) as client:
        before = parsed(client.metrics())
        for _ in range(2):
            list(client.generate(tokens=PROMPT, max_tokens=4))
        after = parsed(client.metrics())
    name = PREFIX + "{}"
    assert after[name.format("time_to_first_token_seconds_count")] == 2
    assert before.get(name.format("time_to_first_token_seconds_count"), 0) == 0
    assert after[name.format("e2e_request_latency_seconds_count")] == 2
    assert after[name.format("inter_token_latency_seconds_count")] == 2 * 3  # 4 tokens, 3 gaps
    assert after[name.format("prompt_tokens_total")] == 2 * len(PROMPT)
    assert after[name.format("generation_tokens_total")] == 2 * 4
    assert after[name.format('request_success_total{finished_reason="length"}')] == 2
    # every decode step of the two generations gave one session a token
    assert after[name.format('decode_batch_size_bucket{le="1.0"}')] == after[
        name.format("decode_batch_size_count")] >= 2 * 3  # fmt: skip


def test_gauges_tell_what_runs_and_what_the_kv_pool_holds(tiny_model: Path) -> None:
    with serving(tiny_model) as daemon, connect(daemon.endpoint) as client:
        idle = parsed(client.metrics())
        opened = client.open(tokens=PROMPT, max_tokens=4)
        holding = parsed(client.metrics())
        client.close(opened.session)
    assert idle[PREFIX + "num_requests_running"] == 0
    assert idle[PREFIX + "num_requests_waiting"] == 0
    assert idle[PREFIX + "kv_cache_usage_perc"] == 0
    assert 0 < holding[PREFIX + "kv_cache_usage_perc"] < 1  # the session's tokens are cached
    assert holding[PREFIX + "kv_cache_slots_in_use"] == 1
    assert PREFIX + "launches_per_step" not in holding  # the CPU backend launches nothing


def test_backend_counters_are_exported_where_the_backend_has_them() -> None:
    runtime = {"launches_per_step": 1.0, "kernels_per_step": 153.0, "graph_replays": 7,
               "arg_cache_hits": 900, "arg_cache_misses": 12}  # fmt: skip
    metrics = DaemonMetrics(usage=dict, runtime=lambda: runtime, waiting=lambda: 3)
    metrics.observe_request(
        RequestRecord("generate", 5, 2, ttft_ms=12.0, itl_ms_mean=1.5, e2e_ms=14.0,
                      finish_reason=None), [0.0015])  # fmt: skip
    samples = parsed(metrics.exposition().decode())
    assert samples[PREFIX + "launches_per_step"] == 1.0
    assert samples[PREFIX + "kernels_per_step"] == 153.0
    assert samples[PREFIX + "graph_replays_total"] == 7
    assert samples[PREFIX + "arg_cache_hits_total"] == 900
    assert samples[PREFIX + "arg_cache_misses_total"] == 12
    assert samples[PREFIX + "num_requests_waiting"] == 3
    assert samples[PREFIX + 'request_success_total{finished_reason="none"}'] == 1
    assert samples[PREFIX + 'time_to_first_token_seconds_bucket{le="0.02"}'] == 1
    assert samples[PREFIX + 'time_to_first_token_seconds_bucket{le="0.01"}'] == 0


def test_requests_that_wait_for_a_slot_are_counted_waiting_then_timed_in_the_queue(
    tiny_model: Path,
) -> None:
    with (
        serving(tiny_model, max_sessions=1) as daemon,
        connect(daemon.endpoint) as client,
        connect(daemon.endpoint) as waiter,
    ):
        held = client.open(tokens=PROMPT, max_tokens=4)
        rid = waiter.send("generate", tokens=PROMPT, max_tokens=2)  # waits for the one slot
        limit = time.monotonic() + 10
        while parsed(client.metrics())[PREFIX + "num_requests_waiting"] != 1:
            assert time.monotonic() < limit, "the second request never waited"
            time.sleep(0.01)
        client.close(held.session)
        while not waiter.receive(rid, timeout=10)["done"]:
            pass
        samples = parsed(client.metrics())
    assert samples[PREFIX + "num_requests_waiting"] == 0
    assert samples[PREFIX + "request_queue_time_seconds_count"] == 2  # the open and the waiter
    assert samples[PREFIX + "request_queue_time_seconds_sum"] > 0
