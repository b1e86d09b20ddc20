"""The PostgreSQL room. Today it holds the engine's features and SQL pieces; the catalog, write
guards, gate checks and throttle signals still live where they were written (targets.py, drain/,
gate/, throttle/, durability.py) and move here as docs/engines.md plans. Never imports the drain,
gate or flows."""
