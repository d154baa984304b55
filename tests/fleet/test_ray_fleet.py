"""A real fleet: two kvpage replicas on Ray Serve (a local Ray cluster started here, 127.0.0.1 only),
routed by their KV events, sharing a KV tier on a real redis-server, talked to with the official openai
client; then failures: the index actor killed (events lost: replicas resync), a replica killed
mid-request (only its requests fail, and what it computed is still served from the shared tier)."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")

from kvpage.fleet.index_actor import KVIndexActor, index_actor  # noqa: E402
from kvpage.fleet.ray_app import Fleet, FleetSpec  # noqa: E402
from kvpage.fleet.ray_routing import ROUTERS, router_config  # noqa: E402
from kvpage.fleet.replica import KVReplica  # noqa: E402

ENGINE = dict(dtype="float32", num_kv_blocks=256, max_model_len=1024)  # as the one-server fixture


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(one_ray_cluster_at_a_time, redis_server):
    engine = {**ENGINE, "remote_kv": redis_server.url}
    f = Fleet(FleetSpec(engine, replicas=2, router="kv", port=_free_port(),
                        app_kwargs={"served_model_name": "smollm2"}), num_cpus=2)  # fmt: skip
    try:
        wait_for(lambda: len(trusted(f)) == 2, 120, "both replicas heard by the index")
        yield f
    finally:
        f.stop()


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
        except Exception:  # noqa: BLE001 - e.g. the index restarting
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {what}")


def trusted(f) -> list[str]:
    return sorted(r for r, v in f.stats()["replicas"].items() if v["trusted"])


def scrape(f) -> dict[str, float]:
    text = httpx.get(f.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()) if k != 'model_name')}}}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def settled_scrape(f) -> dict[str, float]:
    """A scrape once the replicas' counters stop moving: a replica reports its metrics between its steps,
    at the latest a heartbeat (1 s) after its last one, so an earlier test's last requests can still
    be on their way in."""
    last = scrape(f)
    for _ in range(10):
        time.sleep(1.5)
        now = scrape(f)
        if all(now.get(k) == v for k, v in last.items() if k.startswith("kvpage:prefix_cache_queries_total")):
            return now
        last = now
    raise AssertionError("the replicas' metrics never settled")


def index_blocks(f) -> dict[str, int]:
    """The blocks the KV index knows each replica holds."""
    return {r: v["blocks"] for r, v in f.stats()["replicas"].items()}


def heard(f, replica: str, known: dict[str, int]) -> None:
    """Until the index has heard of blocks `replica` cached since `known`: it hears by events, after
    the answer, and routes a shared prefix by what it has heard."""
    wait_for(lambda: index_blocks(f)[replica] > known.get(replica, 0), 30, f"the index heard of {replica}'s blocks")


def client(f) -> openai.OpenAI:
    return openai.OpenAI(base_url=f.url, api_key="x", max_retries=0, timeout=120)


def chat(c, system: str, user: str, max_tokens: int = 6, **kw):
    return c.chat.completions.create(model="smollm2", max_tokens=max_tokens, temperature=0,
                                     messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": user}], **kw)  # fmt: skip


def holder(f, before: dict) -> str:
    """The replica whose prefix-cache queries grew since `before` (a scrape)."""
    after = scrape(f)
    grew = [k for k, v in after.items() if k.startswith("kvpage:prefix_cache_queries_total") and v > before.get(k, 0)]
    assert len(grew) == 1, grew
    return grew[0].split("replica=")[1].rstrip("}")


def test_greedy_tokens_through_the_fleet_equal_one_servers(fleet, server):
    one, many = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), client(fleet)
    prompts = ["The quick brown fox", "def fibonacci(n):\n    "]
    a = [one.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0) for p in prompts]
    b = [many.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0) for p in prompts]
    assert [x.choices[0].text for x in a] == [x.choices[0].text for x in b]
    chat_a = chat(one, "You are terse.", "Name a prime number.", 10)
    chat_b = chat(many, "You are terse.", "Name a prime number.", 10)
    text = chat_a.choices[0].message.content
    assert text == chat_b.choices[0].message.content and chat_a.usage.prompt_tokens == chat_b.usage.prompt_tokens
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
    stream = many.chat.completions.create(model="smollm2", max_tokens=10, temperature=0, stream=True,
                                          messages=messages)  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_a_shared_prefix_goes_where_its_blocks_are_and_the_client_sees_the_hit(fleet):
    c = client(fleet)
    system = f"You answer for the ACME help desk, ticket {uuid.uuid4().hex}. " * 6
    before = settled_scrape(fleet)  # (not the previous test's last reports)
    known = index_blocks(fleet)
    first = chat(c, system, "How do I reset my password?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    home = holder(fleet, before)
    heard(fleet, home, known)  # (routing by what the index knows)
    routed = fleet.stats()["routed"]
    for user in ("Where is my invoice?", "Can I change my plan?", "Who do I call?"):
        before = scrape(fleet)
        r = chat(c, system, user)
        assert holder(fleet, before) == home  # the blocks' replica, not the idle other one
        assert r.usage.prompt_tokens_details.cached_tokens >= 64  # the system prompt's full blocks
    assert fleet.stats()["routed"] == routed + 3
    m = scrape(fleet)
    assert m["kvpage:fleet_replica_blocks{replica=" + home + "}"] > 0
    assert sum(v for k, v in m.items() if k.startswith("kvpage:fleet_replica_trusted")) == 2
    assert m["kvpage:fleet_index_up{}"] == 1 and m["kvpage:fleet_router_fallbacks_total{}"] == 0
    # written through to the shared tier, announced to the index (by events too)
    wait_for(lambda: scrape(fleet)["kvpage:fleet_remote_blocks{}"] >= 4, 30, "the shared tier's blocks announced")
    for r in trusted(fleet):  # every replica's own metrics, labelled with it; nothing left in use
        wait_for(lambda r=r: scrape(fleet)["kvpage:kv_cache_blocks{replica=" + r + ",state=used}"] == 0, 10,
                 f"replica {r} idle")  # fmt: skip


def test_the_dashboard_and_the_orca_load_report_show_the_replicas(fleet):
    from tests.browser import start_browser
    from tests.browser import wait_for as wait_for_page

    base = fleet.url.removesuffix("/v1")
    with httpx.stream("GET", f"{base}/dashboard/events", timeout=30) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        line = next(ln for ln in events.iter_lines() if ln.startswith("data: "))
    pic = json.loads(line[len("data: ") :])
    assert pic["memory"] is None and pic["fleet"]["routed"] == fleet.stats()["routed"]
    replicas = {r["replica"]: r for r in pic["fleet"]["replicas"]}
    assert sorted(r for r, v in replicas.items() if v["trusted"]) == trusted(fleet)
    assert all(0.0 <= v["usage"] <= 1.0 and v["load"]["requests"] >= 0 for v in replicas.values())
    # the ingress's ORCA load report for gateways: the replicas' mean usage, their waiting requests
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(f"{fleet.url}/completions", json=body, headers={"endpoint-load-metrics-format": "json"}, timeout=60)
    assert r.status_code == 200 and r.headers["endpoint-load-metrics"].startswith("JSON ")
    named = json.loads(r.headers["endpoint-load-metrics"][5:])["named_metrics"]
    assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"} and 0.0 <= named["kv_cache_usage_perc"] <= 1
    driver = start_browser()
    try:
        driver.get(f"{base}/dashboard")
        wait_for_page(driver, "document.querySelectorAll('#replicas tr').length === 2", 30, "both replicas")
        rows = "[...document.querySelectorAll('#replicas tr')]"
        shown = driver.execute_script(f"return {rows}.map((r) => r.dataset.replica);")
        assert sorted(shown) == sorted(replicas)
        assert not driver.find_element("id", "engine").is_displayed()  # no one engine's pool to draw here
    finally:
        driver.quit()


def test_every_router_is_a_deployment_config_ray_serve_accepts():
    from ray import serve
    from ray._common.utils import import_attr

    for name in ROUTERS:
        cfg = router_config(name, "some-index")
        serve.deployment(KVReplica, name="KVReplica", request_router_config=cfg)  # validated here
        path = cfg.request_router_class
        cls = import_attr(path if isinstance(path, str) else f"{path.__module__}.{path.__qualname__}")
        assert callable(cls), name


def test_switched_off_events_are_never_trusted_and_the_router_says_so():
    """An index whose replicas publish no events (kvpage serve --no-kv-events): power-of-two, counted."""
    idx = KVIndexActor.remote()
    load = (0, 0, 0.0, 0)
    for r in ("a", "b"):
        assert ray.get(idx.report.remote(r, [], load, time.time(), None, False))
    ranking = ray.get(idx.route.remote(("d0",), ["a", "b"]))
    assert set(ranking) == {"a", "b"}
    st = ray.get(idx.stats.remote())
    assert st["fallbacks"] == 1 and st["events_off"] == ["a", "b"]
    assert not any(v["trusted"] for v in st["replicas"].values())
    ray.kill(idx)


def test_lost_events_the_index_restarts_empty_and_the_replicas_resync(fleet):
    c = client(fleet)
    system = f"Support script {uuid.uuid4().hex}: be kind and brief. " * 6
    before = settled_scrape(fleet)  # (not the previous test's last reports)
    chat(c, system, "Hello?")
    home = holder(fleet, before)
    blocks = fleet.stats()["replicas"][home]["blocks"]
    ray.kill(index_actor(fleet.index_name), no_restart=False)  # every event in flight, and the index, lost
    r = chat(c, system, "Are you there?")  # served meanwhile (power-of-two while the index is away)
    assert r.choices[0].message.content is not None
    st = wait_for(lambda: (s := fleet.stats()) and len([v for v in s["replicas"].values() if v["trusted"]]) == 2
                  and s, 60, "the restarted index resynchronised both replicas")  # fmt: skip
    assert st["resyncs"] >= 2  # each replica found its report lost and sent a snapshot
    assert st["replicas"][home]["blocks"] >= blocks  # everything it held, from its snapshot
    before = scrape(fleet)
    again = chat(c, system, "One more question.")
    assert holder(fleet, before) == home and again.usage.prompt_tokens_details.cached_tokens >= 64


def test_a_killed_replica_fails_only_its_own_requests_and_the_index_forgets_it(fleet):
    c = client(fleet)
    long_sys = f"Long story {uuid.uuid4().hex}. " * 6
    before = settled_scrape(fleet)  # (not the previous test's last reports)
    known = index_blocks(fleet)
    chat(c, long_sys, "Begin.", 1)
    victim = holder(fleet, before)
    heard(fleet, victim, known)  # (or the long request may be routed to the other one)
    other = next(r for r in trusted(fleet) if r != victim)
    results: dict[str, object] = {}

    def long_request():
        try:
            # (ignore_eos: an answer that ends early, before the kill, is not the request this test kills)
            results["long"] = chat(c, long_sys, "Tell me a very long story.", 400, extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - expected: its replica dies under it
            results["long"] = e

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: scrape(fleet).get("kvpage:num_requests_running{replica=" + victim + "}") == 1, 30, "running")
    ray.kill(fleet.replica_actor(victim), no_restart=True)
    t.join(timeout=120)
    assert isinstance(results["long"], Exception)  # its in-flight request failed ...
    wait_for(lambda: victim not in fleet.stats()["replicas"], 30, "the index forgot the dead replica")
    for i in range(3):  # ... and the rest go on
        r = chat(c, f"Short {i}. " * 3, "Hi.", 3)
        assert r.choices[0].message.content is not None
    assert other in fleet.stats()["replicas"]
    again = chat(c, long_sys, "Begin again.", 1)  # the dead replica's prefix, from the shared tier
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
