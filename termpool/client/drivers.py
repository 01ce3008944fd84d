"""The two drivers of the one set of operations (ops.py, pool_ops.py): `blocking` makes Pool,
Run, Lease and Job, `awaitable` AsyncPool, AsyncRun, AsyncLease and AsyncJob.

A driver is a class decorator: each operation of the class becomes a method that runs it
(a plain one or a coroutine), and a class with an _exit becomes a context manager (`with` or
`async with`). One loop, _drive, runs the operations of both; a driver gives it its I/O as
coroutines. The asyncio driver's await httpx.AsyncClient and asyncio.sleep; the blocking
driver's block and return without ever suspending, so a blocking method runs _drive to its
end with one send(), no event loop: the loop, like the protocol, is written once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time

import httpx

from termpool.client.protocol import Call, Hangup, OnCancel, Op

CANCEL_SECONDS = 5.0  # the most an abandoned operation's OnCancel request may take


async def _drive(driver: _Driver, pool, op: Op):
    """Run operation `op` to its end: do each step it yields with the driver's I/O and send
    it the outcome (throw in a transport error); the operation's return value. When its
    caller abandons it (driver.abandoned), the request its last OnCancel named is sent first."""
    on_cancel = None
    try:
        step = next(op)
        while True:
            if isinstance(step, OnCancel):
                on_cancel = step.call
                step = op.send(None)
            elif isinstance(step, Call):
                try:
                    step = op.send(await driver.request(pool._http, pool._request_args(step)))
                except httpx.TransportError as exc:
                    step = op.throw(exc)
            else:
                await (driver.close(pool._http) if isinstance(step, Hangup) else driver.sleep(step))
                step = op.send(None)
    except StopIteration as stop:
        return stop.value
    except driver.abandoned:
        if on_cancel is not None:
            await driver.abandon(pool, on_cancel)
        raise


class _Driver:
    """What a driver gives: `method` (an operation as a method), the names of its
    context-manager methods and its I/O (request, sleep, close)."""

    enter: str
    exit: str
    abandoned: tuple[type[BaseException], ...]  # what abandons an operation under this driver

    def __call__(self, cls: type) -> type:
        # An operation is a public generator method; a pool's job() and lease(), plain
        # methods that do no I/O, stay as they are.
        for name in dir(cls):
            if not name.startswith("_") and inspect.isgeneratorfunction(getattr(cls, name)):
                setattr(cls, name, self.method(getattr(cls, name)))
        if hasattr(cls, "_exit"):
            setattr(cls, self.enter, self.method(cls._enter))
            setattr(cls, self.exit, self.method(cls._exit))
        return cls

    def method(self, op):
        raise NotImplementedError

    async def request(self, http, args: dict) -> httpx.Response:
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    async def close(self, http) -> None:
        raise NotImplementedError

    async def abandon(self, pool, call: Call) -> None:
        """Send `call` for an abandoned operation: best effort, within CANCEL_SECONDS."""
        raise NotImplementedError


def _short(pool, call: Call) -> dict:
    return {**pool._request_args(call), "timeout": CANCEL_SECONDS}


class _Blocking(_Driver):
    enter, exit = "__enter__", "__exit__"
    abandoned = (KeyboardInterrupt,)

    def method(self, op):
        @functools.wraps(op)
        def method(obj, *args, **kwargs):
            driving = _drive(self, obj._pool, op(obj, *args, **kwargs))
            try:
                driving.send(None)
            except StopIteration as done:
                return done.value
            driving.close()  # not reached: none of this driver's I/O suspends
            raise RuntimeError(f"{op.__qualname__} was suspended")

        return method

    async def request(self, http: httpx.Client, args: dict) -> httpx.Response:
        return http.request(**args)

    async def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def close(self, http: httpx.Client) -> None:
        http.close()

    async def abandon(self, pool, call: Call) -> None:
        with contextlib.suppress(httpx.HTTPError):
            pool._http.request(**_short(pool, call))


class _Awaitable(_Driver):
    enter, exit = "__aenter__", "__aexit__"
    abandoned = (asyncio.CancelledError,)
    _sending: set = set()  # abandon's requests still running after a second cancellation

    def method(self, op):
        @functools.wraps(op)
        async def method(obj, *args, **kwargs):
            return await _drive(self, obj._pool, op(obj, *args, **kwargs))

        return method

    async def request(self, http: httpx.AsyncClient, args: dict) -> httpx.Response:
        return await http.request(**args)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def close(self, http: httpx.AsyncClient) -> None:
        await http.aclose()

    async def abandon(self, pool, call: Call) -> None:
        """Shielded: cancelled again meanwhile, the request still goes out (in the background)."""
        sending = asyncio.ensure_future(asyncio.wait_for(pool._http.request(**_short(pool, call)), CANCEL_SECONDS))
        self._sending.add(sending)
        sending.add_done_callback(_forget(self._sending))
        try:
            await asyncio.shield(sending)
        except (asyncio.CancelledError, Exception):
            pass  # best effort: the cancellation that brought us here goes on either way


def _forget(sending: set):
    def done(task: asyncio.Future) -> None:
        sending.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a failure of a best-effort request is no error

    return done


blocking = _Blocking()
awaitable = _Awaitable()
