"""The command line's MySQL / MariaDB branches (``flows.cli`` asks here when the URL is
``mysql://`` or ``mariadb://``): the core's MySQL commands (``pinrotate_core/mysql_*.py``). A run
is not here: it goes through the Prefect flow as on PostgreSQL, whose steps ask ``mysql_run``."""

from __future__ import annotations

import argparse

from pinrotate_core.config import Settings
from pinrotate_core.gate.discover import Discovery
from pinrotate_core.inventory import Inventory


def inventory(ns: argparse.Namespace, settings: Settings) -> Inventory:
    from pinrotate_core.mysql_inventory import mysql_inventory

    return mysql_inventory(settings, deep=ns.deep, tenant=ns.tenant)


def discover(settings: Settings) -> Discovery:
    """``inventory --discover``: the gate's sweep of the server, in a snapshot of its own."""
    from pinrotate_core.mysql_sweep import discover_mysql

    return discover_mysql(settings)


def grants(ns: argparse.Namespace, settings: Settings) -> list[str]:
    from pinrotate_core.mysql_grants import mysql_grant_statements

    return mysql_grant_statements(settings, ns.role, read_only=ns.read_only)
