"""The Ollama-compatible dialect."""
