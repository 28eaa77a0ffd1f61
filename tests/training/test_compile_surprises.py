"""What a compiled run warns about (parallelisms/parallelize.compile_surprises, printed by the trainer once per
reason): frames dynamo gave up on, unsupported constructs, and every graph break (under CP too: the attention is one
registered op inside the block's graph, parallelisms/cp/op.py)."""
from parallelisms.parallelize import compile_surprises


def _counters(**changes):
    return {"unique_graphs": 1, "frames": 10, "frames_failed": 0, "unimplemented": 0, "graph_breaks": {}, **changes}


def test_a_clean_compiled_run_raises_nothing():
    assert compile_surprises(_counters()) == []


def test_every_break_and_every_failed_frame_is_named():
    lines = compile_surprises(_counters(frames_failed=1, unimplemented=2,
                                        graph_breaks={"data-dependent branch in rope.py": 3,
                                                      "Skip calling: context-parallel attention": 8}))
    assert lines == ["1 frame(s) not compiled (recompile limit or an unsupported construct; they run eagerly)",
                     "2 unsupported construct(s) met by dynamo", "graph break x3: data-dependent branch in rope.py",
                     "graph break x8: Skip calling: context-parallel attention"]
