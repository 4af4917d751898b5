"""Engine programs Blazar runs as children when the engine is a Python library rather than a server:
faster-whisper (speech to text) and piper (text to speech). Each serves loopback HTTP for one model and
is spawned, probed, and stopped like llama-server."""
