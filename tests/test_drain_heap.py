"""The drain keeps a process's long-lived objects out of full garbage collections while it runs,
and gives the process its garbage collector back as it found it."""

from __future__ import annotations

import gc
import threading

from pinrotate_core.drain import long_lived_heap_frozen


def test_the_heap_is_frozen_while_drains_run_and_handed_back_after_the_last_one() -> None:
    assert gc.get_freeze_count() == 0
    marker = [object()]
    inside = threading.Event()
    release = threading.Event()

    def other_drain() -> None:
        with long_lived_heap_frozen():
            inside.set()
            release.wait(10)

    with long_lived_heap_frozen():
        assert gc.get_freeze_count() > 0
        worker = threading.Thread(target=other_drain)
        worker.start()
        assert inside.wait(10)
    # The first drain ended, another still runs: the heap stays frozen for it.
    assert gc.get_freeze_count() > 0
    release.set()
    worker.join(10)
    assert gc.get_freeze_count() == 0
    assert marker  # nothing was freed or changed by it


def test_a_process_that_froze_its_own_heap_keeps_it_frozen() -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with long_lived_heap_frozen():
            pass
        after = gc.get_freeze_count()
        # Still the process's own frozen heap: an unfreeze would leave 0, a second freeze would add
        # every object made since. (Frozen objects that another thread of the test process frees
        # meanwhile, e.g. pytest-xdist's, leave the count a few objects short: never more.)
        assert before - 100 <= after <= before, (before, after)
    finally:
        gc.unfreeze()
