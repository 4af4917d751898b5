"""Blazar's own observability and admin routes."""
