"""make serve's supervision of the OpenAI front: started again when it exits, within the bound."""

from __future__ import annotations

import sys
import time

from backend.server import openai_process
from backend.server.openai_process import OpenAIFront


def test_a_front_that_exits_is_started_again_up_to_max_restarts(monkeypatch):
    monkeypatch.setattr(openai_process, "RESTART_DELAY_SECONDS", 0.05)
    front = OpenAIFront(8001, 9000, max_restarts=2)
    assert front.command[1:3] == ["-m", "openai_front"] and "127.0.0.1:8001" in front.command
    front.command = [sys.executable, "-c", "raise SystemExit(3)"]  # a front that dies at once
    front.start()
    pids = {front.process.pid}
    deadline = time.monotonic() + 20
    while front.restarts < 2 and time.monotonic() < deadline:
        front.check()
        pids.add(front.process.pid)
        time.sleep(0.02)
    assert front.restarts == 2 and len(pids) == 3
    front.process.wait(10)
    for _ in range(10):  # the bound holds
        front.check()
        time.sleep(0.06)
    assert front.restarts == 2 and front.process.pid in pids
    front.stop()


def test_a_running_front_is_left_alone_and_stopped_with_its_group():
    front = OpenAIFront(8001, 9000)
    front.command = [sys.executable, "-c", "import time; time.sleep(60)"]
    front.start()
    front.check()
    assert front.restarts == 0 and front.process.poll() is None
    front.stop(timeout=5)
    assert front.process.poll() is not None
