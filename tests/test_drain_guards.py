"""The write guards ask a scheme only for what their own guard needs, through optional protocols
(the Scheme protocol has none of it): the compare-and-swap guard how a miss settles, the value
count how many values of a row are stale, the lock guard the key-version column."""

from __future__ import annotations

import pytest

from pinrotate_core.drain.counting import CountsStaleValues
from pinrotate_core.drain.guard_cas import CasGuard, SettlesMisses
from pinrotate_core.drain.guard_version import KeyVersioned
from pinrotate_core.drain.pg_port import GUARDS
from pinrotate_core.schemes.aesgcm import AesGcmScheme
from pinrotate_core.schemes.fpc1 import Fpc1Scheme
from pinrotate_core.schemes.transit import TransitScheme


def test_each_scheme_offers_what_its_own_guard_asks_and_nothing_of_the_other() -> None:
    assert GUARDS[Fpc1Scheme.guard] is CasGuard
    assert issubclass(Fpc1Scheme, SettlesMisses) and issubclass(Fpc1Scheme, CountsStaleValues)
    for row_versioned in (AesGcmScheme, TransitScheme):
        assert GUARDS[row_versioned.guard] is not CasGuard
        assert issubclass(row_versioned, KeyVersioned)
        # Rows are locked while written (no miss to settle) and counted as rows.
        assert not issubclass(row_versioned, SettlesMisses) and not issubclass(row_versioned, CountsStaleValues)


def test_a_compare_and_swap_guard_refuses_a_scheme_that_cannot_settle_a_miss() -> None:
    class NoSettle:
        name = "toy"
        target = None

    with pytest.raises(TypeError, match="toy"):
        CasGuard(NoSettle(), None, dry_run=False)  # type: ignore[arg-type]
