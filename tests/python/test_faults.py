"""Ctrl-C inside a blocking call, and a lost engine, seen from Python."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

import tinylm as tinymodel  # noqa: E402
from cluster import Engine, config_dict, kill_and_expect_named  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python")


def read_line(proc, prefix, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.split()
    raise AssertionError(f"trainer never printed '{prefix}' (exit code {proc.poll()})")


def test_ctrl_c_in_weight_update_returns_within_a_second_and_the_group_survives():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, EXAMPLES, os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen([sys.executable, os.path.join(HERE, "interrupt_trainer.py")], env=env,
                               stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        endpoint = read_line(trainer, "endpoint")[1]
        engine = Engine(endpoint, "engine-1", "inplace", "float32", 1)
        engine.wait_ready()
        engine.call("set", "sleep_once", 4.0)  # the first update blocks in the engine for 4 s
        read_line(trainer, "updating")
        time.sleep(1.0)
        sent = time.monotonic()
        trainer.send_signal(signal.SIGINT)
        interrupted = float(read_line(trainer, "interrupted")[1])
        print(f"Ctrl-C returned control after {interrupted - sent:.3f}s")
        assert interrupted - sent < 1.0, f"Ctrl-C took {interrupted - sent:.2f}s to return control"
        second = read_line(trainer, "second")
        assert second[2] == "ok", " ".join(second)
        assert read_line(trainer, "first")[1] == "ok"  # the interrupted update finished in the background
        assert trainer.wait(60) == 0
        assert engine.call("state") == ("consistent", int(second[1]))
        model = tinymodel.TinyLM(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert torch.equal(engine.call("logits"), tinymodel.logits(model))
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()
        if engine:
            engine.close()


def test_ctrl_c_in_wait_for_version_returns_within_a_second():
    sub = paramcast.Subscriber(config_dict(subscribers=1), "engine-1")  # never started: v1 never comes
    sent = []

    def interrupt():
        time.sleep(0.5)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        sub.wait_for_version(1, timeout=60)
    took = time.monotonic() - sent[0]
    assert took < 1.0, f"Ctrl-C took {took:.2f}s to return control"
    assert sub.state == "empty"
    sub.stop()


def test_exit_without_close_is_clean():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, EXAMPLES, os.environ.get("PYTHONPATH", "")]))
    for _ in range(3):  # the async update is at a different point each time
        done = subprocess.run([sys.executable, os.path.join(HERE, "exit_without_close.py")], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "exiting ['a', 1" in done.stdout


def test_lost_engine_is_named_within_the_heartbeat_bound():
    torch.set_num_threads(1)
    model = tinymodel.TinyLM(0)
    with paramcast.Publisher(config_dict(subscribers=2)) as pub:
        engines = [Engine(pub.endpoint, f"engine-{i}", "inplace", "float32", i) for i in (1, 2)]
        try:
            for e in engines:
                e.wait_ready()
            pub.start()
            kill_and_expect_named(pub, model, engines[1])
            deadline = time.monotonic() + 10
            while pub.status()["members"].get("engine-2") != "lost" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pub.status()["members"]["engine-2"] == "lost"
        finally:
            for e in engines:
                e.close()


def test_errors_map_to_one_exception_family():
    cfg = config_dict(subscribers=1)
    cfg["control"]["join_timeout"] = "500ms"
    with paramcast.Publisher(cfg) as pub:
        start = time.monotonic()
        with pytest.raises(paramcast.DeadlineExceeded, match=r"join_timeout") as err:
            pub.start()  # no engine comes
        assert time.monotonic() - start < 10
        assert isinstance(err.value, TimeoutError) and err.value.code == "TIMEOUT"
        taken = dict(cfg, control=dict(cfg["control"], endpoint=pub.endpoint))
        with pytest.raises(paramcast.UnavailableError, match=pub.endpoint.rsplit(":", 1)[1]):
            paramcast.Publisher(taken)  # the endpoint is bound already
        sub = paramcast.Subscriber(taken, "engine-1")
        with pytest.raises(paramcast.DeadlineExceeded, match=r"engine-1: version 1 not applied within 0.3s "
                                                                r"\(state: .*empty"):
            sub.wait_for_version(1, timeout=0.3)
        sub.stop()
    with pytest.raises(paramcast.UnavailableError, match=r"closed"):
        pub.status()
