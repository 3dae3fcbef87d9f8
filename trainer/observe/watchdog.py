"""Hang watchdog: a collective or step phase that does not finish in time ends the job with a diagnosis.

The main thread only notes which phase of which step it enters (``enter``: two attribute writes and a counter).
A daemon thread per rank publishes that progress every ``monitor.heartbeat_s`` to the rendezvous TCPStore (its
own client connection) and checks its own phase's age. Every rank passes through the same sequence of phases,
so the sequence number says who is behind: when a phase outlasts ``monitor.hang_timeout_s``, the first rank to
notice claims the hang in the store and names the ranks that did not arrive (a lower sequence number, with the
phase and step they are stuck in) and the ranks that stopped publishing (process gone or frozen). Every live rank
that sees the claim dumps the Python stacks of all its threads (faulthandler) into its log; then the claiming
rank writes ``failure.json`` and a ``hang`` history event and every rank exits with status EXIT_HANG, which the
launcher does not requeue. Nothing here runs in a signal handler.

A collective that fails outright (gloo notices a peer's closed connection) is diagnosed by a roll call
(``diagnose``), so the error names the rank that went away, much sooner than its heartbeats would stop.

A rank that goes silent without a failed collective (its node lost with its link) is caught by heartbeats: rank 0
claims one silent for ``monitor.peer_timeout_s`` like a hang (``_lost_peers``); a rank that cannot reach the store
that long ends too (rank 0's node lost).

The ranks of a node share their first rank's store connections (trainer/observe/noderelay.py): it writes one
heartbeat record for the node and relays roll calls and claims to the others over a private Unix socket; a rank
whose node's first rank goes away or falls silent talks to the store itself from then on.

Every value written to the store is sealed with the launch's secret and every value read is opened
(trainer/parallel/storeseal.py): anything another user wrote (forged, replayed, garbage) is ignored and counted, and
a rank whose keys someone else wrote to or deleted lately is not judged by its heartbeats.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist

from runconfig.schema import MonitorConfig
from rundir import RunDir
from rundir.contract import EVENT_HANG, EXIT_HANG, FAILURE_HANG, append_event, rank_ranges
from trainer.env import RuntimeEnv
from trainer.observe.beats import BeatReader, BeatTable, json_of, listening, peek, read_all, read_beats
from trainer.observe.noderelay import Hub, Spoke, relay_path
from trainer.parallel.storeseal import Seal

HANG_KEY = "hpc/watchdog/hang"
REPORTED_KEY = "hpc/watchdog/reported"  # the claiming rank has written failure.json and the hang event
ANSWERS_KEY = "hpc/watchdog/answers"  # how many ranks answered the roll call
ROLL_CALL, CLAIMED, CLOSE = "roll call", "claimed", "close"  # what wakes a rank's answering thread
DETAILED = 8  # ranks a message describes one by one; the others by their ranges
log = logging.getLogger(__name__)


def answer_window(cfg: MonitorConfig) -> float:
    """Seconds a roll call waits for the live ranks' answers: one heartbeat interval, within 1-5 s (an answer takes
    milliseconds; the margin is for a loaded host whose answering thread waits for a core and the GIL)."""
    return min(5.0, max(1.0, cfg.heartbeat_s))


class Watchdog:
    def __init__(
        self,
        env: RuntimeEnv,
        cfg: MonitorConfig,
        rundir: RunDir,
        store_addr: str,
        store_port: int,
        seal: Seal,
        *,
        heartbeats: bool = False,
        memory: Callable[[], dict] | None = None,
        relay: bool = True,
        prefix: str = "",
    ) -> None:
        """``heartbeats``: publish heartbeats even with the hang watchdog off (live metrics read them);
        ``memory``: this rank's memory now, published with each heartbeat; ``relay``: a node's ranks share its
        first rank's store connections (off: each rank holds its own, as bench/scale.py compares)."""
        self.env, self.cfg, self.rundir = env, cfg, rundir
        # When SIGTERM reached this rank (TermWatch): the launcher is ending the step, and from then on ranks end on
        # purpose (on that SIGTERM), so a rank or a store gone is no evidence against its node.
        self.sigterm_at: float | None = None
        self._memory = memory
        self._addr, self._port = store_addr, store_port
        self._prefix = prefix  # a generation's keys (job.spare_ranks): a spare's heartbeats never meet the dead rank's
        self.seal = seal
        self._table: BeatTable | None = None  # rank 0's last opened heartbeat of each rank (made at first read)
        self.seq = 0
        self.phase = "start-up"
        self.step = 0
        self.since = time.time()
        self._stop = threading.Event()
        self._store: dist.TCPStore | None = None
        self._thread = threading.Thread(target=self._run, name="hpc-watchdog", daemon=True)
        self._answerer = threading.Thread(target=self._answer_roll_call, name="hpc-roll-call", daemon=True)
        self._guarder = threading.Thread(target=self._guard, name="hpc-store-guard", daemon=True)
        self.store_ok = time.time()  # the heartbeat thread's last answer from the store
        self.store_error = ""
        self.watching = cfg.hang_timeout_s > 0  # hangs are claimed; else only heartbeats are published
        # silent ranks are claimed (by rank 0); with a keeper (job.spare_ranks) it counts them dead, for a spare
        self.peers = cfg.peer_timeout_s > 0 and env.keeper is None
        self.enabled = self.watching or self.peers or heartbeats
        self.exit: Callable[[int], None] = os._exit  # how the rank ends (bench/scale.py: a simulated rank's threads)
        node = env.topology.node_ranks(env.node)
        self.relayed = relay and len(node) > 1  # the same on every rank: readers look for node records
        self.leader = node[0] if self.relayed else env.rank
        self.direct = env.rank == self.leader  # this rank talks to the store itself (a member: once its hub is gone)
        self.hub: Hub | None = None
        self.spoke: Spoke | None = None
        self._held: set[str] = set()  # rank 0: beat keys that held this launch's value (one gone was deleted)

    # -- main thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.enabled:
            self.store_ok = time.time()
            if self.relayed and self.env.rank == self.leader:
                members = self.env.topology.node_ranks(self.env.node)[1:]
                try:
                    self.hub = Hub(self._relay_path(), members)
                except (OSError, ValueError) as exc:  # the members find no hub and talk to the store themselves
                    log.warning("node %d: no relay for its ranks' heartbeats (%s)", self.env.node, exc)
            self._thread.start()
            self._answerer.start()
            self._guarder.start()

    def enter(self, phase: str, step: int | None = None) -> None:
        """Note the phase the main thread starts (also called from autograd hooks: no locks, no I/O)."""
        self.seq += 1
        self.phase, self.since = phase, time.time()
        if step is not None:
            self.step = step

    def block(self, blocking: bool) -> None:
        """The hierarchical all-reduce hook starts or ends blocking inside the backward pass."""
        self.enter("gradient all-reduce (hierarchical hook)" if blocking else "forward/backward")

    def close(self) -> None:
        """Stop watching (the run is over on this rank); later readers see this rank as finished, not dead.
        Idempotent; with the watchdog off there is nothing to publish."""
        if self._stop.is_set():
            return
        self.enter("finished", self.step)
        self._stop.set()
        if not self.enabled:
            return
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.cfg.heartbeat_s + 5)
        if self.hub is not None:  # the members' last heartbeats go out with the node's record
            self.hub.wait_finished(2 * self.cfg.heartbeat_s + 2)
        if not self.direct and self.spoke is not None and self.spoke.send({"beat": self._beat_dict()}):
            self.spoke.close()  # its reading thread ends
        else:
            with contextlib.suppress(Exception):
                self._publish(self._client())
            with contextlib.suppress(Exception):
                self._set(self._client(), self._call_key(self.env.rank), CLOSE)
        if self._answerer.is_alive():
            self._answerer.join(timeout=2.0)
        if self.hub is not None:
            self.hub.close()
        if any(self.seal.rejected.values()):
            log.warning("rendezvous store: in all, %s ignored (values not written by this launch)", self.seal.counts())

    def diagnose(self, error: BaseException) -> tuple[str, list[dict]]:
        """Why a collective failed: which ranks did not answer a roll call (ended or frozen), as text and as
        suspects for failure.json. Takes ``answer_window`` seconds when a rank is gone, less when all answer."""
        if not self.enabled:
            return "", []
        if self.sigterm_at is not None:  # the launcher's own record names the task that ended first
            return "; SIGTERM had reached this rank before (the launcher was ending the step): no rank is named", []
        window = answer_window(self.cfg)
        try:
            store = self._connect(timedelta(seconds=max(5.0, 2 * window)))  # the heartbeat thread owns _client()
            self._set(store, self._answer_key(self.env.rank), "1")  # alive whatever its answering thread does
            ranks = range(self.env.world_size)
            calls = [self._call_key(r) for r in ranks]
            store.multi_set(calls, [self.seal.seal(key, ROLL_CALL) for key in calls])
            deadline = time.monotonic() + window
            while time.monotonic() < deadline and store.add(ANSWERS_KEY, 0) < self.env.world_size:
                time.sleep(0.05)
            answers = self._get_all(store, [self._answer_key(r) for r in ranks])
            silent = [r for r in ranks if answers[r] != "1"]
            beats = self.beats_of(store, silent) if silent else {}
            silent = [r for r in silent if beats.get(r, {}).get("phase") != "finished"]
        except Exception:
            why = "its rendezvous store became unreachable during a failed collective (rank 0 ended?)"
            return "; the rendezvous store on rank 0's host is unreachable too (rank 0 ended?)", [
                self.env.suspect(0, why)
            ]
        if not silent:
            return "", []
        why = "did not answer the roll call after a collective failed (ended or frozen)"
        text = f"; rank(s) {rank_ranges(silent)} did not answer within {window:g} s (ended or frozen)"
        return text, [self.env.suspect(r, why) for r in silent]

    # -- roll-call thread -------------------------------------------------------------------------------------
    # Every live rank has a second daemon thread blocked in the store's ``wait`` on a key of its own (its own
    # connection, no polling); the failing rank sets all those keys (one ``multi_set``) and each thread answers at
    # once; a rank that has not answered within ``answer_window(cfg)`` has ended or is frozen. A rank that claims a
    # hang wakes them all the same way, to follow the claim. ``close`` wakes the rank's own thread to end it, so
    # that no thread is left blocked on the store of a rank 0 that leaves first.
    def _answer_key(self, rank: int) -> str:
        return f"hpc/watchdog/answer/{rank}"

    def _call_key(self, rank: int) -> str:
        return f"hpc/watchdog/call/{rank}"

    def _set(self, store: dist.TCPStore, key: str, value: str) -> None:
        store.set(key, self.seal.seal(key, value))

    def _get(self, store: dist.TCPStore, key: str) -> str | None:
        """The launch's value under ``key``, or None (none there, or one that someone else wrote: counted)."""
        return self.seal.open(key, peek(store, key), now=time.time())

    def _get_all(self, store: dist.TCPStore, keys: list[str]) -> list[str | None]:
        """``_get`` of each key, read READ_CHUNK keys a round trip or two (beats.read_all)."""
        now = time.time()
        return [self.seal.open(k, v, now=now) for k, v in zip(keys, read_all(store, keys), strict=True)]

    def _connect(self, timeout: timedelta) -> dist.TCPStore:
        """A client connection of its own; refused at once when nothing listens on the store's port any more (rank 0's
        process gone), where a TCPStore client retries until its timeout (a rank's last writes took 10 s so)."""
        if not listening(self._addr, self._port, min(timeout.total_seconds(), 5.0)):
            raise ConnectionRefusedError(f"nothing listens on {self._addr}:{self._port} (the rendezvous store)")
        store = dist.TCPStore(self._addr, self._port, self.env.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(self._prefix, store) if self._prefix else store

    def _answer_roll_call(self) -> None:
        """Block in the store (on its own connection: no traffic while nothing happens) until this rank's key is
        set: answer a roll call, follow a hang another rank claimed at once (not at the next heartbeat: at 4,096
        ranks the last rank saw a claim 2-4 s after it), or end on ``close``. Ends quietly if the store goes
        away. A node's member reads its hub instead (``_relayed``)."""
        if not self.direct and self._relayed():
            return
        with contextlib.suppress(Exception):
            store = self._connect(timedelta(seconds=max(60.0, 2 * self.cfg.heartbeat_s)))
            key = self._call_key(self.env.rank)
            while True:
                store.wait([key], timedelta(days=30))
                value = self._get(store, key)
                if value == ROLL_CALL:  # once: each answer counts towards ANSWERS_KEY's one roll call
                    self._set(store, self._answer_key(self.env.rank), "1")
                    store.add(ANSWERS_KEY, 1)
                    if self.hub is not None:  # the node's members answer through this rank
                        answered = sorted(self.hub.roll_call(answer_window(self.cfg) / 2))
                        if answered:
                            keys = [self._answer_key(r) for r in answered]
                            store.multi_set(keys, [self.seal.seal(k, "1") for k in keys])
                            store.add(ANSWERS_KEY, len(answered))
                elif value == CLAIMED:
                    claim = json_of(self._get(store, HANG_KEY))
                    if claim is not None and claim["rank"] != self.env.rank:
                        self._follow(store, claim)
                if value is not None:
                    return
                store.delete_key(key)  # someone else's value: wait for the launch's own
                time.sleep(0.05)

    def _relayed(self) -> bool:
        """A member's roll-call thread: answer its hub's roll calls, follow the claims it relays and take the store's
        health from it, until this rank closes (True: done) or the hub goes away or falls silent for three beats
        (False: this rank talks to the store itself from now on)."""
        silence = 3 * self.cfg.heartbeat_s + 2
        try:
            self.spoke = Spoke(self._relay_path(), self.env.rank, max(5.0, 2 * self.cfg.heartbeat_s))
        except OSError as exc:
            return self._go_direct(f"its node's first rank {self.leader} took no connection ({exc})")
        following: float | None = None  # until when this rank waits for the claiming rank's report
        while True:
            try:
                message = self.spoke.recv(silence if following is None else max(0.0, following - time.time()))
            except TimeoutError:
                message = None
            if self._stop.is_set():
                return True
            if following is not None and (message is None or "reported" in message or time.time() > following):
                self.exit(EXIT_HANG)
                return True
            if message is None:
                self.spoke.close()
                return self._go_direct(f"its node's first rank {self.leader} went away or fell silent")
            if "ok" in message:
                self.store_ok = float(message["ok"])
            elif "call" in message:
                self.spoke.send({"answer": 1})
            elif "claim" in message and message["claim"]["rank"] != self.env.rank and following is None:
                log.error("hang declared by another rank: %s", message["claim"]["message"])
                self.dump_stacks()
                self.spoke.send({"dumped": 1})
                following = time.time() + 3 * self.cfg.heartbeat_s + 5

    def _go_direct(self, why: str) -> bool:
        if not self._stop.is_set():
            log.warning("rank %d: %s; it talks to the rendezvous store itself from now on", self.env.rank, why)
        self.direct = True
        # The hub's silence is not the store's: the guard's clock starts again, so this rank has a whole limit to
        # reach the store itself before it takes rank 0's host for gone.
        self.store_ok = max(self.store_ok, time.time())
        return False

    def _relay_path(self):  # noqa: ANN202
        return relay_path(self.seal.token(f"relay/{self.env.launch_id}{self._prefix}"), self.env.node)

    def _wake_all(self, store: dist.TCPStore, claim: dict) -> None:
        """Every other rank's roll-call thread: follow this rank's claim now (one multi-key write; a node's first
        rank relays it to its members)."""
        if self.hub is not None:
            self.hub.send_all({"claim": claim})
        keys = [self._call_key(r) for r in range(self.env.world_size) if r != self.env.rank]
        with contextlib.suppress(Exception):
            store.multi_set(keys, [self.seal.seal(k, CLAIMED) for k in keys])

    # -- watchdog thread --------------------------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"hpc/watchdog/beat/{rank}"

    def _node_key(self, node: int) -> str:
        return f"hpc/watchdog/beat/n{node}"

    def _client(self) -> dist.TCPStore:
        if self._store is None:
            self._store = self._connect(timedelta(seconds=max(5.0, 2 * self.cfg.heartbeat_s)))
        return self._store

    def _beat_dict(self) -> dict:
        beat = {"seq": self.seq, "phase": self.phase, "step": self.step, "since": self.since, "beat": time.time()}
        if self._memory is not None:
            with contextlib.suppress(Exception):
                beat.update(self._memory())
        return beat

    def _beat(self) -> str:
        return json.dumps(self._beat_dict())

    def _publish(self, store: dist.TCPStore) -> None:
        """This rank's heartbeat into the store: with its members' latest, as the node's record, on a hub."""
        if self.hub is None:
            self._set(store, self._key(self.env.rank), self._beat())
            return
        beats = {str(r): b for r, b in self.hub.snapshot().items()}
        beats[str(self.env.rank)] = self._beat_dict()
        self._set(store, self._node_key(self.env.node), json.dumps({"beats": beats}))

    def beats_of(
        self, store: dist.TCPStore, ranks: Iterable[int], found: dict[str, bool] | None = None
    ) -> dict[int, dict]:
        """The latest heartbeat of each of ``ranks`` that this launch wrote: from its node's record, or from the
        rank's own key where that is newer (a rank whose hub went away); ``found`` notes which keys held a value."""
        ranks, wanted = list(ranks), set(ranks)
        found = found if found is not None else {}
        beats = {r: b for r, b in self._records(store, ranks, found) if r in wanted}
        self._own_keys(store, ranks, beats, found)
        return beats

    def _records(self, store: dist.TCPStore, ranks: list[int], found: dict[str, bool]) -> Iterator[tuple[int, dict]]:
        """(rank, beat) from the records of the nodes that hold ``ranks``, parsed one record at a time; a hub's own
        node's from its memory."""
        if not self.relayed:
            return
        nodes = sorted({self.env.topology.node_of(r) for r in ranks})
        if self.hub is not None and self.env.node in nodes:  # this node's are here: none of the store's, or another's
            nodes.remove(self.env.node)
            yield from self.hub.snapshot().items()
            yield self.env.rank, self._beat_dict()
        keys, now = [self._node_key(n) for n in nodes], time.time()
        for key, raw in zip(keys, read_all(store, keys), strict=True):
            found[key] = raw is not None
            record = json_of(self.seal.open(key, raw, now=now))
            yield from ((int(r), b) for r, b in (record or {}).get("beats", {}).items())

    def _own_keys(self, store: dist.TCPStore, ranks: list[int], beats, found: dict[str, bool]) -> None:  # noqa: ANN001
        """Into ``beats`` (a dict or a BeatTable), the beats of ranks that write their own key (their node's record
        has none of theirs, or an old one) where that is newer."""
        stale = time.time() - 2 * self.cfg.heartbeat_s
        if isinstance(beats, BeatTable):
            own = [r for r in ranks if beats.old(r, stale)]
        else:
            own = [r for r in ranks if r not in beats or (beats[r]["phase"] != "finished" and beats[r]["beat"] < stale)]
        if not own:
            return
        absent: set[int] = set()
        for r, beat in read_beats(store, self._key, own, self.seal, absent).items():
            if r not in beats or beat["beat"] > beats[r]["beat"]:
                beats[r] = beat
        found.update((self._key(r), r not in absent) for r in own)

    def reader(self) -> BeatReader:
        """Reads ranks' latest heartbeats on a store connection of its own (for another thread)."""
        connect = lambda: self._connect(timedelta(seconds=max(5.0, 2 * self.cfg.heartbeat_s)))  # noqa: E731
        return BeatReader(connect, self.beats_of)

    def _run(self) -> None:
        started = time.time()  # a rank that never published is silent from here
        while not self._stop.wait(self.cfg.heartbeat_s):
            try:
                if not self.direct:  # relayed (once connected): the store only for a claim of this rank's own
                    if self.spoke is not None:
                        self.spoke.send({"beat": self._beat_dict()})
                    store = None
                else:
                    store = self._client()
                    self._publish(store)
                    claim = json_of(self._get(store, HANG_KEY))  # _wake_all brings it sooner while roll call waits
                    if claim is not None:
                        self._follow(store, claim)
                        return
                seq = self.seq  # before `since`: enter() sets seq first, so a phase that begins now is not claimed
                late = self.watching and self.phase != "finished" and time.time() - self.since > self.cfg.hang_timeout_s
                if late and self._claim(self._client(), seq):
                    return
                if store is None:
                    continue
                self.store_ok = time.time()
                if self.hub is not None:
                    self.hub.send_all({"ok": self.store_ok})
                if self.peers and self.env.rank == 0 and self.phase != "finished" and self._lost_peers(store, started):
                    return
            except Exception as exc:  # the store went away with rank 0 (the guard thread ends this rank in time)
                self._store = None
                self.store_error = str(exc)

    def _guard(self) -> None:
        """End this rank when the store has not answered the heartbeat thread for ``_store_limit()`` s: a store call
        to a frozen or unreachable host can block past its own timeout, so the age of the last answer is watched
        from a thread that makes none."""
        limit = self._store_limit()
        while limit and not self._stop.wait(self.cfg.heartbeat_s):
            silent = time.time() - self.store_ok
            if silent > limit + self.cfg.heartbeat_s and self.phase != "finished" and not self._stop.is_set():
                self.dump_stacks()
                error = f": {self.store_error}" if self.store_error else ""
                self._fail(f"rank {self.env.rank} got no answer from the rendezvous store on rank 0's host for "
                           f"{silent:.0f} s (rank 0's process ended or frozen, its node down or its link lost"
                           f"{error}) while in {self._where()}",
                           [self.env.suspect(0, "its rendezvous store stopped answering")])  # fmt: skip

    def _store_limit(self) -> float:
        """Seconds without the store before this rank ends (0: never): the sooner of the two watches that are on."""
        limits = [
            t for t, on in ((self.cfg.hang_timeout_s, self.watching), (self.cfg.peer_timeout_s, self.peers)) if on
        ]
        return min(limits, default=0.0)

    def _lost_peers(self, store: dist.TCPStore, started: float) -> bool:
        """Rank 0: claim the ranks whose heartbeats stopped ``monitor.peer_timeout_s`` ago (or that never published
        one since this watchdog started); True once claimed. For a node lost with its link: no closed connection
        reaches a peer, and the others would wait in a collective until the scheduler notices. Rank 0's process
        hosts the store, so it reads every rank's beat each interval."""
        now, limit = time.time(), self.cfg.peer_timeout_s
        beats = self._read_beats()
        lost = [
            r
            for r in range(self.env.world_size)
            if r != self.env.rank and (now - started > limit if r not in beats else beats.old(r, now - limit))
        ]
        # Heartbeats that someone else overwrote or deleted lately say nothing about their rank: not judged by them
        # (a rank that is gone in fact stops the collectives, and the hang watchdog names it).
        contested = [r for r in lost if self._contested(r, now - limit)]
        if contested:
            log.warning("rank(s) %s: heartbeats overwritten or deleted by someone else in the last %g s (%s so "
                        "far): not judged by them", rank_ranges(contested), limit, self.seal.counts())  # fmt: skip
            lost = [r for r in lost if r not in contested]
        if not lost:
            return False
        where = "; ".join(_first([
            f"rank {r} (node {self.env.node_names[r]}): " + (
                f"last heartbeat {now - beats[r]['beat']:.0f} s ago, in '{beats[r]['phase']}' of step "
                f"{beats[r]['step']}" if r in beats else "no heartbeat since the launch started"
            )
            for r in lost
        ]))  # fmt: skip
        message = (
            f"rank(s) {rank_ranges(lost)} stopped publishing heartbeats for more than "
            f"monitor.peer_timeout_s={limit:g} s (process ended, node down or link lost): {where}. The other ranks "
            f"end this launch rather than wait in a collective with them."
        )
        why = f"stopped publishing heartbeats for more than {limit:g} s (process ended, node down or link lost)"
        if not self._won_claim(store, message):
            return True
        log.error("%s", message)
        self.dump_stacks()
        # The store lives in this process: the live ranks must see the claim before it goes (else each waits
        # for its guard or for the scheduler's signal, blocked in a collective with the lost ranks).
        self._wait_dumped(store, [r for r in range(self.env.world_size) if r != self.env.rank and r not in lost])
        self._fail(message, [self.env.suspect(r, why) for r in lost], store)
        return True

    def _contested(self, rank: int, since: float) -> bool:
        keys = [self._key(rank), *([self._node_key(self.env.topology.node_of(rank))] if self.relayed else [])]
        return any(self.seal.recently_contested(k, since) for k in keys)

    def _wait_dumped(self, store: dist.TCPStore, ranks: list[int]) -> None:
        """Wait until ``ranks`` have seen the claim and dumped their stacks (at most 3 beats + 5 s); this node's
        members say so to its hub."""
        deadline = time.time() + 3 * self.cfg.heartbeat_s + 5
        mine = set(self.hub.connected()) if self.hub is not None else set()
        keys = [f"hpc/watchdog/dumped/{r}" for r in ranks if r not in mine]
        while time.time() < deadline:
            if all(self._get_all(store, keys)) and (self.hub is None or mine & set(ranks) <= self.hub.dumped):
                return
            time.sleep(0.2)

    def _where(self) -> str:
        return f"'{self.phase}' of step {self.step}"

    def _read_beats(self) -> BeatTable:
        """Every rank's latest heartbeat that this launch wrote, into the table of each rank's last; a key that held
        one and is gone now was deleted by someone else (the package never deletes one): its last beat stands, and
        the deletion is counted."""
        found: dict[str, bool] = {}
        if self._table is None:
            self._table = BeatTable(self.env.world_size)
        beats, store, ranks = self._table, self._client(), list(range(self.env.world_size))
        for r, beat in self._records(store, ranks, found):
            beats.put(r, beat)
        self._own_keys(store, ranks, beats, found)
        now = time.time()
        for key, there in found.items():
            if there:
                self._held.add(key)
            elif key in self._held:  # no value at all, each read (a refused one is counted as what it was)
                self.seal.note_deleted(key, now)
        return beats

    def _silent(self, beats: BeatTable) -> list[int]:
        now, limit = time.time(), 3 * self.cfg.heartbeat_s
        return [r for r in range(self.env.world_size) if beats.old(r, now - limit)]

    def _claim(self, store: dist.TCPStore, seq: int) -> bool:
        """Declare the hang this rank found in its phase number ``seq``: unless that phase ended meanwhile (reading
        the beats takes a while on a loaded host), which is a slow phase, not a hang. True once the hang is handled."""
        beats = self._read_beats()
        now = time.time()
        if self.seq != seq:
            log.warning("phase %s took longer than monitor.hang_timeout_s=%g s, but ended", self._where(),
                        self.cfg.hang_timeout_s)  # fmt: skip
            return False
        silent = self._silent(beats)
        live = {r: b for r, b in beats.items() if r not in silent and b["phase"] != "finished"}
        ahead = max((b["seq"] for b in live.values()), default=self.seq)
        behind = sorted(r for r, b in live.items() if b["seq"] < ahead)
        waiting = sorted(r for r, b in live.items() if b["seq"] == ahead)
        parts = []
        if waiting and (behind or silent):
            b = live[waiting[0]]
            parts.append(
                f"rank(s) {rank_ranges(waiting)} waited {now - b['since']:.0f} s in '{b['phase']}' of step {b['step']}"
            )
        parts += _first([f"rank {r} ({self.env.hosts[r]}) did not arrive: still in '{live[r]['phase']}' of step "
                         f"{live[r]['step']} for {now - live[r]['since']:.0f} s" for r in behind])  # fmt: skip
        if len(behind) > DETAILED:
            parts.append(f"rank(s) {rank_ranges(behind)} did not arrive")
        if silent:
            parts.append(f"rank(s) {rank_ranges(silent)} stopped publishing heartbeats (ended or frozen)")
        if not parts:
            b = live.get(self.env.rank) or json.loads(self._beat())
            parts.append(f"all ranks are in '{b['phase']}' of step {b['step']} for {now - b['since']:.0f} s: the "
                         "collective itself does not complete (network or communication library)")  # fmt: skip
        message = (
            f"hang: a step phase did not finish within monitor.hang_timeout_s={self.cfg.hang_timeout_s:g} s: "
            + "; ".join(parts)
            + f". Python stacks of every live rank are in {self.rundir.logs}/rank_*.log."
        )
        suspects = [self.env.suspect(r, f"did not arrive in '{live[r]['phase']}' of step {live[r]['step']}")
                    for r in behind]  # fmt: skip
        suspects += [self.env.suspect(r, "stopped publishing heartbeats (ended or frozen)") for r in silent]
        if not self._won_claim(store, message):
            return True  # another rank claimed it first
        log.error("%s", message)
        self.dump_stacks()
        self._wait_dumped(store, [r for r in live if r != self.env.rank])
        self._fail(message, suspects, store)
        return True

    def _won_claim(self, store: dist.TCPStore, message: str) -> bool:
        """Claim the hang for this rank (the first claim wins), or follow the rank that claimed it first. A value
        under the key that this launch did not write is no claim: overwritten."""
        # The claim names this rank: two ranks that compose the same message must not both think they won it.
        claim = json.dumps({"rank": self.env.rank, "message": message})
        sealed = self.seal.seal(HANG_KEY, claim)
        found = store.compare_set(HANG_KEY, "", sealed)  # a missing key is set: the first claim wins
        if found != sealed.encode():
            other = json_of(self.seal.open(HANG_KEY, found, now=time.time()))
            if other is not None:
                self._follow(store, other)
            store.set(HANG_KEY, sealed)
        self._wake_all(store, json.loads(claim))
        return True

    def _follow(self, store: dist.TCPStore, claim: dict) -> None:
        log.error("hang declared by another rank: %s", claim["message"])
        if self.hub is not None:
            self.hub.send_all({"claim": claim})
        self.dump_stacks()
        with contextlib.suppress(Exception):
            self._set(store, f"hpc/watchdog/dumped/{self.env.rank}", "1")
        if self.hub is not None:  # the members' acknowledgements, as their keys
            dumped = sorted(self.hub.wait_dumped(2.0, skip={claim["rank"]}))
            keys = [f"hpc/watchdog/dumped/{r}" for r in dumped]
            with contextlib.suppress(Exception):
                if keys:
                    store.multi_set(keys, [self.seal.seal(k, "1") for k in keys])
        # let the claiming rank write the report (at most 3 beats + 5 s), then end
        deadline = time.time() + 3 * self.cfg.heartbeat_s + 5
        with contextlib.suppress(Exception):
            while time.time() < deadline and self._get(store, REPORTED_KEY) is None:
                store.wait([REPORTED_KEY], timedelta(seconds=max(0.1, deadline - time.time())))
                time.sleep(0.05)
        self._end()

    def _end(self) -> None:
        """End this rank after a hang; its members end with it (they wait for the report, or for their hub)."""
        if self.hub is not None:
            self.hub.send_all({"reported": 1})
        self.exit(EXIT_HANG)

    def dump_stacks(self, why: str = "hang watchdog") -> None:
        """Every thread's Python stack into this rank's log (stderr if it cannot be opened), the log flushed first."""
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        path = self.rundir.rank_log(self.env.rank)
        try:
            with open(path, "a") as f:
                f.write(f"--- rank {self.env.rank}: Python stacks of all threads ({why}) ---\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            faulthandler.dump_traceback(all_threads=True)  # to stderr

    def _fail(self, message: str, suspects: list[dict], store: dist.TCPStore | None = None) -> None:
        with contextlib.suppress(OSError):
            self.rundir.write_failure(self.env.rank, message, FAILURE_HANG, suspects)
        with contextlib.suppress(OSError):
            append_event(self.rundir.history, EVENT_HANG, step=self.step, launch=self.env.launch_id, message=message)
        if store is not None:
            with contextlib.suppress(Exception):
                self._set(store, REPORTED_KEY, str(self.env.rank))  # the other ranks may end now
        print(f"error: {message}", flush=True)
        self._end()


def _first(items: list[str], most: int = DETAILED) -> list[str]:
    """At most ``most`` of a message's per-rank details, then how many more (a hang at 4,096 ranks named every
    rank behind in a sentence of its own: 24 KB into failure.json, the history and stdout)."""
    return items if len(items) <= most else [*items[:most], f"and {len(items) - most} more"]
