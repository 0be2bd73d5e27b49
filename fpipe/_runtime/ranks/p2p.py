"""Values between ranks over ``torch.distributed`` point-to-point messages: the links, the
order in which each rank sends, and :class:`RankChannel`, one step's messages on one rank.

**One message per value in steady state.** A value (a pytree's leaves) travels as one byte
buffer: a 64-byte prefix, then its tensor leaves, each at a 64-byte aligned offset. Both ends
keep, per key, what the value looked like at the previous step (tree structure, shapes, dtypes,
non-tensor leaves: its *meta*) and the size the next message for that key will have. Because
the receiver knows that size before the sender has computed anything, it posts the receive
ahead (:data:`DEPTH` per link), and the bytes cross while both ranks compute. Which key comes
next on a link is known too: a rank sends in the order of its program, so both ends derive each
link's sequence of keys from the program (:func:`send_orders`), and the prefix carries the key's
position in it, checked on arrival.

**Shapes may change.** The sender compares each value's meta with the previous step's. Equal
(the steady state): the message holds only the prefix and the leaves. Different (a longer
sequence, an uneven last micro-batch, the first step) and still fitting the announced size: the
pickled meta travels in the same message, before the leaves. Larger than announced: the
announced message says so, and the whole value follows on the link's second group, which only
such messages use, so it can never be taken by a receive posted ahead for a later key. The
prefix also announces the key's size for the next step: the size this one needs, or the
announced one while it is at most twice that, so that lengths varying a little do not
reallocate. Nothing about shapes is frozen and nothing is an error.

**No deadlock, on gloo and on NCCL alike.** Each direction of a pair of ranks has groups of
its own (:mod:`fpipe._runtime.ranks.links`), so no receive ever queues behind a send. Sends
are posted at once and completed at the end of the step, so a host never waits for anyone to
receive; a rank reads the messages from another in the order they were sent (keeping those
that came early) and so waits only for values its own actions need, which the validator's
global order guarantees will come. This is also why sends and receives are not batched with
``batch_isend_irecv``: a batch must stay on one group, which would put the two directions of
a pair on one stream.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fpipe._runtime.autodiff import Value
from fpipe._runtime.ranks.faults import RankFaults
from fpipe._runtime.ranks.header import Header, agreed_by_all
from fpipe._runtime.ranks.links import pair_rank
from fpipe._runtime.ranks.loss import LossBroadcast
from fpipe._runtime.workers import Aborted
from fpipe.errors import PeerError, StageError
from fpipe.schedules.actions import Op

__all__ = ["send_orders", "Routes", "RankChannel", "describe_key", "DEPTH"]

#: Receives kept posted ahead on each incoming link.
DEPTH = 4
_PREFIX = 64  # bytes before the meta or the leaves: the int64 words below, padded
_ALIGN = 64
SAME, META, GROWN = 0, 1, 2  # the message holds: the leaves; the meta, then the leaves; nothing


def send_orders(plan: tuple, owners: Sequence[int], stashes: Sequence[tuple[str, ...]],
                pops: Sequence[tuple[str, ...]], routes: dict) -> dict[tuple[int, int], list]:
    """``{(src, dst): [key, ...]}``: the keys each rank sends to another, in the order it
    sends them, read from the compiled program as the interpreter's handlers send: a forward
    sends its output on, then its stashed skips; a backward (or its input half) of a stage
    after the first sends the output's gradient back, then each popped skip's."""
    orders: dict[tuple[int, int], list] = {}

    def sent(src: int, dst: int, key: tuple) -> None:
        if src != dst:
            orders.setdefault((src, dst), []).append(key)

    last = len(owners) - 1
    for src, actions in enumerate(plan):
        for kind, stage, mb in actions:
            if kind.forward and stage < last:
                sent(src, owners[stage + 1], ("x", stage + 1, mb))
                for name in stashes[stage]:
                    sent(src, owners[routes[name][1]], ("s", name, mb))
            elif kind.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and stage > 0:
                sent(src, owners[stage - 1], ("g", stage - 1, mb))
                for name in pops[stage]:
                    sent(src, owners[routes[name][0]], ("t", name, mb))
    return orders


class _Known:
    """What both ends know of a key after a step: the value's meta, the next size, and where
    the meta's leaves lie in a message without the meta (``layout``: offsets and end, the
    steady state's, worked out once per meta rather than at every message). On a sender whose
    wire is the CPU, ``message`` is the steady message itself, kept from step to step with its
    prefix written and ``views`` of its tensor leaves, so a steady send only copies the leaves
    in: the step's end completed the last send of it (:meth:`RankChannel.flush`), and no one
    else holds it."""

    __slots__ = ("meta", "size", "layout", "message", "views")

    def __init__(self, meta: tuple, size: int, layout: tuple[list, int]) -> None:
        self.meta, self.size, self.layout = meta, size, layout
        self.message: torch.Tensor | None = None
        self.views: list = []


class Routes(NamedTuple):
    """What one rank's messages are at every step of a program, read once from its
    :func:`send_orders` (not at every step): ``positions``, each key this rank sends and its
    place on its link; ``source``, each key it receives and the worker sending it;
    ``incoming``, per worker sending to it, ``(position, key)`` in the order sent."""

    positions: dict
    source: dict
    incoming: dict

    @classmethod
    def of(cls, rank: int, orders: dict) -> Routes:
        return cls({key: i for (src, dst), keys in orders.items() if src == rank
                    for i, key in enumerate(keys)},
                   {key: src for (src, dst), keys in orders.items() if dst == rank
                    for key in keys},
                   {src: tuple(enumerate(keys)) for (src, dst), keys in orders.items()
                    if dst == rank})


class RankChannel:
    """This rank's messages for one step (see the module's docstring): sends posted at once and
    completed by :meth:`flush`; receives posted ahead, read in each link's order, keeping values
    that came early. ``known`` is the pipeline's ``{key: _Known}``, kept from step to step.
    ``rank`` and ``owners`` are workers; ``ranks[w]`` is worker ``w``'s global rank, which the
    messages name and ``torch.distributed`` is given.

    Nothing is exchanged before the step's first message, which :meth:`opened` begins: the
    ``header`` the rank of stage 0 posted without waiting is agreed first (a refusal stops
    this rank's step there, before it sent or received anything), then the ``loss``
    broadcast and the receives are posted. Posting them at the first message, not when the
    step is set up, keeps their host time off the path to the step's first forward."""

    def __init__(self, rank: int, owners: Sequence[int], routes: Routes, links: dict,
                 faults: RankFaults, wire: torch.device, known: dict,
                 ranks: Sequence[int], header: Header | None, loss: LossBroadcast) -> None:
        self.rank, self.owners, self.links, self.faults = rank, owners, links, faults
        self.ranks = ranks
        self.wire, self.known = wire, known
        self.header, self.loss = header, loss
        self.open = False
        self.refused: BaseException | None = None
        self.arrived: dict[tuple, Any] = {}
        self.sending: list[tuple[Any, torch.Tensor, int, tuple]] = []
        self.positions, self.source = routes.positions, routes.source
        # Per incoming link: the keys still to post, and the receives posted (key, buffer, work).
        self.expected = {src: deque(keys) for src, keys in routes.incoming.items()}
        self.posted: dict[int, deque] = {src: deque() for src in self.expected}

    def opened(self) -> BaseException | None:
        """Begin the step's messages, once (see the class docstring); returns what refused
        the step, if anything: a bad input or target (every rank raises it alike, the
        pipeline runs on) or ranks called out of step."""
        if self._agreed() is None and not self.open:
            self._begin()
        return self.refused

    def _agreed(self) -> BaseException | None:
        """The header's outcome, read once: what refused the step, or ``None``."""
        posted, self.header = self.header, None
        if posted is not None:
            try:
                refused = posted.outcome()[2]
            except Exception as exc:  # noqa: BLE001 - raised by the driver, which stops all
                refused = exc
            else:
                refused = None if refused is None else agreed_by_all(refused)
            self.refused = refused
        return self.refused

    def _begin(self) -> None:
        self.open = True
        if self.loss.early and not self.loss.held:
            self.loss.post(None)
        for src in self.expected:
            self._post(src)

    # -- sending -------------------------------------------------------------------------------

    def send(self, leaves: list, src: torch.device, stage: int, key: tuple,
             like: Value | None) -> None:
        dst = self.owners[stage]
        if dst == self.rank:
            self.arrived[key] = leaves if like is None else Value(leaves, like.spec,
                                                                  like.grad_index)
            return
        if not self.open and self._agreed() is not None:
            raise Aborted  # the driver raises the refusal; nothing was sent, nothing known
        meta = (None if like is None else like.spec, None if like is None else like.grad_index,
                tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor)
                      else (None, leaf) for leaf in leaves))
        values, grown = self.links[self.rank, dst]
        known = self.known.get(key)
        if known is not None and known.message is not None and _same(known.meta, meta):
            _fill(known.views, leaves)  # the steady state: the kept message, refilled
            self._isend(known.message, dst, values, key)
        else:
            self._send_new(leaves, dst, key, meta, known, values, grown)
        if not self.open:  # the step's first message is out: now the rest of its begin
            self._begin()

    def _send_new(self, leaves: list, dst: int, key: tuple, meta: tuple, known: _Known | None,
                  values: Any, grown: Any) -> None:
        """A message made for this send: the first of a key, a changed meta, or a wire whose
        steady messages are not kept (see :class:`_Known`)."""
        announced = _PREFIX if known is None else known.size
        if known is not None and _same(known.meta, meta):
            blob, layout = b"", known.layout
            offsets, end = layout
        else:
            blob, layout = pickle.dumps(meta), _layout(meta[2], _PREFIX)
            offsets, end = _layout(meta[2], _aligned(_PREFIX + len(blob)))
        steady = layout[1]
        following = announced if steady <= announced <= 2 * steady else steady
        known = self.known[key] = _Known(meta, following, layout)
        position = self.positions[key]
        if end <= announced:
            message, views = _packed(announced, self.wire, (META if blob else SAME, position,
                                                            len(blob), following), blob,
                                     offsets, leaves)
            if not blob and self.wire.type == "cpu":  # kept: see _Known. (Its meta as known,
                # so is its size: ``following`` equals ``announced`` and every later send.)
                known.message, known.views = message, views
            self._isend(message, dst, values, key)
            return
        notice = torch.zeros(announced, dtype=torch.uint8, device=self.wire)
        notice[:40].view(torch.int64).copy_(torch.tensor([GROWN, position, len(blob),
                                                          following, end]))
        self._isend(notice, dst, values, key)
        message, _ = _packed(end, self.wire, (META, position, len(blob), following), blob,
                             offsets, leaves)
        self._isend(message, dst, grown, key)

    def _isend(self, message: torch.Tensor, dst: int, group: Any, key: tuple) -> None:
        try:
            work = group.send([message], pair_rank(self.ranks[self.rank], self.ranks[dst]), 0)
        except Exception as exc:  # the connection to ``dst`` is gone
            dst = self.ranks[dst]
            self.faults.failure_from(dst, f"rank {dst} to take {describe_key(key)}",
                                     _stage(key), key[2], exc)
            raise Aborted from None
        self.sending.append((work, message, dst, key))

    def flush(self) -> None:
        """Complete every send of the step (their receivers have them by now or soon)."""
        for work, _, dst, key in self.sending:
            dst = self.ranks[dst]
            self.faults.wait(work, lambda dst=dst, key=key: f"rank {dst} to take "
                                                            f"{describe_key(key)}",
                             dst, _stage(key), key[2])
        self.sending.clear()

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, key: tuple, device: torch.device) -> Any:
        if not self.open and self.opened() is not None:
            raise Aborted  # the driver raises the refusal
        while key not in self.arrived:
            self._read_next(self.source[key], key)
        value = self.arrived.pop(key)
        leaves = value.leaves if isinstance(value, Value) else value
        moved = [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return moved if not isinstance(value, Value) else Value(moved, value.spec,
                                                                value.grad_index)

    def _post(self, src: int) -> None:
        """Keep :data:`DEPTH` receives posted on the link from ``src``, each of the size
        announced for its key."""
        expected, posted = self.expected[src], self.posted[src]
        while expected and len(posted) < DEPTH:
            position, key = expected.popleft()
            known = self.known.get(key)
            buffer = torch.empty(_PREFIX if known is None else known.size, dtype=torch.uint8,
                                 device=self.wire)
            posted.append((position, key, buffer, self._irecv(buffer, src, 0, key)))

    def _irecv(self, buffer: torch.Tensor, src: int, which: int, key: tuple) -> Any:
        try:
            return self.links[src, self.rank][which].recv(
                [buffer], pair_rank(self.ranks[self.rank], self.ranks[src]), 0)
        except Exception as exc:  # the connection to ``src`` is gone
            src = self.ranks[src]
            self.faults.failure_from(src, f"{describe_key(key)} from rank {src}", _stage(key),
                                     key[2], exc)
            raise Aborted from None

    def _wait(self, work: Any, src: int, key: tuple, awaited: tuple) -> None:
        src = self.ranks[src]
        try:
            self.faults.wait(work, lambda: f"{describe_key(awaited)} from rank {src}", src,
                             _stage(awaited), awaited[2])
        except (StageError, PeerError):
            raise Aborted from None  # the pipeline has recorded it, and stops the step

    def _read_next(self, src: int, awaited: tuple) -> None:
        position, key, buffer, work = self.posted[src].popleft()
        self._wait(work, src, key, awaited)
        flag, sent_at, blob, following, end = buffer[:40].view(torch.int64).tolist()
        if sent_at != position:
            raise RuntimeError(f"fpipe's ranks disagree on the order of their messages: rank "
                               f"{self.ranks[self.rank]} expected message {position} from "
                               f"rank {self.ranks[src]} "
                               f"({describe_key(key)}) but got message {sent_at}")
        if flag == GROWN:
            buffer = torch.empty(end, dtype=torch.uint8, device=self.wire)
            self._wait(self._irecv(buffer, src, 1, key), src, key, awaited)
            flag = META
        if flag == META:
            meta = pickle.loads(bytes(buffer[_PREFIX:_PREFIX + blob].tolist()))
            layout = _layout(meta[2], _PREFIX)
            offsets, _ = _layout(meta[2], _aligned(_PREFIX + blob))
        else:
            known = self.known[key]
            meta, layout = known.meta, known.layout
            offsets = layout[0]
        self.known[key] = _Known(meta, following, layout)
        self._post(src)
        leaves = [_view(buffer, offset, *leaf) if offset is not None else leaf[1]
                  for offset, leaf in zip(offsets, meta[2])]
        spec, grad_index = meta[0], meta[1]
        self.arrived[key] = leaves if spec is None else Value(leaves, spec, grad_index)


def _same(known: tuple | None, meta: tuple) -> bool:
    """Whether two metas are equal; a non-tensor leaf whose ``==`` is not a plain bool (an
    array, say) counts as changed."""
    try:
        return bool(known == meta)
    except Exception:  # noqa: BLE001 - an odd leaf's comparison: send its meta again
        return False


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(metas: tuple, start: int) -> tuple[list, int]:
    """Each leaf's byte offset (``None`` for a non-tensor leaf) from ``start``, and the end."""
    offsets, end = [], start
    for shape, meta in metas:
        if shape is None:
            offsets.append(None)
            continue
        end = _aligned(end)
        offsets.append(end)
        end += _numel(shape) * meta.itemsize
    return offsets, end


def _numel(shape: tuple) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _packed(size: int, wire: torch.device, words: tuple, blob: bytes, offsets: list,
            leaves: list) -> tuple[torch.Tensor, list]:
    """A message of ``size`` bytes: the prefix words, the meta ``blob``, the tensor leaves;
    and the views of its tensor leaves (``None`` for a leaf that is not a tensor)."""
    message = torch.empty(size, dtype=torch.uint8, device=wire)
    message[:8 * len(words)].view(torch.int64).copy_(torch.tensor(words))
    if blob:
        message[_PREFIX:_PREFIX + len(blob)].copy_(torch.frombuffer(bytearray(blob),
                                                                     dtype=torch.uint8))
    views = [None if offset is None else _view(message, offset, tuple(leaf.shape), leaf.dtype)
             for offset, leaf in zip(offsets, leaves)]
    _fill(views, leaves)
    return message, views


def _fill(views: list, leaves: list) -> None:
    """Copy each tensor leaf into its view (a leaf that requires grad as data only)."""
    for view, leaf in zip(views, leaves):
        if view is not None:
            view.copy_(leaf.detach() if leaf.requires_grad else leaf)


def _view(buffer: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The leaf stored at ``offset`` of ``buffer``: a tensor of its own on the buffer's memory
    (its own version counter, so a stage writing into one leaf is not blamed on another)."""
    leaf = torch.empty(0, dtype=dtype, device=buffer.device)
    return leaf.set_(buffer.untyped_storage(), offset // dtype.itemsize, shape)


def describe_key(key: tuple) -> str:
    kind, where, mb = key
    what = {"x": f"the input of stage {where}", "g": f"the output gradient of stage {where}",
            "s": f"skip {where!r}", "t": f"the gradient of skip {where!r}"}[kind]
    return f"{what}, micro-batch {mb}"


def _stage(key: tuple) -> int | None:
    """The stage a key names (skips are named by their skip name instead)."""
    return key[1] if key[0] in ("x", "g") else None
