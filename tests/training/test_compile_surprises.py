"""What a compiled run warns about (parallelisms/parallelize.compile_surprises, printed by the trainer once per
reason): frames dynamo gave up on, unsupported constructs, and graph breaks, except the CP attention's own (it runs
eagerly by design, parallelisms/context_parallel.CP_EAGER_REASON)."""
from parallelisms.context_parallel import CP_EAGER_REASON
from parallelisms.parallelize import compile_surprises


def _counters(**changes):
    return {"unique_graphs": 2, "frames": 10, "frames_failed": 0, "unimplemented": 0, "graph_breaks": {}, **changes}


def test_a_clean_compiled_run_and_the_cp_break_raise_nothing():
    assert compile_surprises(_counters()) == []
    assert compile_surprises(_counters(graph_breaks={f"Skip calling: {CP_EAGER_REASON}": 12})) == []


def test_every_other_break_and_every_failed_frame_is_named():
    lines = compile_surprises(_counters(frames_failed=1, unimplemented=2,
                                        graph_breaks={"data-dependent branch in rope.py": 3,
                                                      f"x {CP_EAGER_REASON}": 8}))
    assert lines == ["1 frame(s) not compiled (recompile limit or an unsupported construct; they run eagerly)",
                     "2 unsupported construct(s) met by dynamo", "graph break x3: data-dependent branch in rope.py"]
