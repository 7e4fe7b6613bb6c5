"""``PrometheusStatLogger``: what ``record`` and the snapshot collector expose, read back
through prometheus_client's text exposition and parser (no engine, no GPU)."""

from __future__ import annotations

import threading

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from manylora.engine.stats import EngineSnapshot, FinishedRequestStats, IterationStats
from manylora.lora.cache_report import LoRACacheStats
from manylora.metrics import METRICS, PrometheusStatLogger, vllm_names
from manylora.metrics import catalog as pm
from manylora.scheduler.kv_cache_manager import KVCacheStats

MODEL = "llama-test"
NOW = 1_700_000_000.5

KV = KVCacheStats(num_blocks=40, used_blocks=10, cached_blocks=12, free_blocks=18,
                  prefix_queries=400, prefix_hits=100, preemptions=3, recomputed_tokens=77,
                  swapped_out_blocks=6, swapped_in_blocks=4, evicted_blocks=9,
                  evicted_sessions=2)
LORA = LoRACacheStats(host_hits=11, host_misses=5, host_evictions=2, host_load_seconds=1.5,
                      sync_disk_loads=1, device_hits=30, device_misses=7, device_evictions=4,
                      device_load_seconds=0.25, device_load_bytes=123456,
                      host_load_bytes=654321, host_load_failures=2, adapter_waits=6,
                      adapter_wait_seconds=0.75)
SNAP = EngineSnapshot(num_running=3, num_waiting=5, max_loras=4,
                      running_lora_adapters=("alpha", "beta"), waiting_lora_adapters=("gamma",),
                      kv=KV, lora=LORA)


def scrape(registry: prometheus_client.CollectorRegistry) -> dict[tuple, float]:
    """{(sample name, frozenset of labels): value} of one scrape, via the text format."""
    text = prometheus_client.generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, key
            samples[key] = s.value
    return samples


def labels(**kw) -> frozenset:
    return frozenset({"model_name": MODEL, **kw}.items())


def make_logger(snap: EngineSnapshot = SNAP, model_name: str = MODEL, **kw):
    registry = prometheus_client.CollectorRegistry()
    holder = {"snap": snap, "calls": 0}

    def snapshot() -> EngineSnapshot:
        holder["calls"] += 1
        return holder["snap"]

    logger = PrometheusStatLogger(registry, model_name, snapshot, clock=lambda: NOW, **kw)
    return registry, logger, holder


STEP1 = IterationStats(
    num_prompt_tokens=30, num_generation_tokens=4,
    time_to_first_tokens=[0.003, 0.07], inter_token_latencies=[0.004, 0.02, 0.3],
    finished=[FinishedRequestStats("stop", 0.4, 12, 3, "alpha", first_token_latency=0.003),
              FinishedRequestStats("abort", 2.2, 18, 1, None)])
STEP2 = IterationStats(
    num_prompt_tokens=0, num_generation_tokens=6,
    time_to_first_tokens=[], inter_token_latencies=[0.006] * 6,
    finished=[FinishedRequestStats("length", 12.0, 150, 64, "beta"),
              FinishedRequestStats("stop", 0.9, 7, 1, None)])


def test_record_counters_and_histograms():
    registry, logger, _ = make_logger(max_model_len=1000)
    logger.record(STEP1)
    logger.record(STEP2)
    logger.record(IterationStats())
    s = scrape(registry)
    m = labels()

    assert s[(pm.PROMPT_TOKENS + "_total", m)] == 30
    assert s[(pm.GENERATION_TOKENS + "_total", m)] == 10
    success = {dict(k[1])["finished_reason"]: v for k, v in s.items()
               if k[0] == pm.REQUEST_SUCCESS + "_total"}
    assert success == {"stop": 2, "length": 1, "abort": 1, "error": 0}

    ttft = pm.TIME_TO_FIRST_TOKEN
    assert s[(ttft + "_count", m)] == 2
    assert s[(ttft + "_sum", m)] == pytest.approx(0.073)
    assert s[(ttft + "_bucket", labels(le="0.001"))] == 0
    assert s[(ttft + "_bucket", labels(le="0.005"))] == 1
    assert s[(ttft + "_bucket", labels(le="0.08"))] == 2
    assert s[(ttft + "_bucket", labels(le="+Inf"))] == 2

    itl = pm.INTER_TOKEN_LATENCY
    assert s[(itl + "_count", m)] == 9
    assert s[(itl + "_sum", m)] == pytest.approx(0.004 + 0.02 + 0.3 + 6 * 0.006)
    assert s[(itl + "_bucket", labels(le="0.005"))] == 1
    assert s[(itl + "_bucket", labels(le="0.0075"))] == 7
    assert s[(itl + "_bucket", labels(le="0.025"))] == 8
    assert s[(itl + "_bucket", labels(le="0.3"))] == 9

    e2e = pm.E2E_REQUEST_LATENCY
    assert s[(e2e + "_count", m)] == 4
    assert s[(e2e + "_sum", m)] == pytest.approx(0.4 + 2.2 + 12.0 + 0.9)
    assert s[(e2e + "_bucket", labels(le="0.3"))] == 0
    assert s[(e2e + "_bucket", labels(le="0.5"))] == 1
    assert s[(e2e + "_bucket", labels(le="1.0"))] == 2
    assert s[(e2e + "_bucket", labels(le="2.5"))] == 3
    assert s[(e2e + "_bucket", labels(le="15.0"))] == 4

    rpt = pm.REQUEST_PROMPT_TOKENS
    assert s[(rpt + "_count", m)] == 4
    assert s[(rpt + "_sum", m)] == 12 + 18 + 150 + 7
    assert s[(rpt + "_bucket", labels(le="10.0"))] == 1
    assert s[(rpt + "_bucket", labels(le="20.0"))] == 3
    assert s[(rpt + "_bucket", labels(le="200.0"))] == 4
    rgt = pm.REQUEST_GENERATION_TOKENS
    assert s[(rgt + "_count", m)] == 4
    assert s[(rgt + "_sum", m)] == 3 + 1 + 64 + 1
    assert s[(rgt + "_bucket", labels(le="1.0"))] == 2
    assert s[(rgt + "_bucket", labels(le="5.0"))] == 3
    assert s[(rgt + "_bucket", labels(le="100.0"))] == 4
    # 1-2-5 ladder up to max_model_len, then +Inf.
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == rpt + "_bucket")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, float("inf")]


def test_series_exist_before_any_request():
    registry, _, _ = make_logger()
    s = scrape(registry)
    assert s[(pm.PROMPT_TOKENS + "_total", labels())] == 0
    assert s[(pm.E2E_REQUEST_LATENCY + "_count", labels())] == 0
    for reason in ("stop", "length", "abort", "error"):
        assert s[(pm.REQUEST_SUCCESS + "_total", labels(finished_reason=reason))] == 0


def test_unknown_finish_reason_gets_its_own_series():
    registry, logger, _ = make_logger()
    logger.record(IterationStats(finished=[FinishedRequestStats("timeout", 1.0, 1, 1)] * 2))
    s = scrape(registry)
    assert s[(pm.REQUEST_SUCCESS + "_total", labels(finished_reason="timeout"))] == 2


def test_snapshot_metrics():
    registry, _, _ = make_logger()
    s = scrape(registry)
    m = labels()
    assert s[(pm.NUM_REQUESTS_RUNNING, m)] == 3
    assert s[(pm.NUM_REQUESTS_WAITING, m)] == 5
    assert s[(pm.KV_CACHE_USAGE_PERC, m)] == pytest.approx(10 / 40)
    assert s[(pm.KV_CACHE_BLOCKS, labels(state="used"))] == 10
    assert s[(pm.KV_CACHE_BLOCKS, labels(state="cached"))] == 12
    assert s[(pm.KV_CACHE_BLOCKS, labels(state="free"))] == 18
    assert s[(pm.PREFIX_CACHE_QUERIES + "_total", m)] == 400
    assert s[(pm.PREFIX_CACHE_HITS + "_total", m)] == 100
    assert s[(pm.PREFIX_CACHE_HIT_RATE, m)] == pytest.approx(0.25)
    assert s[(pm.NUM_PREEMPTIONS + "_total", m)] == 3
    assert s[(pm.KV_RECOMPUTED_TOKENS + "_total", m)] == 77
    assert s[(pm.KV_SWAPPED_BLOCKS + "_total", labels(direction="out"))] == 6
    assert s[(pm.KV_SWAPPED_BLOCKS + "_total", labels(direction="in"))] == 4
    assert s[(pm.KV_EVICTED_BLOCKS + "_total", m)] == 9

    tiers = {
        pm.LORA_CACHE_HITS: (11, 30), pm.LORA_CACHE_MISSES: (5, 7), pm.LORA_LOADS: (5, 7),
        pm.LORA_EVICTIONS: (2, 4), pm.LORA_LOAD_SECONDS: (1.5, 0.25)}
    for name, (host, device) in tiers.items():
        got = {dict(k[1])["tier"]: v for k, v in s.items() if k[0] == name + "_total"}
        assert got == {"host": host, "device": device}, name
        assert all(dict(k[1])["model_name"] == MODEL for k in s if k[0] == name + "_total")
    assert s[(pm.LORA_SYNC_DISK_LOADS + "_total", m)] == 1
    assert s[(pm.LORA_DEVICE_LOAD_BYTES + "_total", m)] == 123456
    assert s[(pm.LORA_HOST_LOAD_BYTES + "_total", m)] == 654321
    assert s[(pm.LORA_LOAD_FAILURES + "_total", m)] == 2
    assert s[(pm.LORA_ADAPTER_WAITS + "_total", m)] == 6
    assert s[(pm.LORA_ADAPTER_WAIT_SECONDS + "_total", m)] == 0.75


def test_lora_requests_info_matches_vllm_label_set():
    registry, _, _ = make_logger()
    s = scrape(registry)
    info = [(dict(k[1]), v) for k, v in s.items() if k[0] == pm.LORA_REQUESTS_INFO]
    assert info == [({"max_lora": "4", "running_lora_adapters": "alpha,beta",
                      "waiting_lora_adapters": "gamma"}, NOW)]


def test_empty_engine_state():
    registry, _, _ = make_logger(snap=EngineSnapshot())
    s = scrape(registry)
    assert s[(pm.KV_CACHE_USAGE_PERC, labels())] == 0
    assert s[(pm.PREFIX_CACHE_HIT_RATE, labels())] == 0
    assert s[(pm.LORA_REQUESTS_INFO, frozenset({"max_lora": "0", "running_lora_adapters": "",
                                                "waiting_lora_adapters": ""}.items()))] == NOW


def test_snapshot_read_on_every_scrape_only():
    registry, logger, holder = make_logger()
    assert holder["calls"] == 0          # registering does not call it (describe)
    logger.record(STEP1)
    assert holder["calls"] == 0
    assert scrape(registry)[(pm.NUM_REQUESTS_RUNNING, labels())] == 3
    holder["snap"] = EngineSnapshot(num_running=8, kv=KVCacheStats(num_blocks=4, used_blocks=4))
    s = scrape(registry)
    assert holder["calls"] == 2
    assert s[(pm.NUM_REQUESTS_RUNNING, labels())] == 8
    assert s[(pm.KV_CACHE_USAGE_PERC, labels())] == 1.0


def test_every_metric_exposed_with_its_names_and_labels():
    registry, logger, _ = make_logger()
    logger.record(STEP1)
    text = prometheus_client.generate_latest(registry).decode()
    assert "_total_total" not in text
    s = scrape(registry)
    names = {k[0] for k in s}
    label_names = {}
    for name, lab in s:
        label_names.setdefault(name, set()).update(k for k, _ in lab)
    assert {"vllm:e2e_request_latency_seconds_sum", "vllm:request_success_total",
            "vllm:lora_requests_info"} <= names
    for spec in METRICS.values():
        assert spec.name.startswith("manylora:")
        for sample in spec.sample_names:
            assert sample in names, sample
            expected = set(spec.labels) | ({"le"} if sample.endswith("_bucket") else set())
            assert label_names[sample] == expected, sample
        if spec.kind == "counter":
            assert spec.name + "_total" in names and spec.name not in names
        if spec.name == pm.LORA_REQUESTS_INFO:
            assert "model_name" not in spec.labels
        else:
            assert spec.labels[0] == "model_name"
    # vLLM's names: its labels (engine "0"), samples of the same kind as ours.
    for alias in vllm_names.VLLM_METRICS.values():
        spec = METRICS[alias.source]
        assert alias.name.startswith("vllm:")
        for suffix in (".", "_total", "_bucket", "_count", "_sum"):
            ours = spec.name + suffix if suffix != "." else spec.name
            if ours in names:
                sample = ours.replace(spec.name, alias.name, 1)
                expected = set(alias.labels) | ({"le"} if suffix == "_bucket" else set())
                assert label_names[sample] == expected, sample
    # Nothing exposed that the tables do not list (prometheus_client's _created aside).
    listed = {n for spec in METRICS.values() for n in spec.sample_names}
    listed |= {n.replace(METRICS[a.source].name, a.name, 1)
               for a in vllm_names.VLLM_METRICS.values() for n in METRICS[a.source].sample_names}
    assert {n for n in names if not n.endswith("_created")} == listed
    # The modules' docstrings list every metric: ours in the catalog's table, vLLM's names.
    for name in METRICS:
        assert f"``{name}``" in pm.__doc__
    for name in vllm_names.VLLM_METRICS:
        assert f"``{name}``" in vllm_names.__doc__


def test_two_registries_do_not_clash():
    reg_a, log_a, _ = make_logger(model_name="a")
    reg_b, log_b, _ = make_logger(model_name="b", snap=EngineSnapshot(num_running=1))
    log_a.record(STEP1)
    log_b.record(STEP2)
    sa, sb = scrape(reg_a), scrape(reg_b)
    assert sa[(pm.PROMPT_TOKENS + "_total", frozenset({"model_name": "a"}.items()))] == 30
    assert sb[(pm.PROMPT_TOKENS + "_total", frozenset({"model_name": "b"}.items()))] == 0
    assert sb[(pm.GENERATION_TOKENS + "_total", frozenset({"model_name": "b"}.items()))] == 6
    assert sa[(pm.NUM_REQUESTS_RUNNING, frozenset({"model_name": "a"}.items()))] == 3
    assert sb[(pm.NUM_REQUESTS_RUNNING, frozenset({"model_name": "b"}.items()))] == 1
    assert all(dict(k[1]).get("model_name", "a") == "a" for k in sa)
    # Nothing went into the process-wide default registry.
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "manylora:" not in default


def test_same_registry_twice_raises_and_unregister_frees_it():
    registry, logger, _ = make_logger()
    before = prometheus_client.generate_latest(registry)
    with pytest.raises(ValueError):
        PrometheusStatLogger(registry, "other", lambda: SNAP)
    assert prometheus_client.generate_latest(registry) == before    # left as it was
    logger.unregister()
    logger.unregister()
    assert prometheus_client.generate_latest(registry) == b""
    again = PrometheusStatLogger(registry, MODEL, lambda: SNAP)
    again.record(STEP2)
    assert scrape(registry)[(pm.GENERATION_TOKENS + "_total", labels())] == 6


def test_failed_registration_leaves_nothing_behind():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter(pm.GENERATION_TOKENS, "taken", registry=registry)
    before = prometheus_client.generate_latest(registry)
    with pytest.raises(ValueError):
        PrometheusStatLogger(registry, MODEL, lambda: SNAP)
    assert prometheus_client.generate_latest(registry) == before


def test_record_concurrent_with_scrapes():
    registry, logger, _ = make_logger()
    step = IterationStats(num_prompt_tokens=2, num_generation_tokens=1,
                          inter_token_latencies=[0.01],
                          finished=[FinishedRequestStats("stop", 1.0, 2, 1)])
    stop = threading.Event()

    def scraper():
        while not stop.is_set():
            scrape(registry)

    def recorder():
        for _ in range(500):
            logger.record(step)

    threads = [threading.Thread(target=recorder) for _ in range(4)]
    reader = threading.Thread(target=scraper)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    s = scrape(registry)
    assert s[(pm.PROMPT_TOKENS + "_total", labels())] == 4000
    assert s[(pm.INTER_TOKEN_LATENCY + "_count", labels())] == 2000
    assert s[(pm.REQUEST_SUCCESS + "_total", labels(finished_reason="stop"))] == 2000


def test_build_1_2_5_buckets():
    assert pm.build_1_2_5_buckets(1) == (1,)
    assert pm.build_1_2_5_buckets(4) == (1, 2)
    assert pm.build_1_2_5_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    with pytest.raises(ValueError):
        pm.build_1_2_5_buckets(0)
    with pytest.raises(ValueError):
        make_logger(max_model_len=0)


def test_negative_token_count_raises():
    _, logger, _ = make_logger()
    with pytest.raises(ValueError):
        logger.record(IterationStats(num_prompt_tokens=-1))


def test_name_sets_expose_one_or_both():
    for names in (("vllm",), ("manylora",)):
        registry, logger, _ = make_logger(names=names)
        logger.record(STEP1)
        prefixes = {k[0].split(":")[0] for k in scrape(registry)}
        assert prefixes == set(names)
    for bad in ((), ("prometheus",)):
        with pytest.raises(ValueError, match="names"):
            make_logger(names=bad)


def test_vllm_names_labels_and_buckets():
    """vLLM's labels (``engine="0"``) and its own buckets where ours differ."""
    registry, logger, _ = make_logger(max_model_len=1000)
    logger.record(STEP1)
    s = scrape(registry)
    vllm = frozenset({"model_name": MODEL, "engine": "0"}.items())
    les = {float(dict(k[1])["le"]) for k in s
           if k[0] == "vllm:time_per_output_token_seconds_bucket"}
    assert les == {*pm.VLLM_TPOT_BUCKETS, float("inf")}
    assert s[("vllm:time_per_output_token_seconds_count", vllm)] == 3
    assert s[("vllm:inter_token_latency_seconds_count", vllm)] == 3
    assert s[("vllm:request_success_total", vllm | {("finished_reason", "abort")})] == 1
    assert s[("vllm:gpu_cache_usage_perc", vllm)] == s[("vllm:kv_cache_usage_perc", vllm)]
    assert s[("vllm:gpu_cache_usage_perc", vllm)] == pytest.approx(10 / 40)
    info = frozenset({"max_lora": "4", "running_lora_adapters": "alpha,beta",
                      "waiting_lora_adapters": "gamma"}.items())
    assert s[("vllm:lora_requests_info", info)] == NOW


def test_lora_label_bound_folds_later_adapters_into_other():
    registry, logger, _ = make_logger(max_lora_labels=2)
    logger.record(IterationStats(finished=[
        FinishedRequestStats("stop", 0.1, 4, 2, name, first_token_latency=0.01)
        for name in ("a", "b", "c", "d", "a")]))
    s = scrape(registry)
    counts = {dict(k[1])["lora_name"]: v for k, v in s.items()
              if k[0] == "manylora:lora_prompt_tokens_total"}
    assert counts == {"a": 8, "b": 4, "other": 8}
    with pytest.raises(ValueError, match="max_lora_labels"):
        make_logger(max_lora_labels=-1)


def test_metrics_flags_parse():
    from manylora.entrypoints.openai.serve_args import serve_parser
    args = serve_parser().parse_args(["--model", "m"])
    assert args.metrics_names == ("manylora", "vllm") and args.max_lora_metric_labels == 100
    args = serve_parser().parse_args(["--model", "m", "--metrics-names", "vllm",
                                      "--max-lora-metric-labels", "0"])
    assert args.metrics_names == ("vllm",) and args.max_lora_metric_labels == 0
    for bad in (["--metrics-names", "vllm,foo"], ["--metrics-names", ""],
                ["--max-lora-metric-labels", "-1"]):
        with pytest.raises(SystemExit):
            serve_parser().parse_args(["--model", "m", *bad])
