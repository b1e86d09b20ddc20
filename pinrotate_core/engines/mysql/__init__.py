"""The MySQL 8.0+ / MariaDB 10.6+ room: connections (PyMySQL through SQLAlchemy), SQL pieces,
catalog, the compare-and-swap write guard, gate checks, throttle signals and the advisory lock.
Never imports the drain, gate or flows: they ask it."""
