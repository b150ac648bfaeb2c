"""Exceptions shared across the CLI and services."""


class NotAvailableError(Exception):
    """Raised by a subcommand that is declared but not built yet (exit status 3)."""
