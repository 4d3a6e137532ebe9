"""Serving: engine, scheduler, P/D disaggregation, router, metrics, CLI and HTTP API (issues 6, 7)."""
