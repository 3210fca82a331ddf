"""Kombu's Redis transport with fewer round trips on the request path; same wire format.

Kombu's Redis channel builds a new ``redis.Redis`` object for every publish
and every acknowledgement bookkeeping step (``Channel.conn_or_acquire``); the
connections come from the channel's pool either way, but redis-py 8 builds a
table of about 170 response callbacks in each client's constructor. Profiled
on the live path (``python benchmarks/live_overhead.py``), that was about a
fifth of the API's ``send_task`` and sat on the worker's receive path too
(``QoS.append`` runs before a message is handed to the pool).

A ``redis.Redis`` object is safe to share between threads (each command takes
a connection from the pool), so the channel keeps one per pool and builds a
new one only when kombu replaced the pool (reconnect, fork). Selected through
Celery's ``broker_transport`` setting (``workers.app.celery_settings``) for
``redis://`` and ``rediss://`` brokers; wire format and behaviour are kombu's.

:func:`publishes_into` lets the API put a task's ``LPUSH`` into the pipeline
that also writes the request's state, when the broker is the live-state
Redis: one round trip instead of two per request, and the state is always
written before the message can be taken (a pipeline runs in order).

:class:`PipelinePublisher` is the API's publish for that case. Celery's
``send_task`` routes the options, reads a dozen settings through its layered
config, acquires a producer from the pool and re-binds the queue entity for
``maybe_declare`` on every call: about 60 % of its CPU time when the message
only goes into a pipeline. The publisher calls the two steps that make the
message, Celery's ``amqp.create_task_message`` and ``amqp.send_task_message``,
with a producer per thread and the queue declared once per process; the
message on the wire is the one ``send_task`` writes
(``tests/test_live_transport.py`` compares them).

On the worker, the late-ack bookkeeping of a received message (kombu keeps a
copy in the ``unacked`` hash so an unacknowledged message comes back after
the visibility timeout) is written *after* the message is handed to Celery
instead of before: the pool thread starts the task while that round trip is
in flight, which took it off the time to first token. The in-memory record
comes first as before, and an ack or reject of the message waits until its
copy is written, so it can never leave an orphan copy behind (which would
come back as a duplicate after the visibility timeout).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

_into = threading.local()


@contextmanager
def publishes_into(pipeline: Any) -> Iterator[None]:
    """Publishes this thread makes inside the block are appended to ``pipeline``
    (a redis-py pipeline on the broker's own server and database) instead of
    being sent; they reach the broker when the caller executes it."""
    prev = getattr(_into, "pipe", None)
    _into.pipe = pipeline
    try:
        yield
    finally:
        _into.pipe = prev


class _Copy:
    """A received message whose Redis copy is not written yet."""

    __slots__ = ("thread", "written", "settled")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.written = threading.Event()
        self.settled = False  # acked or rejected by its own consumer callback


class QoS(kombu_redis.QoS):
    """kombu's Redis ack emulation, with the Redis copy written after the hand-off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._copying: dict[Any, _Copy] = {}

    def hand_off(self, message: Any, handle: Any) -> Any:
        tag = message.delivery_tag
        copy = self._copying[tag] = _Copy()
        virtual.QoS.append(self, message, tag)  # the in-memory record
        try:
            return handle(message)
        finally:
            try:
                if not copy.settled:
                    self.append(message, tag)  # kombu's: the Redis copy (+ the record again)
            finally:
                self._copying.pop(tag, None)
                copy.written.set()

    def _settle(self, tag: Any, keep_copy: bool) -> None:
        """Before an ack or reject: wait for the copy, or, when the consumer
        callback settles its own message, write it now (``keep_copy``: a
        requeue restores from it) or never."""
        copy = self._copying.get(tag)
        if copy is None or copy.written.is_set():
            return
        if copy.thread != threading.get_ident():
            copy.written.wait(10.0)
            return
        if keep_copy and not copy.settled:
            message = self._delivered.get(tag)
            if message is not None:
                self.append(message, tag)
        copy.settled = True

    def ack(self, delivery_tag: Any) -> None:
        self._settle(delivery_tag, keep_copy=False)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        self._settle(delivery_tag, keep_copy=requeue)
        super().reject(delivery_tag, requeue=requeue)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared: tuple[Any, Any] | None = None  # (pool, client built on it)

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        ret = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        if not no_ack:

            def _callback(raw_message: Any) -> Any:
                return self.qos.hand_off(self.Message(raw_message, channel=self), callback)

            self.connection._callbacks[queue] = _callback
        return ret

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._pool is None and getattr(self.connection, "client", None) is None:
            # kombu restores unacknowledged messages when it closes a channel whose
            # connection was lost; with the connection already closed, building a
            # pool failed with an AttributeError, which no error handler expects
            # and which stopped the worker. A connection error is ignored there,
            # and the messages stay in the unacked index for the restore timer.
            raise redis.ConnectionError("the broker connection is closed")
        pool = self.pool
        shared = self._shared
        if shared is None or shared[0] is not pool:
            shared = self._shared = (pool, self._create_client())
        yield shared[1]

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        pipe = getattr(_into, "pipe", None)
        if (
            pipe is None
            or kwargs.get("_publish_batch") is not None
            or self.global_keyprefix
            or (self._expires and queue in self._expires)
        ):
            super()._put(queue, message, **kwargs)
            return
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        pipe.lpush(key, dumps(message))


class PipelinePublisher:
    """Celery task messages appended to a redis-py pipeline (see the module doc).

    Only for a broker on the pipeline's own Redis server and database, with
    this module's transport: nothing is sent until the caller executes the
    pipeline, so there is no publish retry to configure here."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._local = threading.local()
        self._declared: set[str] = set()
        self._lock = threading.Lock()
        self._conn: Any = None

    def _producer(self) -> Any:
        producer = getattr(self._local, "producer", None)
        if producer is None:
            with self._lock:
                if self._conn is None:
                    self._conn = self.app.connection_for_write()
                # formatting only: publishes go into the caller's pipeline
                channel = self._conn.default_channel
            producer = self._local.producer = self.app.amqp.Producer(channel, auto_declare=False)
        return producer

    def publish(
        self,
        pipeline: Any,
        name: str,
        args: list[Any],
        task_id: str,
        queue: str,
        headers: dict[str, Any] | None = None,
    ) -> None:
        amqp = self.app.amqp
        message = amqp.create_task_message(
            task_id,
            name,
            args,
            {},
            argsrepr="",
            kwargsrepr="",
            ignore_result=None,
            reply_to=self.app.thread_oid,
        )
        producer = self._producer()

        def send(declare: list[Any] | None) -> None:
            with publishes_into(pipeline):
                amqp.send_task_message(
                    producer,
                    name,
                    message,
                    queue=queue,
                    routing_key=queue,
                    declare=declare,
                    retry=False,
                    headers=headers,
                )

        if queue in self._declared:
            send([])
            return
        # the first message to a queue declares it (Celery's default), one thread
        # at a time: the threads share one channel, and its connection pool is small
        with self._lock:
            send([] if queue in self._declared else None)
            self._declared.add(queue)


class Transport(kombu_redis.Transport):
    Channel = Channel


#: the value of Celery's ``broker_transport`` that selects this transport
TRANSPORT_PATH = f"{__name__}:Transport"


def same_database(url_a: str, url_b: str) -> bool:
    """Whether two Redis URLs name the same server and logical database."""
    from redis.connection import parse_url

    def key(url: str) -> tuple[Any, ...]:
        try:
            kw = parse_url(url)
        except ValueError:
            return (url,)
        return (
            url.split(":", 1)[0],
            kw.get("host", "localhost"),
            kw.get("port", 6379),
            kw.get("path"),
            kw.get("db", 0),
            kw.get("username"),
            kw.get("password"),
        )

    return key(url_a) == key(url_b)
