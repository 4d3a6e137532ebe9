"""`benchmarks/ptx_probe.py` on hand-written PTX: its control-flow scan finds an accumulator
touched while its wgmma group may be in flight (on a loop's back edge too) and nothing once a
wait retires it; `rederive` re-defines a hoisted descriptor right before its wgmma.  ptxas
itself is not needed (the commands that run it are used by hand on dumped kernels)."""

from benchmarks import ptx_probe

_WGMMA = ("\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
          "{%r10,%r11}, %rd5, %rd6, p, 1, 1, 0, 1; }")


def _kernel(body: str) -> str:
    return "\n".join([".visible .entry k()", "{", "\t.reg .b32 \t%r<20>;", "\t.reg .b64 \t%rd<8>;",
                      "\tadd.s64 \t%rd5, %rd1, 2;", *[""] * 45, body, "\tret;", "}"])


def test_the_scan_flags_an_accumulator_read_before_its_wait_and_not_after():
    read_early = _kernel("\n".join([_WGMMA, "\twgmma.commit_group.sync.aligned;", "\tmul.f32 \t%r12, %r10, %r3;",
                                    "\twgmma.wait_group.sync.aligned 0;"]))
    hits = ptx_probe.scan(read_early)
    assert [t for _, t in hits] == ["mul.f32 \t%r12, %r10, %r3;"]
    read_after = _kernel("\n".join([_WGMMA, "\twgmma.commit_group.sync.aligned;", "\twgmma.wait_group.sync.aligned 0;",
                                    "\tmul.f32 \t%r12, %r10, %r3;"]))
    assert ptx_probe.scan(read_after) == []


def test_the_scan_follows_a_loops_back_edge():
    """A group left in flight at the end of the loop body is still in flight at its top."""
    loop = _kernel("\n".join(["$L__BB0_1:", "\tmov.b32 \t%r13, %r11;", _WGMMA, "\twgmma.commit_group.sync.aligned;",
                              "\tsetp.ne.b32 \t%p1, %r1, 0;", "\t@%p1 bra \t$L__BB0_1;",
                              "\twgmma.wait_group.sync.aligned 0;"]))
    assert [t for _, t in ptx_probe.scan(loop)] == ["mov.b32 \t%r13, %r11;"]


def test_a_hoisted_descriptor_is_defined_again_right_before_its_wgmma():
    text, count = ptx_probe.rederive(_kernel(_WGMMA))
    lines = text.split("\n")
    use = next(i for i, t in enumerate(lines) if "wgmma.mma_async" in t)
    assert count == 1 and lines[use - 1] == "\tadd.s64 \t%rd8, %rd1, 2;" and "%rd8, %rd6" in lines[use]
    assert ".reg .b64 \t%rd<9>;" in text
