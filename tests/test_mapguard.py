"""kvstore.store.mapguard.MapGuard: shared/exclusive with writer preference, no self-deadlock."""

from __future__ import annotations

import threading

import pytest
from waiting import parked_on, wait_until

from kvstore.errors import StoreError
from kvstore.store.mapguard import MapGuard


def test_shared_holders_do_not_block_each_other() -> None:
    g = MapGuard()
    g.acquire()
    done = threading.Event()

    def other() -> None:
        g.acquire()
        g.release()
        done.set()

    threading.Thread(target=other).start()
    assert done.wait(5)
    g.release()


def test_exclusive_waits_for_shared_and_holds_new_ones_back() -> None:
    g = MapGuard()
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


def test_a_thread_inside_may_reenter_while_a_resize_is_pending() -> None:
    g = MapGuard()
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


def test_exclusive_from_a_holding_thread_is_refused() -> None:
    g = MapGuard()
    g.acquire()
    with pytest.raises(StoreError, match="open reader"), g.exclusive():
        pass
    g.release()
    with g.exclusive():  # fine once released
        pass
