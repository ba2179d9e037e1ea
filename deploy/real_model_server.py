#!/usr/bin/env python3
"""Serve a local GGUF model over an OpenAI-compatible HTTP API, with llama.cpp's own server.

Used by deploy/real-model.sh (run it from the venv that has xllamacpp installed):

    .stack/venv/bin/python deploy/real_model_server.py --model .stack/models/X.gguf

Loads the model, starts llama.cpp's HTTP server on 127.0.0.1 (`/v1/chat/completions`,
`/v1/models`, `/health`), waits until `/health` answers, prints exactly one line
`REAL_MODEL_URL=http://127.0.0.1:PORT` on stdout, and stays in the foreground until SIGTERM or
SIGINT (exit 0). The model name clients send is `--alias`.
"""

import argparse
import os
import signal
import sys
import time
import urllib.error
import urllib.request


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="path to the .gguf file")
    ap.add_argument("--alias", default="smollm2", help="model name clients use (default: smollm2)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port, 0 = any free port (default: 0)")
    ap.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default: 4096)")
    ap.add_argument("--threads", type=int, default=1, help="generation threads (default: 1)")
    ap.add_argument("--parallel", type=int, default=1, help="concurrent sequences (default: 1)")
    ap.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /health")
    ap.add_argument(
        "--chat-template-file",
        default=None,
        help="a Jinja chat template to use instead of the model's own (e.g. one with tool support)",
    )
    return ap.parse_args()


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:  # loading (503) or not listening yet
            last = exc
        time.sleep(0.1)
    raise SystemExit(f"real_model_server: {url}/health not ready after {timeout:.0f}s: {last}")


def supports_tools(url: str) -> bool:
    """Whether llama.cpp reports tool support for the loaded chat template (GET /props,
    `chat_template_caps.supports_tools`): what agentloop's /api/models then says."""
    import json  # noqa: PLC0415

    try:
        with urllib.request.urlopen(url + "/props", timeout=5) as resp:
            caps = json.load(resp).get("chat_template_caps") or {}
            return bool(caps.get("supports_tools"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main() -> None:
    args = parse_args()
    if not os.path.isfile(args.model):
        raise SystemExit(f"real_model_server: no model file at {args.model}")

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    import xllamacpp  # noqa: PLC0415 (after argument checks: the import takes a moment)

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.use_jinja = True
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            params.chat_template = f.read()
    params.ui = False
    params.model_alias = {args.alias}  # a set of names (a plain str would become its letters)
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads

    started = time.monotonic()
    server = xllamacpp.Server(params)  # loads the model and starts serving
    url = server.listening_address.rstrip("/")
    if not url.startswith("http"):
        url = "http://" + url
    wait_healthy(url, args.ready_timeout)
    print(
        f"real_model_server: {args.alias} ({os.path.basename(args.model)}) ready in "
        f"{time.monotonic() - started:.1f}s, n_ctx={args.ctx}, threads={args.threads}",
        file=sys.stderr,
        flush=True,
    )
    print(f"REAL_MODEL_TOOLS={'true' if supports_tools(url) else 'false'}", flush=True)
    print(f"REAL_MODEL_URL={url}", flush=True)

    while stop["signal"] is None:
        time.sleep(0.2)
    print(f"real_model_server: signal {stop['signal']}, exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Skip interpreter teardown: the embedded server's threads are not ours to join.
    os._exit(0)


if __name__ == "__main__":
    main()
