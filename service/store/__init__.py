"""Durable state: the SQLite job store (queries), its records and its schema migrations, and what is
built directly on it (idempotent submit).
"""
