"""Embedding the executor in an asyncio server: a tiny line protocol over TCP.

A client sends one line of space-separated token ids (the prompt); the server streams
back one line per generated token (``token position``) and ends with ``done REASON``.
The executor is built with ``DeviceExecutor.create`` (start-up and warm-up off the event
loop); each connection opens a sequence (``async with executor.open_sequence()``) and
iterates its generation stream with ``async for`` — no calfsm call blocks the loop. A
semaphore bounds the streams in progress, and the server stops after ``--requests``
connections (it binds 127.0.0.1 only).

``python examples/asyncio_server.py`` serves on a free port and runs its own client,
which sends ``--requests`` prompts at once and prints each answer, plus one one-shot
``executor.generate`` to show the shortcut. Use ``--port`` and ``--serve-only`` to talk
to it yourself (``printf '1 2 3\\n' | nc 127.0.0.1 PORT``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from calfsm import DeviceExecutor, ExecutorConfig, SimDriver, builtin_manifest
from calfsm.errors import CalfsmError
from calfsm.generate.sampling import SamplingParams


async def handle(executor: DeviceExecutor, slots: asyncio.Semaphore, tokens: int,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection: a prompt line in, the tokens out as they come."""
    try:
        line = await reader.readline()
        try:
            prompt = [int(t) for t in line.split()]
        except ValueError:
            writer.write(b"error prompt must be integers\n")
            return
        async with slots:
            try:
                async with executor.open_sequence() as seq:
                    stream = seq.generate(prompt, SamplingParams(max_tokens=tokens))
                    async for event in stream:
                        writer.write(f"{event.token} {event.position}\n".encode())
                        await writer.drain()
                    result = await stream.final()
                writer.write(f"done {result.finish_reason.value}\n".encode())
            except CalfsmError as e:        # refused, or the stream failed: say why
                writer.write(f"error {e.category.value} {e.message}\n".encode())
    finally:
        await writer.drain()
        writer.close()
        await writer.wait_closed()


async def ask(port: int, prompt: list[int]) -> list[str]:
    """A client: send one prompt, read every line until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((" ".join(map(str, prompt)) + "\n").encode())
    await writer.drain()
    lines = [line.decode().strip() async for line in reader]
    writer.close()
    await writer.wait_closed()
    return lines


async def serve(requests: int, tokens: int, port: int, concurrency: int,
                serve_only: bool) -> int:
    manifest = builtin_manifest("tiny")
    executor = await DeviceExecutor.create(SimDriver(manifest), manifest, ExecutorConfig())
    async with executor:
        slots = asyncio.Semaphore(concurrency)
        served = 0
        finished = asyncio.Event()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                             ) -> None:
            nonlocal served
            served += 1
            if served >= requests:
                server.close()              # bounded: no more connections after this one
            try:
                await handle(executor, slots, tokens, reader, writer)
            finally:
                if served >= requests:
                    finished.set()

        server = await asyncio.start_server(on_connect, "127.0.0.1", port)
        bound = server.sockets[0].getsockname()[1]
        print(f"serving on 127.0.0.1:{bound} for {requests} requests", flush=True)
        if serve_only:
            await finished.wait()
        else:
            prompts = [[1 + i, 2 + i, 3 + i] for i in range(requests)]
            answers = await asyncio.gather(*(ask(bound, p) for p in prompts))
            for prompt, lines in zip(prompts, answers):
                print(f"prompt {prompt}: {' '.join(x.split()[0] for x in lines[:-1])} "
                      f"({lines[-1]})")
            once = await executor.generate([7], SamplingParams(max_tokens=4)).final()
            print(f"one-shot generate [7]: {list(once.tokens)} ({once.finish_reason.value})")
        await server.wait_closed()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3, help="connections to serve (3)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per prompt (8)")
    p.add_argument("--concurrency", type=int, default=2, help="streams at once (2)")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--serve-only", action="store_true", help="no built-in client")
    args = p.parse_args(argv)
    return asyncio.run(serve(args.requests, args.tokens, args.port, args.concurrency,
                             args.serve_only))


if __name__ == "__main__":
    sys.exit(main())
