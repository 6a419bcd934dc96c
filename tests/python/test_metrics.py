"""metrics.listen: a live publisher's and its engines' Prometheus pages, scraped during updates and parsed
with prometheus_client's own parser; the figures must follow the updates."""

import copy
import threading
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
parser = pytest.importorskip("prometheus_client.parser")
import paramcast  # noqa: E402

from cluster import config_dict  # noqa: E402

SHAPES = {"embed.weight": (256, 64), "layers.0.weight": (64, 64), "norm.weight": (1, 64), "norm.bias": (1, 64), "head.weight": (64, 256)}
BYTES = sum(4 * a * b for a, b in SHAPES.values())


def scrape(url):
    """{(name, labels as a sorted tuple): value} of every sample on the page."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not on the page; it has: {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def metrics_config():
    cfg = config_dict(subscribers=2)
    cfg["metrics"] = {"listen": "127.0.0.1:0"}
    return cfg


@pytest.fixture
def group():
    pub = paramcast.Publisher(metrics_config())
    subs, buffers = [], []
    for i in (1, 2):
        sub = paramcast.Subscriber(dict(metrics_config(), control={**metrics_config()["control"],
                                                                     "endpoint": pub.endpoint}), f"engine-{i}")
        tensors = {n: torch.zeros(s) for n, s in SHAPES.items()}
        sub.register(tensors)
        sub.start()
        subs.append(sub)
        buffers.append(tensors)
    pub.start()
    yield pub, subs, buffers
    for s in subs:
        s.stop()
    pub.close()


def weights(version):
    return {n: torch.full(s, float(version)) + torch.arange(s[0] * s[1], dtype=torch.float32).reshape(s)
            for n, s in SHAPES.items()}


def test_pages_follow_every_update(group):
    pub, subs, buffers = group
    assert pub.metrics_endpoint.startswith("http://127.0.0.1:") and pub.metrics_endpoint.endswith("/metrics")
    urls = [s.metrics_endpoint for s in subs]
    assert len(set(urls + [pub.metrics_endpoint])) == 3, "each process binds its own port"

    before = scrape(pub.metrics_endpoint)
    assert value(before, "paramcast_updates_total", result="ok") == 0
    assert value(before, "paramcast_members", state="empty") == 2
    for v in (1, 2, 3):
        pub.weight_update(weights(v), version=v)
        page = scrape(pub.metrics_endpoint)
        assert value(page, "paramcast_updates_total", result="ok") == v
        assert value(page, "paramcast_update_duration_seconds_count") == v
        assert value(page, "paramcast_bytes_total") == v * BYTES
        assert value(page, "paramcast_wire_bytes_total") > 0
        assert value(page, "paramcast_last_update_gbps") > 0
        assert value(page, "paramcast_published_version") == v
        assert value(page, "paramcast_members", state="consistent") == 2
        assert value(page, "paramcast_staging_bytes") > 0  # the two norm tensors are packed into a staging bucket
        for i, sub in enumerate(subs, 1):
            worker = f"engine-{i}"
            assert value(page, "paramcast_member_version", worker=worker) == v
            assert value(page, "paramcast_member_consistent", worker=worker) == 1
            assert value(page, "paramcast_member_in_group", worker=worker) == 1
            assert 0 <= value(page, "paramcast_member_heartbeat_age_seconds", worker=worker) < 30
            mine = scrape(sub.metrics_endpoint)
            assert value(mine, "paramcast_subscriber_version", worker=worker) == v
            assert value(mine, "paramcast_subscriber_consistent", worker=worker) == 1
            assert value(mine, "paramcast_subscriber_joined", worker=worker) == 1
            assert value(mine, "paramcast_subscriber_updates_total", worker=worker, result="ok") == v
            assert value(mine, "paramcast_subscriber_bytes_total", worker=worker) == v * BYTES
            assert value(mine, "paramcast_subscriber_update_duration_seconds_count", worker=worker) == v
            le_inf = value(mine, "paramcast_subscriber_update_duration_seconds_bucket", worker=worker, le="+Inf")
            assert le_inf == v
            assert torch.equal(buffers[i - 1]["head.weight"], weights(v)["head.weight"])
    link = [value(page, "paramcast_member_link_bytes_per_second", worker=f"engine-{i}") for i in (1, 2)]
    assert all(rate >= 0 for rate in link)


def test_a_failed_update_is_counted_by_its_code(group):
    pub, subs, _ = group
    pub.weight_update(weights(1), version=1)
    bad = weights(2)
    bad["head.weight"] = torch.zeros(3, 3)  # the engines registered 64 x 256
    with pytest.raises(paramcast.UpdateError):
        pub.weight_update(bad, version=2)
    page = scrape(pub.metrics_endpoint)
    assert value(page, "paramcast_updates_total", result="ok") == 1
    failed = {k: v for k, v in page.items() if k[0] == "paramcast_updates_total" and ("result", "ok") not in k[1]}
    assert sum(failed.values()) == 1, failed
    assert value(page, "paramcast_update_duration_seconds_count") == 2
    assert value(page, "paramcast_bytes_total") == BYTES  # only the update that succeeded
    assert value(page, "paramcast_members", state="consistent") == 2  # a rejected plan moved no byte


def test_scrapes_during_updates_always_parse(group):
    pub, subs, _ = group
    stop = threading.Event()
    seen, errors = [], []

    def scraper():
        while not stop.is_set():
            try:
                seen.append(value(scrape(pub.metrics_endpoint), "paramcast_updates_total", result="ok"))
                scrape(subs[0].metrics_endpoint)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                return

    t = threading.Thread(target=scraper)
    t.start()
    try:
        for v in range(1, 6):
            pub.weight_update(weights(v), version=v)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert seen, "no scrape completed"
    assert seen == sorted(seen), "updates_total went backwards"
    assert value(scrape(pub.metrics_endpoint), "paramcast_updates_total", result="ok") == 5


def test_only_the_metrics_page_is_served(group):
    pub, _, _ = group
    base = pub.metrics_endpoint.removesuffix("/metrics")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/admin", timeout=10)
    assert e.value.code == 404


def test_a_taken_port_fails_the_second_publisher_naming_the_address():
    first = paramcast.Publisher(metrics_config())
    try:
        port = first.metrics_endpoint.rsplit(":", 1)[1].split("/")[0]
        cfg = metrics_config()
        cfg["metrics"] = {"listen": f"127.0.0.1:{port}"}
        with pytest.raises(paramcast.Error, match=f"metrics.listen 127.0.0.1:{port}"):
            paramcast.Publisher(cfg)
    finally:
        first.close()


@pytest.mark.parametrize("listen, why", [("127.0.0.1:99999", "port in \\[0, 65535\\]"),
                                         ("127.0.0.1:http", "HOST:PORT"),
                                         ("", "HOST:PORT")])
def test_a_bad_listen_address_is_a_config_error(listen, why):
    cfg = metrics_config()
    cfg["metrics"] = {"listen": listen}
    with pytest.raises(paramcast.ConfigError, match=f"metrics.listen.*{why}"):
        paramcast.load_config(cfg)


def test_a_bare_port_means_loopback():
    cfg = metrics_config()
    cfg["metrics"] = {"listen": "0"}
    pub = paramcast.Publisher(cfg)
    try:
        assert pub.metrics_endpoint.startswith("http://127.0.0.1:")
    finally:
        pub.close()


def test_metrics_are_off_unless_configured():
    pub = paramcast.Publisher(copy.deepcopy(config_dict(subscribers=1)))
    try:
        assert pub.metrics_endpoint == ""
    finally:
        pub.close()


JSON_LOG_SCRIPT = r"""
import sys, torch, paramcast
sys.path[:0] = [sys.argv[1]]
from cluster import config_dict
cfg = config_dict(subscribers=1)
cfg["logging"] = {"level": "info", "format": "json"}
pub = paramcast.Publisher(cfg)
sub = paramcast.Subscriber(dict(cfg, control={**cfg["control"], "endpoint": pub.endpoint}), "engine-1")
sub.register({"w": torch.zeros(8)})
sub.start()
pub.start()
pub.weight_update({"w": torch.ones(8)}, version=1)
sub.stop()
pub.close()
"""


def test_json_logs_are_one_object_per_line():
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", JSON_LOG_SCRIPT, here], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "no log lines"
    records = []
    for line in lines:
        record = json.loads(line)  # every line, not just most
        assert {"time", "level", "component", "message"} <= record.keys(), record
        assert record["time"].endswith("Z") and record["level"] in ("debug", "info", "warn", "error")
        records.append(record)
    assert any(r["component"] == "publisher" for r in records), records
    assert any(r.get("worker") == "engine-1" and r["component"] == "subscriber" for r in records), records


def test_ranges_and_other_methods_are_refused(group):
    pub, _, _ = group
    req = urllib.request.Request(pub.metrics_endpoint, headers={"Range": "bytes=0-,0-,0-,0-"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 416
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(pub.metrics_endpoint, data=b"x", method="POST"), timeout=10)
    assert e.value.code == 405


def test_a_client_that_holds_a_connection_does_not_hold_up_close():
    import socket
    import time
    pub = paramcast.Publisher(metrics_config())
    host, port = pub.metrics_endpoint.split("//")[1].split("/")[0].rsplit(":", 1)
    clients = []
    for _ in range(3):  # more than the server's workers: each sends half a request, then nothing
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        clients.append(s)
    time.sleep(0.3)
    t0 = time.monotonic()
    pub.close()
    took = time.monotonic() - t0
    for s in clients:
        s.close()
    assert took < 15, f"close took {took:.1f} s with clients holding connections"
