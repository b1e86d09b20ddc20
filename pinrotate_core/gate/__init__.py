"""The retire gate: everything that decides "may KEY be destroyed" lives in this package.

``verdict``: the rule over inventory counts; ``retire``: ``gate --retire`` and the run's gate
section; ``record``: the change-ticket record. The run asks the gate; it decides nothing itself.
"""

from .record import check_ticket, gate_record, write_gate_record
from .retire import retire_gate, run_gate
from .verdict import (
    ALWAYS_BLOCKING,
    GateReport,
    KeyNotRetirable,
    check_retire_key,
    describe_held,
    evaluate_gate,
    held_keys,
    on_key_category,
)

__all__ = [
    "ALWAYS_BLOCKING", "GateReport", "KeyNotRetirable", "check_retire_key", "check_ticket", "describe_held",
    "evaluate_gate", "gate_record", "held_keys", "on_key_category", "retire_gate", "run_gate", "write_gate_record",
]
