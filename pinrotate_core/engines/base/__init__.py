"""What every database engine provides: features, catalog, SQL pieces, gate checks, throttle
signals and the advisory lock. Data types and protocols only: no SQL of any engine here."""
