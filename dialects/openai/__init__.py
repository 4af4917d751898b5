"""The OpenAI-compatible dialect: validation and passthrough (the canonical form is OpenAI chat)."""
