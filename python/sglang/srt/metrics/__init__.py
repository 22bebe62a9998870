"""Prometheus metrics of the server (see collector.py)."""
