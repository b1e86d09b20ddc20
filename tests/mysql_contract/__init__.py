"""Acceptance tests of MySQL / MariaDB support (issue 32): the CLI as a user drives it, on a real
MariaDB, against contract §3-§7; every ciphertext made and read by the tests' own code."""
