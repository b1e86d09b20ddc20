"""Prefect flows over pinrotate_core. Importing this package imports nothing from Prefect."""
