"""Saves and restores of a hybrid model's cache groups through each group's own ``Rank``.

A hybrid model (``HybridLayout``: full attention beside sliding-window attention or recurrent
state) keeps one ``kvtier.Tier`` per cache group (``HybridTier.group(g)``), so one GPU is one rank
per group (``tier.group(g).attach_cuda(device, group_g_tensors)``). These functions are the glue
that calls every group's ``Rank.save`` / ``Rank.restore`` with that group's keys
(``HybridLayout.group_keys``); which blocks a group needs at a boundary is kvtier's rule
(``HybridLayout.needed``, ``HybridTier.query``), not decided here.

    # after a prefill of `len(keys)` blocks: every full-attention block, the window's blocks
    start, end = layout.needed(1, len(keys))
    tickets = kvtier.hybrid_save(ranks, layout, keys, [(0, full_pages), (start, sliding_pages[start:end])])
    kvtier.hybrid_wait(tickets)
    with tier.query(keys) as lease:             # the longest usable prefix, pinned in every group
        handles = kvtier.hybrid_restore(ranks, lease, [free_full[: len(lease)], free_sliding[: n]])
    kvtier.hybrid_wait(handles)

Every argument is checked before any group's copy is submitted, as ``HybridRank`` does in Rust:
a bad count or length raises and saves or restores nothing.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

from . import errors
from ._kvtier import CopyHandle, HybridLayout, HybridLease, HybridTier, Rank, SaveTicket

__all__ = ["hybrid_save", "hybrid_restore", "hybrid_wait"]

#: One group's pages in a save: ``(first_block, pages)``, ``pages[i]`` (a GPU page id of the
#: group's arenas) holding block ``first_block + i`` of the prefix; ``None`` for nothing.
GroupPages = Optional[Tuple[int, Sequence[int]]]


def _check_count(what: str, given: int, layout_model: str, groups: int) -> None:
    if given != groups:
        raise errors.GeometryMismatchError(
            f"geometry mismatch: {what} for {given} cache groups; {layout_model} has {groups}",
            backend=f"{what} for {given} cache groups",
            tier=f"{layout_model} ({groups} cache groups)",
        )


def hybrid_save(
    ranks: Sequence[Rank],
    layout: HybridLayout,
    keys: Sequence[bytes],
    group_pages: Sequence[GroupPages],
    *,
    after_stream: Any = None,
    after_event: Any = None,
    tier: Optional[HybridTier] = None,
) -> List[Optional[SaveTicket]]:
    """Saves a prefix's blocks in every group, one ``Rank.save`` per group given pages.

    ``ranks[g]``: group ``g``'s rank (attached to ``tier.group(g)``). ``keys``: the prefix's content
    keys (16 ``bytes`` each, one per block, of ``layout.namespace``; not group keys).
    ``group_pages[g]``: ``(first_block, pages)`` or ``None``; for a state group, ``pages[i]`` is the
    checkpoint at boundary ``first_block + i + 1``. ``after_stream`` / ``after_event``: as
    ``Rank.save`` (what the copies wait for: the kernels that wrote the pages). ``tier``: the
    ``HybridTier`` the ranks belong to, for eviction across cache groups: its
    ``settle_evictions()`` runs before each group's save (so the blocks the full-attention
    groups' evictions left unusable go first) and its ``record_save`` after them (the prefix's
    new end keeps its window; the window blocks behind it go first). Without it each group
    evicts by its policy alone.

    Returns one ``SaveTicket`` per group (``None`` where nothing was given), in group order; a
    boundary becomes a hit once every group's blocks it needs are committed (``hybrid_wait``).
    Raises: ``GeometryMismatchError`` (``ranks`` or ``group_pages`` not one per group),
    ``LengthMismatchError`` (a group's blocks run past ``keys``): nothing saved in any group; then
    the errors of ``Rank.save`` for the first group that fails (the groups before it were
    submitted and complete).
    """
    groups = len(layout)
    _check_count("ranks", len(ranks), layout.model, groups)
    _check_count("pages", len(group_pages), layout.model, groups)
    keys = list(keys)
    plans: List[Optional[Tuple[int, List[int]]]] = []
    for item in group_pages:
        if item is None:
            plans.append(None)
            continue
        first, pages = item
        pages = [int(p) for p in (pages.tolist() if hasattr(pages, "tolist") else pages)]
        if first < 0 or first + len(pages) > len(keys):
            raise errors.LengthMismatchError(
                f"{len(keys)} keys but group pages for blocks {first}..{first + len(pages) - 1}: each block needs its key",
                keys=len(keys),
                pages=first + len(pages),
            )
        plans.append((first, pages) if pages else None)
    tickets: List[Optional[SaveTicket]] = []
    ranges: List[Optional[Tuple[int, int]]] = [None] * groups
    try:
        for g, plan in enumerate(plans):
            if plan is None:
                tickets.append(None)
                continue
            first, pages = plan
            gkeys = layout.group_keys(g, keys[first : first + len(pages)])
            if tier is not None:
                tier.settle_evictions()
            tickets.append(ranks[g].save(gkeys, pages, after_stream, after_event=after_event))
            ranges[g] = (first, first + len(pages))
    finally:
        # What the groups submitted brought is recorded, even when a later group's save raised.
        if tier is not None:
            tier.record_save(keys, ranges)
    return tickets


def hybrid_restore(
    ranks: Sequence[Rank],
    lease: HybridLease,
    pages: Sequence[Sequence[int]],
    *,
    after_stream: Any = None,
    after_event: Any = None,
) -> List[Optional[CopyHandle]]:
    """Restores every group's leased blocks, one ``Rank.restore`` per group given pages.

    ``ranks[g]``: group ``g``'s rank. ``lease``: from ``HybridTier.query``. ``pages[g][i]`` (a GPU
    page id of group ``g``'s arenas) receives block ``lease.range(g)[0] + i`` of the prefix; give
    ``len(range(*lease.range(g)))`` pages per group for a restore at ``lease.boundary``. A group
    given no pages is not restored (its lease keeps its use). ``after_stream`` / ``after_event``:
    as ``Rank.restore`` (the last readers of the pages' old contents).

    Returns one ``CopyHandle`` per group (``None`` where nothing was restored): make the compute
    stream wait for each (``handle.stream_wait(stream)``) or ``hybrid_wait`` them.
    Raises: ``GeometryMismatchError`` (``ranks`` or ``pages`` not one per group),
    ``LeaseTooShortError`` (more pages than a group's range): nothing restored in any group; then
    the errors of ``Rank.restore`` for the first group that fails.
    """
    groups = len(lease.ranges)
    _check_count("ranks", len(ranks), "the lease's layout", groups)
    _check_count("pages", len(pages), "the lease's layout", groups)
    plans: List[List[int]] = []
    for g, p in enumerate(pages):
        p = [int(x) for x in (p.tolist() if hasattr(p, "tolist") else p)]
        start, end = lease.range(g)
        if len(p) > end - start:
            raise errors.LeaseTooShortError(
                f"restore asks for {len(p)} pages but the lease holds {end - start} in group {g}",
                asked=len(p),
                held=end - start,
            )
        plans.append(p)
    handles: List[Optional[CopyHandle]] = []
    for g, p in enumerate(plans):
        if not p:
            handles.append(None)
            continue
        handles.append(ranks[g].restore(lease.group(g), p, after_stream, after_event=after_event))
    return handles


def hybrid_wait(items: Sequence[Optional[Union[SaveTicket, CopyHandle]]], timeout: Optional[float] = None) -> bool:
    """Waits for every group's ticket or handle (``None`` entries skipped), each with the GIL
    released; ``timeout`` in seconds per item (None: for good). Returns True once all are
    complete, False if one timed out. Raises the first copy failure in group order, after every
    item has been waited for (the pages of every group may be reused once this returns)."""
    done, first_error = True, None
    for item in items:
        if item is None:
            continue
        try:
            done = item.wait(timeout) and done
        except Exception as e:  # noqa: BLE001  (re-raised below, after the other groups)
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return done
