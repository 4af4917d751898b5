#!/bin/sh
# The same gateway from a shell. Start it first: blazar serve
set -e
curl -s localhost:11434/v1/chat/completions \
  -d '{"model": "smollm2:135m", "max_tokens": 32, "messages": [{"role": "user", "content": "Hello"}]}'
echo
curl -s localhost:11434/api/ps
echo
curl -s localhost:11434/api/quantiles
echo
