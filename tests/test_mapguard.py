"""kvstore.store.mapguard.MapGuard: shared/exclusive with writer preference, no self-deadlock."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import parked_on, wait_until

from kvstore.errors import StoreError
from kvstore.store.mapguard import MapGuard


@pytest.fixture(params=["lock-free readers", "locked readers"])
def guard(request: pytest.FixtureRequest) -> MapGuard:
    """A guard with each shared side: lock-free (an interpreter with its global lock) and
    locked (the one it takes without)."""
    g = MapGuard()
    if request.param == "locked readers":
        g.acquire = g._acquire_locked  # type: ignore[method-assign]
        g.release = g._release_locked  # type: ignore[method-assign]
    return g


def test_shared_holders_do_not_block_each_other(guard: MapGuard) -> None:
    g = guard
    g.acquire()
    done = threading.Event()

    def other() -> None:
        g.acquire()
        g.release()
        done.set()

    threading.Thread(target=other).start()
    assert done.wait(5)
    g.release()


def test_exclusive_waits_for_shared_and_holds_new_ones_back(guard: MapGuard) -> None:
    g = guard
    g.acquire()
    events: list[str] = []
    in_exclusive = threading.Event()

    def resizer() -> None:
        with g.exclusive():
            in_exclusive.set()
            events.append("resize")
            # the late reader, woken by the release, is held back again while this runs
            wait_until(lambda: parked_on(g._cond), "the late reader to wait out the resize")
            events.append(f"{len(events)} in exclusive")
        events.append("resized")

    def late_reader() -> None:
        g.acquire()  # arrives while the resize is pending: waits until it is done
        events.append("late reader")
        g.release()

    t1 = threading.Thread(target=resizer)
    t1.start()
    wait_until(lambda: parked_on(g._cond), "the resize to wait for the shared holder")
    assert not in_exclusive.is_set()  # a shared holder is inside
    t2 = threading.Thread(target=late_reader)
    t2.start()
    wait_until(lambda: parked_on(g._cond, 2), "the late reader to wait behind the resize")
    assert events == []
    g.release()
    t1.join(5)
    t2.join(5)
    assert events[:2] == ["resize", "1 in exclusive"]  # nobody else got in meanwhile
    assert events.index("resize") < events.index("late reader")


def test_a_thread_inside_may_reenter_while_a_resize_is_pending(guard: MapGuard) -> None:
    g = guard
    g.acquire()
    pending = threading.Event()

    def resizer() -> None:
        pending.set()
        with g.exclusive():
            pass

    t = threading.Thread(target=resizer)
    t.start()
    assert pending.wait(5)
    wait_until(lambda: parked_on(g._cond), "the resize to be pending")
    g.acquire()  # a nested transaction of a holder: must not wait for the resize
    g.release()
    g.release()
    t.join(5)
    assert not t.is_alive()


def test_exclusive_from_a_holding_thread_is_refused(guard: MapGuard) -> None:
    g = guard
    g.acquire()
    with pytest.raises(StoreError, match="open reader"), g.exclusive():
        pass
    g.release()
    with g.exclusive():  # fine once released
        pass


def test_no_reader_is_inside_while_a_resize_runs(guard: MapGuard) -> None:
    """Readers (nested too) and resizes in a race: a resize never runs with a reader
    inside, and every thread finishes."""
    g = guard
    lock = threading.Lock()
    inside = [0]
    resizing = [False]
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            g.acquire()
            g.acquire()  # nested, as a reader inside a reader
            with lock:
                inside[0] += 1
                if resizing[0]:
                    errors.append("a reader entered during a resize")
            with lock:
                inside[0] -= 1
            g.release()
            g.release()

    def resizer() -> None:
        for _ in range(200):
            with g.exclusive():
                with lock:
                    resizing[0] = True
                    if inside[0]:
                        errors.append(f"a resize ran with {inside[0]} readers inside")
                time.sleep(0.0005)  # a remap's time, for a reader to get in if it could
                with lock:
                    resizing[0] = False

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(4)]
    for t in readers:
        t.start()
    resizers = [threading.Thread(target=resizer, daemon=True) for _ in range(2)]
    for t in resizers:
        t.start()
    for t in resizers:
        t.join(30)
    stop.set()
    for t in readers:
        t.join(5)
    assert not any(t.is_alive() for t in readers + resizers)
    assert errors == []
    assert g._active() == 0


def test_a_thread_that_ends_leaves_no_count_behind(guard: MapGuard) -> None:
    g = guard

    def enter_and_leave() -> None:
        g.acquire()
        g.release()

    t = threading.Thread(target=enter_and_leave)
    t.start()
    t.join(5)
    with g.exclusive():  # the ended thread's count is gone, not waited for
        pass
    assert g._active() == 0
