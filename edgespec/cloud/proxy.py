"""A loopback TCP proxy that behaves like a network link: delay and bandwidth, per direction.

Each direction is one shared link: a chunk waits for the link to be free, takes size / bandwidth to
serialise, then arrives rtt / 2 later. Byte order within a connection is kept. For tests and the
cloud bench (`python -m edgespec.cloud.proxy --to 127.0.0.1:8765 --rtt-ms 50 --up-mbit 20`).
Listens on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time


class Link:
    """One direction of the emulated link."""

    def __init__(self, delay_s: float, mbit_s: float | None):
        self.delay_s = delay_s
        self.bytes_per_s = mbit_s * 1e6 / 8 if mbit_s else None
        self.free_at = 0.0
        self.bytes = 0

    def arrival(self, nbytes: int, now: float) -> float:
        self.bytes += nbytes
        if self.bytes_per_s is None:
            return now + self.delay_s
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        return self.free_at + self.delay_s


class LinkProxy:
    """Listen on 127.0.0.1:`port` (0 = any free port) and forward to target_host:target_port."""

    def __init__(self, target_host: str, target_port: int, *, rtt_ms: float = 0.0, up_mbit: float | None = None,
                 down_mbit: float | None = None, port: int = 0):
        self.target = (target_host, target_port)
        self.up = Link(rtt_ms / 2000, up_mbit)      # client -> server
        self.down = Link(rtt_ms / 2000, down_mbit)  # server -> client
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, chunk = await queue.get()
                if chunk is None:
                    break
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                await queue.put((link.arrival(len(chunk), time.monotonic()), chunk))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            await queue.put((0.0, None))
            try:
                await sender
            except (ConnectionError, RuntimeError):
                pass
            try:
                writer.close()
            except Exception:
                pass

    async def _handle(self, client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, server_writer, self.up),
                             self._pipe(server_reader, client_writer, self.down), return_exceptions=True)

    async def _main(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            await self._server.serve_forever()

    def start(self) -> "LinkProxy":
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._main())
            except asyncio.CancelledError:
                pass
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="edgespec-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            for task in asyncio.all_tasks(self._loop):
                self._loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "LinkProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (127.0.0.1)")
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--up-mbit", type=float, default=None)
    parser.add_argument("--down-mbit", type=float, default=None)
    args = parser.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    proxy = LinkProxy(host, int(port), rtt_ms=args.rtt_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit,
                      port=args.port).start()
    print(f"proxy 127.0.0.1:{proxy.port} -> {args.to} (rtt {args.rtt_ms} ms, up {args.up_mbit} Mbit/s, "
          f"down {args.down_mbit} Mbit/s)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
