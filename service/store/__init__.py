"""Durable state: the SQLite job store and what is built directly on it (idempotent submit).
"""
