"""The device executor with several workers (shared batches) and the queue position of a job."""

from __future__ import annotations

import threading

from service.executor import DeviceExecutor


def test_workers_run_at_once_and_queued_jobs_know_their_place() -> None:
    gate = threading.Event()
    running = threading.Semaphore(0)

    def blocked() -> str:
        running.release()
        gate.wait(10)
        return "ran"

    executor = DeviceExecutor("cpu", queue_size=3, workers=2)
    try:
        first = [executor.submit_future(blocked) for _ in range(2)]
        assert running.acquire(timeout=10) and running.acquire(timeout=10)  # both run at once
        waiting = [executor.submit_future(lambda: "later") for _ in range(3)]
        assert [executor.position(f) for f in waiting] == [1, 2, 3]
        assert executor.position(first[0]) is None  # running: no place in the queue
        assert not executor.has_room()  # 2 running + 3 waiting = queue_size + workers
        waiting[0].cancel()
        assert [executor.position(f) for f in waiting[1:]] == [1, 2]
        gate.set()
        assert [f.result(10) for f in first + waiting[1:]] == ["ran", "ran", "later", "later"]
    finally:
        executor.shutdown()
