"""/dashboard in a real browser (Debian's headless chromium, driven by selenium) against a live server.

Requests with a shared prefix, n = 3 samples and a beam search run while the page draws; paused, the
page must show exactly what the engine's cache_stats() said at the step it shows, the samples' block
tables branching where copy-on-write split them, and, once idle, a pool with nothing in use.
KVPAGE_DASHBOARD_SCREENSHOT=PATH saves the paused page (docs/dashboard.png is made that way).
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import openai
import pytest

from kvpage.server.dashboard import EngineFeed
from tests.browser import start_browser, wait_for
from tests.server.conftest import assert_pool_free, start_server, stop_server

KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX = ("You are the support assistant of a bookshop. Answer politely and briefly. Opening hours are nine to "
          "six on weekdays and ten to four on Saturdays; orders ship within two days, by post or by courier, and "
          "arrive within a week anywhere in the country. Returns are free for thirty days with the receipt, and "
          "gift cards never expire. Be brief. Question: ")  # fmt: skip


@pytest.fixture(scope="module")
def live():
    s = start_server(api_key=KEY, num_kv_blocks=160, swap_space="8MiB", cpu_offload_memory="8MiB")
    seen = {}  # engine step -> cache_stats(), recorded in the engine thread like the dashboard's pictures
    s.aengine.between_steps.insert(0, lambda: seen.__setitem__(s.engine.num_steps, s.engine.cache_stats()))
    s.seen = seen
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()


def count(driver, selector: str) -> int:
    return driver.execute_script(f"return document.querySelectorAll({json.dumps(selector)}).length;")


def drawn_rows(driver) -> list[dict]:
    return driver.execute_script("""return [...document.querySelectorAll('g.row')].map((g) => ({
        request_id: g.dataset.requestId, index: +g.dataset.index, shared: +g.dataset.sharedPrefix,
        parent: g.dataset.parent, blocks: g.dataset.blocks ? g.dataset.blocks.split(' ').map(Number) : [],
        kind: g.closest('.request').dataset.kind}));""")


def assert_pool_drawn_as(driver, st) -> None:
    """The pool grid's squares, class by class, are the engine's counts."""
    assert count(driver, "#pool rect") == st.total_blocks
    assert count(driver, "#pool rect.used") + count(driver, "#pool rect.shared") == st.used_blocks
    assert count(driver, "#pool rect.shared") == st.shared_blocks
    assert count(driver, "#pool rect.cached") == st.cached_blocks
    assert count(driver, "#pool rect.free") == st.free_blocks - st.cached_blocks
    shown = {k: driver.find_element("id", k).text for k in ("n-used", "n-shared", "n-cached")}
    assert shown == {"n-used": str(st.used_blocks), "n-shared": str(st.shared_blocks),
                     "n-cached": str(st.cached_blocks)}  # fmt: skip


def test_the_dashboard_needs_the_key_and_a_browser_gets_it_as_a_cookie(live):
    assert httpx.get(f"{live.url}/dashboard").status_code == 401
    assert httpx.get(f"{live.url}/dashboard?api_key=wrong").status_code == 401
    assert httpx.get(f"{live.url}/dashboard", cookies={"kvpage_key": "wrong"}).status_code == 401
    r = httpx.get(f"{live.url}/dashboard?api_key={KEY}")
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"kvpage_key={KEY};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert "Path=/dashboard" in cookie
    page = httpx.get(f"{live.url}/dashboard", cookies={"kvpage_key": KEY})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(f"{live.url}/dashboard", headers=AUTH).status_code == 200
    # the cookie opens the dashboard's paths only: never the API
    assert httpx.get(f"{live.url}/v1/models", cookies={"kvpage_key": KEY}).status_code == 401
    assert httpx.get(f"{live.url}/v1/models?api_key={KEY}").status_code == 401
    # the stream: server-sent events, each one picture of the engine as JSON
    with httpx.stream("GET", f"{live.url}/dashboard/events", headers=AUTH, timeout=10) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        line = next(ln for ln in events.iter_lines() if ln.startswith("data: "))
    pic = json.loads(line[len("data: ") :])
    assert pic["stats"] == live.engine.cache_stats().as_dict() and len(pic["memory"]["gpu"]) == 160
    assert pic["fleet"] is None and pic["requests"] == []
    # nobody watching: the engine thread builds no picture
    feed = next(h for h in live.aengine.between_steps if isinstance(h, EngineFeed))
    deadline = time.monotonic() + 10
    while feed.num_watchers and time.monotonic() < deadline:
        time.sleep(0.02)
    built = feed.num_pictures
    client = openai.OpenAI(base_url=live.base_url, api_key=KEY, max_retries=0)
    done = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4
    assert feed.num_watchers == 0 and feed.num_pictures == built
    assert_pool_free(live, headers=AUTH)


def test_the_page_draws_sharing_samples_and_beams_as_the_engine_counts_them(live, browser):
    client = openai.OpenAI(base_url=live.base_url, api_key=KEY, max_retries=0, timeout=120)
    browser.get(f"{live.url}/dashboard?api_key={KEY}")
    wait_for(browser, "window.kvDashboard && window.kvDashboard.drawn > 0", 30, "a first picture")
    results, errors = {}, []

    def run(name, **kw):
        try:
            results[name] = client.completions.create(model="smollm2", **kw)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    poem = (
        "Write a short poem about memory paged in blocks, about tables that point at them, and about the "
        "copies made only when a writer comes along, in the style of an old sea song."
    )
    cities = "Here is a list of the largest cities of France, with a sentence on the history of each one: the first is"
    go_on = {"ignore_eos": True}
    jobs = [
        ("first", dict(prompt=PREFIX + "when do you open on Saturday?", max_tokens=150, extra_body=go_on)),
        ("samples", dict(prompt=poem, n=3, max_tokens=150, temperature=1.0, seed=7, extra_body=go_on)),
        ("beams", dict(prompt=cities, n=3, max_tokens=100, extra_body={"use_beam_search": True, **go_on})),
        ("second", dict(prompt=PREFIX + "how fast do orders ship?", max_tokens=150, extra_body=go_on)),
        (
            "evicting",
            dict(
                prompt="Count from one to one hundred in words:",
                max_tokens=150,
                extra_body={"kv_eviction": "streaming:sink_tokens=16,window_tokens=16", **go_on},
            ),
        ),
    ]
    threads = []
    for name, kw in jobs:
        threads.append(threading.Thread(target=run, args=(name,), kwargs=kw, daemon=True))
        threads[-1].start()
        time.sleep(0.3)  # "second" comes once "first"'s prompt blocks are cached

    # every kind on the page at once (the two prefix requests sharing blocks): then pause
    wait_for(
        browser,
        """(() => { const s = window.kvDashboard.snapshot; if (!s || !s.memory) return false;
        const kinds = s.requests.map((r) => r.kind), rows = s.memory.tables;
        const of = (k) => rows.filter((t) => s.requests.some((r) => r.request_id === t.request_id && r.kind === k));
        return of('samples').length === 3 && of('beam').length >= 2 && of('single').length === 3
               && kinds.length === 5 && s.stats.shared_blocks > 0 && rows.some((t) => t.block_ids.includes(null));
        })()""",
        90,
        "all five requests, one with holes",
    )
    browser.find_element("id", "pause").click()
    snap = browser.execute_script("return window.kvDashboard.snapshot;")
    step = int(browser.find_element("id", "step").text)
    assert step == snap["step"]
    if os.environ.get("KVPAGE_DASHBOARD_SCREENSHOT"):
        browser.save_screenshot(os.environ["KVPAGE_DASHBOARD_SCREENSHOT"])
    st = live.seen[step]
    assert snap["stats"] == st.as_dict()  # the picture is the engine's own snapshot of that step
    assert_pool_drawn_as(browser, st)

    rows = drawn_rows(browser)
    kinds = {r["request_id"]: r["kind"] for r in snap["requests"]}
    prompt_len = {r["request_id"]: r["prompt_tokens"] for r in snap["requests"]}
    bs = snap["memory"]["block_size"]
    by_kind = {k: [r for r in rows if kinds[r["request_id"]] == k] for k in ("single", "samples", "beam")}
    samples = sorted(by_kind["samples"], key=lambda r: r["index"])
    rid = samples[0]["request_id"]
    assert [r["index"] for r in samples] == [0, 1, 2]
    assert [r["shared"] for r in samples[1:]] == [prompt_len[rid] // bs] * 2  # the prompt's full blocks, no more
    assert all(r["parent"] != "" for r in samples[1:])
    for r in samples:  # the shared blocks are drawn as shared by (at least) the three samples
        for b in r["blocks"][: prompt_len[rid] // bs]:
            assert int(browser.execute_script(f"return document.querySelector('#pool rect[data-block=\"{b}\"]')"
                                              ".dataset.ref;")) >= 3  # fmt: skip
    beams = sorted(by_kind["beam"], key=lambda r: r["index"])
    brid = beams[0]["request_id"]
    assert all(r["shared"] >= prompt_len[brid] // bs and r["parent"] != "" for r in beams[1:])
    common = len(live.engine.tokenizer.encode(PREFIX)) // bs - 1  # (less one: the boundary's tokens may merge)
    first, second = [r for r in by_kind["single"] if prompt_len[r["request_id"]] > common * bs]
    assert common >= 2 and first["blocks"][:common] == second["blocks"][:common]  # the prefix, one copy for both
    assert max(r["cached_tokens"] or 0 for r in snap["requests"] if kinds[r["request_id"]] == "single") >= common * bs
    assert {r["shared"] for r in (first, second)} == {0}  # (requests apart: no branch is drawn between them)

    # holes an eviction policy left, drawn as holes; the CPU swap pool and the tier, square by square
    holes = sum(b is None for t in snap["memory"]["tables"] for b in t["block_ids"])
    assert holes > 0 and count(browser, "g.row rect.hole") == holes and st.evicted_tokens >= holes * bs
    assert count(browser, "#cpu rect") == st.cpu_total_blocks > 0
    assert count(browser, "#cpu rect.swapped") == st.cpu_used_blocks
    assert count(browser, "#tier rect") == st.tier_total_blocks > 0
    assert count(browser, "#tier rect.tier") == st.tier_cached_blocks

    browser.find_element("id", "pause").click()  # live again: the page catches up
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert [len(results[n].choices) for n in ("first", "samples", "beams", "second", "evicting")] == [1, 3, 3, 1, 1]
    assert results["samples"].usage.prompt_tokens == prompt_len[rid]
    assert_pool_free(live, headers=AUTH)
    final = live.engine.cache_stats()
    wait_for(
        browser,
        f"window.kvDashboard.snapshot.requests.length === 0 && "
        f"window.kvDashboard.snapshot.stats.used_blocks === 0 && "
        f"window.kvDashboard.snapshot.stats.cached_blocks === {final.cached_blocks}",
        30,
        "the idle pool",
    )
    assert_pool_drawn_as(browser, final)
    assert count(browser, "g.row") == 0 and final.cached_blocks > 0
    live.engine.kv_manager.check_invariants()
