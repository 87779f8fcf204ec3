"""A session's requests as a Perfetto trace (`.pftrace`: protobuf `TracePacket`s, written with the
`perfetto` package's `TraceProtoBuilder`), what `RestClient.export_session_trace` downloads.

Tracks: one for the session, under it one per training model and one per sampling session, and under
each of those one per request (requests of one model wait side by side, so each gets its own track;
they share their parent's name, and the UI draws them as one group). A request's slices:

    <kind> #<n>                 arrival -> answer (the outer slice)
      wait                      arrival -> its clock cycle's start (training) / its first token (sampling)
      cycle <N> (+k tenants)    the cycle it ran in, with the number of other adapters in it (never who)
      generate (+k running)     sampling: first token -> last, with the number of other sample requests of
                                that model running meanwhile (counted from every session's timings)
      answered                  an instant: when its result was stored

A request split across cycles has one `cycle` slice per part. Each slice carries the request id, its
tokens and its outcome as debug annotations.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from ..store.accounting import RequestTiming

SEQUENCE = 1  # every packet is on one writer sequence
BEGIN, END, INSTANT = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END, TrackEvent.TYPE_INSTANT


def _ns(t: float) -> int:
    return int(round(t * 1e9))


@dataclass
class _Event:
    at: float
    kind: int
    track: int
    name: str = ""
    annotations: dict = field(default_factory=dict)


class RunningCounter:
    """How many sample requests of a model ran at some point of an interval, from their (start, end)s."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.starts = sorted(a for a, _ in intervals)
        self.ends = sorted(b for _, b in intervals)

    def overlapping(self, start: float, end: float) -> int:
        return bisect.bisect_right(self.starts, end) - bisect.bisect_left(self.ends, start)


def build_trace(session_id: str, timings: list[RequestTiming], left_out: int,
                sampling_intervals: Callable[[str, float, float], list[tuple[float, float]]]) -> bytes:
    """The trace of `timings` (oldest first; `left_out` older ones did not fit its bound). `sampling_intervals`
    (base model, start, end) gives every sample request's (first token, end) on that model in the window."""
    builder = TraceProtoBuilder()
    uuids = _Tracks(builder)
    root = uuids.track(f"session {session_id}" + (f" (its {left_out} oldest requests left out)" if left_out else ""))
    events: list[_Event] = []
    counters: dict[str, RunningCounter] = {}
    by_request: dict[str, list[RequestTiming]] = defaultdict(list)
    for t in timings:
        by_request[t.request_id].append(t)
    for number, parts in enumerate(by_request.values(), 1):
        first = parts[0]
        label = "training" if first.kind != "sample" else "sampling"
        parent = uuids.track(f"{label} {first.target}", root, key=first.target)
        track = uuids.track(f"{label} {first.target}", parent)
        if first.kind == "sample" and first.base_model not in counters:
            span = [t for t in timings if t.kind == "sample" and t.base_model == first.base_model]
            counters[first.base_model] = RunningCounter(sampling_intervals(
                first.base_model, min(t.arrived_at for t in span), max(t.ended_at or t.arrived_at for t in span)))
        events += _request_events(track, number, parts, counters.get(first.base_model))
    events.sort(key=lambda e: e.at)  # stable: a track's events keep their nesting order at equal times
    for e in events:
        packet = builder.add_packet()
        packet.timestamp = _ns(e.at)
        packet.trusted_packet_sequence_id = SEQUENCE
        packet.track_event.type = e.kind
        packet.track_event.track_uuid = e.track
        if e.kind != END:
            packet.track_event.name = e.name
        for name, value in e.annotations.items():
            note = packet.track_event.debug_annotations.add()
            note.name = name
            if isinstance(value, int):
                note.int_value = value
            else:
                note.string_value = str(value)
    return builder.serialize()


class _Tracks:
    """Track descriptors, one packet each, with a uuid per track."""

    def __init__(self, builder: TraceProtoBuilder):
        self.builder = builder
        self.by_key: dict[str, int] = {}
        self.uuids = itertools.count(1)

    def track(self, name: str, parent: int | None = None, key: str | None = None) -> int:
        """A new track (or, with `key`, the one made before under that key)."""
        if key is not None and key in self.by_key:
            return self.by_key[key]
        uuid = next(self.uuids)
        packet = self.builder.add_packet()
        packet.trusted_packet_sequence_id = SEQUENCE
        if uuid == 1:  # the sequence's first packet: its (empty) incremental state starts here
            packet.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        packet.track_descriptor.uuid = uuid
        packet.track_descriptor.name = name
        if parent is not None:
            packet.track_descriptor.parent_uuid = parent
        if key is not None:
            self.by_key[key] = uuid
        return uuid


def _request_events(track: int, number: int, parts: list[RequestTiming], running: RunningCounter | None) -> list[_Event]:
    """One request's slices, in nesting order: outer begin, wait, its cycles (or generation), answered, outer end."""
    first, last = parts[0], parts[-1]
    notes = {"request_id": first.request_id, "tokens": sum(p.tokens for p in parts), "outcome": last.outcome}
    end = max([last.answered_at or 0.0] + [p.ended_at or p.arrived_at for p in parts])
    out = [_Event(first.arrived_at, BEGIN, track, f"{first.kind} #{number}", notes)]
    begun = parts[0].started_at
    if begun is not None and begun > first.arrived_at:
        out += [_Event(first.arrived_at, BEGIN, track, "wait"), _Event(begun, END, track)]
    for p in parts:
        if p.started_at is None or p.ended_at is None:
            continue
        if p.kind == "sample":
            others = 0 if running is None else max(running.overlapping(p.started_at, p.ended_at) - 1, 0)
            name, extra = f"generate (+{others} running)", {"other_requests_running": others}
        else:
            name, extra = f"cycle {p.cycle} (+{p.co_tenants} tenants)", {"cycle": p.cycle, "other_tenants": p.co_tenants}
        out += [_Event(p.started_at, BEGIN, track, name, {**extra, "tokens": p.tokens}), _Event(p.ended_at, END, track)]
    if last.answered_at is not None:
        out.append(_Event(last.answered_at, INSTANT, track, "answered", {"outcome": last.outcome}))
    out.append(_Event(end, END, track))
    return out
