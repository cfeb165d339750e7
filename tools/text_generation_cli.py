"""Megatron's interactive client of the text-generation server: ``python tools/text_generation_cli.py HOST:PORT``.

Asks for a prompt and a number of tokens, sends ``PUT /api`` and prints the text (prompt and
generation). ``--prompt TEXT`` sends one request and exits (exit 1 when the server refuses it).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any, Dict, Optional, Sequence


def api_url(server: str) -> str:
    """``HOST:PORT`` (Megatron's form) or a full ``http://`` URL, pointed at ``/api``."""
    url = server if server.startswith(("http://", "https://")) else "http://" + server
    return url if url.rstrip("/").endswith("/api") else url.rstrip("/") + "/api"


def put_api(url: str, body: Dict[str, Any], timeout: float = 600.0) -> Dict[str, Any]:
    """The server's JSON answer; raises ``RuntimeError`` with its message when it refuses the request."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="PUT", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"Error {err.code}: {error_message(err.read())}") from err


def error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")


def generate(url: str, prompt: str, tokens: int, extra: Optional[Dict[str, Any]] = None) -> str:
    """The text (prompt + generation) of one prompt."""
    return put_api(url, {"prompts": [prompt], "tokens_to_generate": tokens, **(extra or {})})["text"][0]


def interactive(url: str) -> None:
    """Megatron's loop: prompt, token count, answer; Ctrl-D or Ctrl-C ends it."""
    while True:
        try:
            prompt = input("Enter prompt: ")
            tokens = int(input("Enter number of tokens to generate: "))
        except (EOFError, KeyboardInterrupt):
            print()
            return
        except ValueError:
            print("the number of tokens must be an integer")
            continue
        try:
            print("Megatron Response: ")
            print(generate(url, prompt, tokens))
        except (RuntimeError, urllib.error.URLError) as err:
            print(err)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", help="HOST:PORT of the server (or its URL)")
    parser.add_argument("--prompt", help="send this prompt once and print the answer (no interaction)")
    parser.add_argument("--tokens-to-generate", type=int, default=32, help="with --prompt (default 32)")
    parser.add_argument("--greedy", action="store_true", help="with --prompt: top_k=1 instead of sampling")
    args = parser.parse_args(argv)
    url = api_url(args.server)
    if args.prompt is None:
        interactive(url)
        return 0
    try:
        print(generate(url, args.prompt, args.tokens_to_generate, {"top_k": 1} if args.greedy else None))
    except (RuntimeError, urllib.error.URLError) as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
