"""``thunderagent request``: one request, tokens streamed to stdout, usage at the end."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from thunderagent.client.client import ThunderClient
from thunderagent.schemas import ErrorReply, FinalReply, GenerateRequest, TokenChunk


async def _run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        request = GenerateRequest(
            model=args.model,
            text=prompt,
            max_tokens=args.max_tokens,
            priority=args.priority,
            lora_name=args.lora,
            cache_salt=args.cache_salt,
            stream=not args.json,  # --json prints one reply: the final one, holding the text
        )
    except (ValueError, msgspec.ValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        client = await ThunderClient.connect(args.nats, idle_timeout_s=args.timeout)
    except ConnectionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    try:
        async for reply in client.stream(request):
            code = _print_reply(reply, args.json)
            if code is not None:
                return code
        return 1
    finally:
        await client.close()


def _print_reply(reply: TokenChunk | FinalReply | ErrorReply, as_json: bool) -> int | None:
    """Print one reply; the exit code once the stream has ended (final or error), else None."""
    if isinstance(reply, TokenChunk):
        if not as_json:
            sys.stdout.write(reply.text)
            sys.stdout.flush()
    elif isinstance(reply, FinalReply):
        if as_json:
            print(msgspec.json.encode(reply).decode())
        else:
            u = reply.usage
            print(
                f"\n[{reply.worker_id}] prompt {u.prompt_tokens} tokens "
                f"({u.cached_tokens} cached), {u.completion_tokens} generated, "
                f"TTFT {reply.ttft_ms:.1f} ms, total {reply.e2e_ms:.1f} ms"
            )
        return 0
    elif isinstance(reply, ErrorReply):
        if as_json:
            print(msgspec.json.encode(reply).decode())
        print(f"error: {reply.code.value}: {reply.message}", file=sys.stderr)
        return 1
    return None


def run_request(args: argparse.Namespace) -> int:
    from thunderagent.telemetry import setup_telemetry

    telemetry = setup_telemetry("thunderagent-client")
    try:
        return asyncio.run(_run(args))
    finally:
        telemetry.shutdown()  # flushes the client's span when tracing is on
