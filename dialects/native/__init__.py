"""Blazar's own routes: health, discovery, and llama-server's native surfaces."""
