#!/usr/bin/env python3
"""FakeLlamaServer: a test double of llama-server for fault injection ONLY.

It answers `--version` and `--help` like llama-server and serves /health, /v1/chat/completions (stream and not)
and /slots with canned text. FAKE_ENGINE_MODE picks the fault:
  ok               behave
  never_healthy    /health stays 503 forever
  crash_mid_stream exit(3) after sending 3 stream chunks
  crash_on_start   print an error and exit(1) while "loading"
  ignore_sigterm   ignore SIGTERM (must be SIGKILLed)
  think            answer with a <think>…</think> block before the text
A buffered chat answer also carries `fake_received` (the messages it got) and `fake_argv` (its own
command line), so tests can see what Blazar sent and how it spawned the child.
It never stands as proof that a feature works with the real engine.
"""

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_ENGINE_MODE", "ok")

if "--help" in sys.argv:
    print("usage: fake llama-server\n--reasoning-budget N  token budget for thinking\n--lora FNAME\n"
          "--chat-template-file JINJA_TEMPLATE_FILE")
    sys.exit(0)
if "--version" in sys.argv:
    print("version: 9999 (build 9999, commit fake)\nbuilt with a test double", file=sys.stderr)
    sys.exit(0)

port = int(sys.argv[sys.argv.index("--port") + 1])
alias = sys.argv[sys.argv.index("--alias") + 1] if "--alias" in sys.argv else "fake"
print(f"fake llama-server: mode={MODE} port={port}", flush=True)
if MODE == "crash_on_start":
    print("error: failed to load model: fake corruption at tensor 7", flush=True)
    sys.exit(1)
if MODE == "ignore_sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

WORDS = ["<think>", "let me ", "think", "</think>", "Hello", " from", " the", " fake", " engine", "."] \
    if MODE == "think" else ["Hello", " from", " the", " fake", " engine", "."]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            if MODE == "never_healthy":
                return self._json(503, {"error": {"message": "Loading model", "code": 503}})
            return self._json(200, {"status": "ok"})
        if self.path == "/slots":
            return self._json(200, [{"id": 0, "is_processing": False}])
        return self._json(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"):
            documents = body.get("documents") or []
            results = [{"index": i, "relevance_score": 1.0 / (1 + i)} for i in range(len(documents))]
            return self._json(200, {"model": alias, "object": "list", "results": results,
                                    "usage": {"prompt_tokens": 3, "total_tokens": 3}, "fake_path": self.path})
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": f"fake has no {self.path}", "code": 404}})
        delay = float(body.get("fake_delay", 0.05))
        if not body.get("stream"):
            time.sleep(delay * len(WORDS))
            # What Blazar sent and how it started this child, for tests of Blazar's own translation.
            return self._json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": alias,
                                    "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant", "content": "".join(WORDS)}}],
                                    "fake_received": body.get("messages"), "fake_argv": sys.argv[1:]})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for index, word in enumerate(WORDS):
            if MODE == "crash_mid_stream" and index == 3:
                os._exit(3)
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": alias,
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(delay)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
