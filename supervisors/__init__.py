"""The actors of the supervisor tree (see docs/architecture.md)."""
