"""Programs as CSV, in the layout ``torch.distributed.pipelining`` reads and writes.

torch's ``PipelineScheduleMulti._dump_csv`` writes one row per rank and one action per cell,
spelled ``<stage><op><micro-batch>`` (``0F0``, ``1I2``, ``1W2``); an empty cell is a step the
rank sits idle. Its lowered schedules also hold communication and resharding actions
(``1SEND_F0``, ``2RECV_B1``, ``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD``), and may fuse a
forward with a backward as ``(0F1;1B0)OVERLAP_F_B``.

fpipe reads all of these. Transfers are implied by a program's data dependencies, so
communication and resharding actions are dropped on import; a fused ``OVERLAP_F_B`` becomes an
:class:`~fpipe.schedules.Overlap` of its forward and backward (its parts in order, paired),
and :func:`to_csv` writes a program's pairs back the same way; empty cells are skipped.

torch has spelt the backward two ways:

* **new** (torch 2.6 and later): ``I`` input-gradient, ``W`` weight-gradient, ``B`` full backward;
* **old** (torch 2.4 and 2.5): ``B`` input-gradient, ``W`` weight-gradient, ``BW`` full backward.

:func:`to_csv` writes the new spelling. A recompute (``R``) has no torch counterpart: it is
written as ``R``, which fpipe reads back but torch does not; apply rematerialisation after
importing instead (:func:`fpipe.schedules.apply_remat`), or export a program without it.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from fpipe.schedules.actions import Action, B, F, I, Overlap, Program, R, W, positive_int

__all__ = ["to_csv", "from_csv", "SPELLINGS"]

#: The accepted values of ``from_csv(..., spelling=...)``.
SPELLINGS = ("auto", "new", "old")

#: Actions torch lowers a schedule into that fpipe implies from the data dependencies.
_IGNORED = frozenset({
    "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_F_RECV_B", "SEND_B_RECV_F", "UNSHARD",
    "RESHARD", "REDUCE_GRAD",
})
_COMPUTE = ("BW", "F", "R", "B", "I", "W")
# Longest names first, so that ``BW`` is not read as ``B`` followed by junk.
_NAMES = "|".join(sorted(_IGNORED | set(_COMPUTE), key=len, reverse=True))
_CELL_RE = re.compile(rf"(\d+)({_NAMES})(\d*)")
_FUSED_RE = re.compile(r"\((.*)\)\s*OVERLAP_F_B")

_NEW = {"F": F, "R": R, "I": I, "W": W, "B": B}
_OLD = {"F": F, "R": R, "B": I, "W": W, "BW": B}


def to_csv(program: Program, path: str | os.PathLike[str] | None = None) -> str:
    """``program`` as CSV text: one row per worker, one action per cell, new spelling.

    With ``path``, the text is also written there. A worker with no actions is an empty row.
    ``from_csv(to_csv(program)) == program`` for every valid program; for an invalid one (a
    ``W`` without its ``I`` reads as the old spelling) pass ``spelling="new"``.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for units in program.units:
        writer.writerow([str(unit) for unit in units])
    text = buffer.getvalue()
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def from_csv(text_or_path: str | os.PathLike[str], n_stages: int | None = None,
             n_microbatches: int | None = None, spelling: str = "auto") -> Program:
    """Read a program from CSV text or a CSV file, one row per worker (blank rows included).

    ``text_or_path`` is a file when it is a path object, or a string without a comma or a line
    break that names an existing file or ends in ``.csv``; any other string is CSV text.

    ``spelling`` is ``"new"``, ``"old"`` or ``"auto"`` (see the module documentation). ``auto``
    reads the old spelling when a ``BW`` appears, or a ``W`` with no ``I``, and the new one
    otherwise; a text holding both ``BW`` and ``I`` fits neither and is a ValueError.

    The stage count defaults to one more than the largest stage mentioned; the micro-batch
    count to the most micro-batches any stage runs one op on, so that a mistyped index
    (``3F8`` among eight micro-batches) is a ValueError naming it and its cell, as is any
    index beyond counts that are given. The result is not validated otherwise: call
    :func:`fpipe.schedules.validate` to check it.
    """
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling must be one of {', '.join(map(repr, SPELLINGS))}, "
                         f"got {spelling!r}")
    rows = list(csv.reader(io.StringIO(_read(text_or_path))))
    cells = [[(_parse_cell(cell, r, c), bool(_FUSED_RE.fullmatch(cell.strip())))
              for c, cell in enumerate(row)] for r, row in enumerate(rows)]
    ops = {op for row in cells for parsed, _ in row for _, op, _, _ in parsed}
    meaning = _OLD if _spelling(spelling, ops, cells) == "old" else _NEW
    every = [p for row in cells for parsed, _ in row for p in parsed]
    n_stages = (1 + max((p[0] for p in every), default=0) if n_stages is None
                else positive_int("n_stages", n_stages))
    why = (f"n_microbatches={n_microbatches}" if n_microbatches is not None
           else "the most any stage runs of one op; pass n_microbatches= if there are more")
    n_microbatches = (_microbatches(every) if n_microbatches is None
                      else positive_int("n_microbatches", n_microbatches))
    _check_range(every, n_stages, n_microbatches, why)
    workers = [[_unit(parsed, meaning, fused) for parsed, fused in row if parsed]
               for row in cells]
    return Program(workers, n_stages, n_microbatches)


def _unit(parsed: list[_Parsed], meaning: dict, fused: bool) -> Action | Overlap:
    actions = [Action(stage, meaning[op], mb) for stage, op, mb, _ in parsed]
    if not fused:
        return actions[0]
    if len(actions) != 2 or actions[0].op is not F or actions[1].op not in (B, I):
        raise ValueError(f"{parsed[0][3]}: an OVERLAP_F_B pairs a forward with a backward "
                         f"(B or I), as (0F1;1B0)OVERLAP_F_B, got "
                         f"{' and '.join(map(str, actions))}")
    return Overlap(*actions)


def _microbatches(every: list[_Parsed]) -> int:
    """The micro-batch count a CSV implies: the most micro-batches any stage runs one op on.
    Not the largest index plus one, so that one mistyped index is reported as out of range
    rather than as a whole micro-batch missing from every stage."""
    seen: dict[tuple[int, str], set[int]] = {}
    for stage, op, mb, _ in every:
        seen.setdefault((stage, op), set()).add(mb)
    return max((len(mbs) for mbs in seen.values()), default=1)


def _check_range(every: list[_Parsed], n_stages: int, n_microbatches: int, why: str) -> None:
    for stage, _, mb, where in every:
        if mb >= n_microbatches:
            raise ValueError(f"{where} is out of range: micro-batches are numbered 0 to "
                             f"{n_microbatches - 1} ({why})")
        if stage >= n_stages:
            raise ValueError(f"{where} is out of range: stages are numbered 0 to "
                             f"{n_stages - 1} (n_stages={n_stages})")


def _read(text_or_path: str | os.PathLike[str]) -> str:
    if isinstance(text_or_path, os.PathLike):
        return Path(text_or_path).read_text(encoding="utf-8-sig")
    if not isinstance(text_or_path, str):
        raise TypeError(f"expected CSV text or a path, got {type(text_or_path).__name__}")
    if not any(ch in text_or_path for ch in ",\n\r") and (
            text_or_path.strip().lower().endswith(".csv") or os.path.isfile(text_or_path)):
        return Path(text_or_path).read_text(encoding="utf-8-sig")
    return text_or_path.removeprefix("\ufeff")


#: One compute action of a cell: (stage, op as written, micro-batch, the text it came from).
_Parsed = tuple[int, str, int, str]


def _parse_cell(cell: str, row: int, column: int) -> list[_Parsed]:
    """The compute actions a cell holds: none (empty, communication), one, or a fused pair."""
    text = cell.strip()
    if not text:
        return []
    fused = _FUSED_RE.fullmatch(text)
    if fused:
        return [action for part in fused.group(1).split(";")
                for action in _parse_cell(part, row, column)]
    match = _CELL_RE.fullmatch(text)
    where = f"row {row + 1} (worker {row}), cell {column + 1}"
    if match is None:
        raise ValueError(
            f"cannot read {text!r} at {where}: expected <stage><op><micro-batch> with op one of "
            f"{', '.join(_COMPUTE)} (e.g. '2F0'), a communication action such as '1SEND_F0', "
            f"or an empty cell"
        )
    stage, op, mb = match.groups()
    if op in _IGNORED:
        return []
    if not mb:
        raise ValueError(f"cannot read {text!r} at {where}: a compute action needs a "
                         f"micro-batch, e.g. '{stage}{op}0'")
    return [(int(stage), op, int(mb), f"{text!r} at {where}")]


def _spelling(spelling: str, ops: set[str], cells: list) -> str:
    def first(op: str) -> str:
        return next(p[3] for row in cells for parsed, _ in row for p in parsed if p[1] == op)

    if "BW" in ops and "I" in ops:
        raise ValueError(
            f"the CSV mixes the two spellings of the backward: {first('BW')} is the old full "
            f"backward, {first('I')} the new input-gradient one; write B for the full backward "
            f"and I for the input gradient (new), or BW and B (old)"
        )
    if spelling == "old" and "I" in ops:
        raise ValueError(f"{first('I')} is not in the old spelling, which writes the "
                         f"input-gradient backward as B; use spelling='new' or 'auto'")
    if spelling == "new" and "BW" in ops:
        raise ValueError(f"{first('BW')} is not in the new spelling, which writes the full "
                         f"backward as B; use spelling='old' or 'auto'")
    if spelling == "auto":
        return "old" if "BW" in ops or ("W" in ops and "I" not in ops) else "new"
    return spelling

