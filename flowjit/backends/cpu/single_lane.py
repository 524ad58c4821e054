"""Masked stores that let one lane through, written as scalar stores: a workaround for LLVM's x86
code generation.

A kernel's row whose length leaves one element past its last whole vector ends in a masked store
with one lane on (`llvm.masked.store` with a constant mask). When the stored vector is truncated
from wider elements (a bool row of comparisons of int64 values: `argmax(x, 0) < 0` on (40, 9)),
the x86 back end of llvmlite 0.50's LLVM first makes it a truncating masked store, then, seeing one
lane, a scalar store of the wide element: 8 bytes written for one, the last row's 7 past the end of
the output (heap corruption, found by the fuzzer; the generated assembly has
`movq %rdi, 8(%r14,%rsi)` where one byte was due). Such stores are rewritten in the LLVM IR, before
LLVM's passes, as the lane's `extractelement`, its address and a plain store of one element, which
LLVM compiles at the element's width. Stores of more lanes (a `vpmovqb` under a mask) are right and
stay; so do one-lane masked loads, which load their element at its own width.
"""

from __future__ import annotations

import re

# `call void @llvm.masked.store.v8i8.p0(<8 x i8> %65, ptr align 1 %67, <8 x i1> <i1 true, i1 false, ...>)`
_MASKED_STORE = re.compile(
    r"^(?P<indent>\s*)call void @llvm\.masked\.store\.[\w.]+\("
    r"<(?P<lanes>\d+) x (?P<elem>[\w]+)> (?P<value>.+?), ptr (?:align \d+ )?(?P<ptr>%[-\w.$]+), "
    r"<\d+ x i1> <(?P<mask>[^<>]*)>\)\s*$",
    re.MULTILINE,
)


def scalar_stores(llvm_ir: str) -> str:
    """`llvm_ir` with each masked store whose constant mask has one lane on made a scalar store."""
    if "@llvm.masked.store." not in llvm_ir:
        return llvm_ir
    count = 0

    def rewrite(match: re.Match) -> str:
        nonlocal count
        lanes = [entry.strip() for entry in match["mask"].split(",")]
        on = [k for k, entry in enumerate(lanes) if entry == "i1 true"]
        if len(on) != 1 or match["elem"] == "i1" or len(lanes) != int(match["lanes"]):
            return match[0]
        (k,) = on
        n, count = count, count + 1
        indent, elem, vector = match["indent"], match["elem"], f"<{match['lanes']} x {match['elem']}>"
        return (
            f"{indent}%fj.lane{n} = extractelement {vector} {match['value']}, i64 {k}\n"
            f"{indent}%fj.addr{n} = getelementptr {elem}, ptr {match['ptr']}, i64 {k}\n"
            f"{indent}store {elem} %fj.lane{n}, ptr %fj.addr{n}, align 1"
        )

    return _MASKED_STORE.sub(rewrite, llvm_ir)
