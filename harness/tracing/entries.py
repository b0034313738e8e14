"""The collective entry: one collective as a rank saw it (Flight Recorder's fields plus what the
harness's hooks add). Plain data, torch-free: ranks send it to the launcher inside a
:class:`~harness.launch.protocol.RankDump`, and traces, hang reports and checks read it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CollectiveEntry"]


@dataclass
class CollectiveEntry:
    """One collective as Flight Recorder saw it on a rank."""

    record_id: int
    op: str
    process_group: str
    group_ranks: list[int] | None
    seq_id: int
    p2p_seq_id: int
    input_sizes: list
    state: str
    call_site: str  # first frame outside torch / the harness, "file:line in fn"
    # Added by harness.tracing (Python-side hooks): what Flight Recorder does not record.
    dtypes: list = field(default_factory=list)
    reduce_op: str = ""  # "sum", "avg", ... ("" unknown / not a reduction)
    is_p2p: bool = False
    peer: int | None = None  # global rank of a p2p op's peer (None: any source)
    tag: int = 0
    time_ns: int = 0  # wall clock when issued
    phase: str = ""  # the tracer's phase when issued: "harness" for the harness's own collectives
    step: int | None = None  # the tracer's training step when issued
