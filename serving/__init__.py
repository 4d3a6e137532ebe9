"""Serving: engine, scheduler, P/D disaggregation, router, metrics, CLI and HTTP API."""
