"""The record format: lossless round trips, atomic publication, clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.record import KINDS, STEP_JOURNAL, Record, RecordError, RecordWriter, optimizer_state_items, split_optim_state_name

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 10 ** draw(st.integers(-8, 8))).to(dtype)
        if t.numel() and draw(st.booleans()):  # records must carry NaN/inf of a wrong run exactly
            t.view(-1)[0] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    else:
        t = torch.randint(-(2**20), 2**20, shape, generator=g).to(dtype)
    return t


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
steps_data = st.lists(
    st.tuples(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.lists(st.integers(0, 10**6), max_size=6),
        st.dictionaries(st.tuples(st.sampled_from(KINDS), names), tensors(), max_size=5),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=steps_data)
def test_round_trip_is_lossless(tmp_path_factory: pytest.TempPathFactory, data: list) -> None:
    path = tmp_path_factory.mktemp("rt") / "record"
    writer = RecordWriter(path, {"source": "test", "case": {"name": "x"}})
    for step, (loss, ids, entries) in enumerate(data):
        rec = writer.step(step)
        rec.loss, rec.sample_ids, rec.micro_losses, rec.micro_sample_ids = loss, ids, [loss], [ids]
        for (kind, name), tensor in entries.items():
            writer.add_tensor(step, kind, name, tensor)
    record = Record.load(writer.finish().path)

    assert record.complete and record.source == "test" and record.num_steps == len(data)
    for step, (loss, ids, entries) in enumerate(data):
        s = record.step(step)
        assert s.loss == loss and s.sample_ids == ids and s.micro_sample_ids == [ids]
        assert {(k, n) for k in KINDS for n in s.names(k)} == set(entries)
        for (kind, name), expected in entries.items():
            got = record.tensor(step, kind, name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
            info = record.info(step, kind, name)
            finite = bool(torch.isfinite(expected).all()) if expected.is_floating_point() else True
            assert info.finite == finite


def test_names_keep_their_order_and_are_file_safe(tmp_path) -> None:
    writer = RecordWriter(tmp_path / "r", {"source": "t"})
    names = ["z.weight", "a/b", "..", "layers.0.w", "ü"]
    for n in names:
        writer.add_tensor(0, "param", n, torch.ones(1))
    record = writer.finish()
    assert record.step(0).names("param") == names
    # Names never become file names: one file holds the step's tensors, whatever they are called.
    assert [f.name for f in (tmp_path / "r" / "steps").iterdir()] == ["0000.bin"]
    assert all(record.tensor(0, "param", n).item() == 1.0 for n in names)


def test_a_view_is_saved_without_its_base(tmp_path) -> None:
    big = torch.zeros(1_000_000)
    writer = RecordWriter(tmp_path / "r", {"source": "t"})
    writer.add_tensor(0, "grad", "w", big[:4])
    record = writer.finish()
    assert (record.path / record.info(0, "grad", "w").file).stat().st_size < 10_000
    assert record.info(0, "grad", "w").nbytes == 16


def test_publication_is_atomic_and_abort_leaves_nothing(tmp_path) -> None:
    writer = RecordWriter(tmp_path / "r", {"source": "t"})
    writer.add_tensor(0, "param", "w", torch.ones(2))
    assert not (tmp_path / "r").exists()  # readers never see half a record
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_incomplete_records_are_kept_and_marked(tmp_path) -> None:
    writer = RecordWriter(tmp_path / "r", {"source": "t"})
    writer.step(0).loss = 1.0
    record = writer.finish(complete=False)
    assert not record.complete and record.num_steps == 1


def test_writer_refuses_bad_input(tmp_path) -> None:
    writer = RecordWriter(tmp_path / "r", {"source": "t"})
    with pytest.raises(RecordError, match="unknown tensor kind 'grads'; allowed: grad, param, optim"):
        writer.add_tensor(0, "grads", "w", torch.ones(1))
    with pytest.raises(RecordError, match="plain full tensors, got list"):
        writer.add_tensor(0, "grad", "w", [1.0])  # type: ignore[arg-type]
    writer.add_tensor(0, "grad", "w", torch.ones(1))
    with pytest.raises(RecordError, match="recorded twice"):
        writer.add_tensor(0, "grad", "w", torch.ones(1))
    writer.step(2)
    with pytest.raises(RecordError, match=r"steps \[0, 2\] are not 0..n-1"):
        writer.finish()
    writer.abort()
    RecordWriter(tmp_path / "done", {"source": "t"}).finish()
    with pytest.raises(RecordError, match="already exists"):
        RecordWriter(tmp_path / "done", {"source": "t"})
    assert RecordWriter(tmp_path / "done", {"source": "u"}, overwrite=True).finish().source == "u"


def test_load_explains_what_is_wrong(tmp_path) -> None:
    with pytest.raises(RecordError, match="meta.json is missing"):
        Record.load(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "harness-record", "version": 99}))
    with pytest.raises(RecordError, match="version 99 is not supported"):
        Record.load(tmp_path)
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(RecordError, match="not valid JSON"):
        Record.load(tmp_path)


def test_optimizer_state_names() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w, b], lr=0.1, momentum=0.9)
    (w.sum() + b.sum()).backward()
    opt.step()
    names = [n for n, _ in optimizer_state_items(opt, [("layer.w", w), ("layer.b", b)])]
    assert names == ["layer.w.momentum_buffer", "layer.b.momentum_buffer"]
    assert split_optim_state_name(names[0]) == ("layer.w", "momentum_buffer")
    # SGD without momentum keeps None buffers: nothing to record.
    plain = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones(3)
    plain.step()
    assert list(optimizer_state_items(plain, [("w", w)])) == []


def test_reports_and_traces_never_write_through_a_planted_link(tmp_path) -> None:
    """A symbolic link planted at a predictable output path is replaced by the new file; the
    file it pointed to is left as it was."""
    import os

    from reference.files import write_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "reports"
    out.mkdir()
    for name in ("report.html", "report.json", "trace.json", ".report.html.tmp"):
        os.symlink(victim, out / name)
    for name in ("report.html", "report.json", "trace.json"):
        write_atomic(out / name, f"new {name}")
        assert not (out / name).is_symlink() and (out / name).read_text() == f"new {name}"
    assert victim.read_text() == "precious"
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "report.html").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_html_json_and_chrome_trace_reports_use_the_link_safe_write(tmp_path) -> None:
    import os

    from cases import mlp_case
    from harness.report.chrome_trace import write_chrome_trace
    from harness.report.html import write_html
    from harness.report.model import build_report
    from harness.targets.target import Target

    case = mlp_case()
    report = build_report(target=Target(name="t", case=case), case=case, nproc=2, error="a run that never finished")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name, write in (("r.html", write_html), ("r.trace.json", write_chrome_trace), ("r.json", type(report).write_json)):
        path = tmp_path / name
        os.symlink(victim, path)
        write(report, path)
        assert not path.is_symlink() and path.stat().st_size > 0, name
    assert victim.read_text() == "precious"


def test_a_checkpoint_costs_the_same_at_every_step_and_reads_back(tmp_path) -> None:
    """A run killed after checkpoints leaves a readable record of the steps done. Each
    checkpoint appends only the new steps (the journal grows by one line a step; meta.json,
    only the header, does not grow), and a journal line cut by the kill is skipped."""
    w = RecordWriter(tmp_path / "r", {"source": "test"})
    staging = w._staging
    header_sizes = []
    for step in range(6):
        w.step(step).loss = float(step)
        w.add_tensor(step, "param", "w", torch.full((3,), float(step)))
        w.checkpoint()
        header_sizes.append((staging / "meta.json").stat().st_size)
        assert len((staging / STEP_JOURNAL).read_text().splitlines()) == step + 1
    assert len(set(header_sizes)) == 1, header_sizes
    partial = Record.load(staging)
    assert not partial.complete and partial.losses == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert torch.equal(partial.tensor(5, "param", "w"), torch.full((3,), 5.0))
    with open(staging / STEP_JOURNAL, "a") as fh:
        fh.write('{"step": 6, "loss"')  # the kill came mid-line
    assert Record.load(staging).num_steps == 6
    finished = w.finish()
    assert finished.complete and finished.num_steps == 6 and Record.load(tmp_path / "r").losses[-1] == 5.0
