#!/usr/bin/env python3
"""Turns a CUDA source of csrc/cuda into C++ for the CUDA simulator (sim.h).

    rewrite.py SOURCE OUTPUT

(CMakeLists.txt names a .cu's output X.cu.cc, so that the C++ compiler takes it as C++.)

Four rewrites, each of which keeps the line count so that compiler messages and sanitizer reports point at
SOURCE's lines (a #line directive names it):
  - launches: ``kernel<<<grid, block[, smem[, stream]]>>>(args)`` becomes
    ``::mpf_sim::launch(kernel, grid, block[, smem[, stream]])(args)``;
  - ``__shared__ T name[dims];`` becomes a reference to the block's shared slot of that declaration, and
    ``extern __shared__ __align__(A) T name[];`` a pointer to the block's dynamic shared memory;
  - the cp.async inline assembly becomes calls of the simulator's cp.async, and wgmma.cuh's (the warpgroup MMA,
    its fences, commits and waits; mbarriers, TMA copies, setmaxnreg; cluster barriers, remote arrivals and
    multicast copies) calls of the simulator's;
  - a ``const __grid_constant__ T name`` parameter becomes ``const T& name``: read in place, as on the GPU,
    instead of a copy per thread (up to 32 KB each).
Any other ``asm`` or ``__shared__`` left over is an error: the simulator would not know what it does.
"""

from __future__ import annotations

import os
import re
import sys

IDENT = re.compile(r"[A-Za-z0-9_:]")


def _kernel_start(text: str, end: int) -> int:
    """Start of the kernel expression that ends just before ``end`` (an identifier, maybe a template-id)."""
    i = end
    while i > 0 and text[i - 1].isspace():
        i -= 1
    if i > 0 and text[i - 1] == ">":  # template arguments: match the angle brackets backwards
        depth = 0
        while i > 0:
            i -= 1
            c = text[i]
            if c == ">":
                depth += 1
            elif c == "<":
                depth -= 1
                if depth == 0:
                    break
        if depth != 0:
            raise ValueError("unbalanced template arguments before a launch")
    while i > 0 and IDENT.match(text[i - 1]):
        i -= 1
    return i


def rewrite_launches(text: str) -> str:
    out = []
    pos = 0
    while True:
        at = text.find("<<<", pos)
        if at < 0:
            out.append(text[pos:])
            return "".join(out)
        close = text.find(">>>", at)
        if close < 0:
            raise ValueError("a launch without >>>")
        start = _kernel_start(text, at)
        kernel = text[start:at].strip()
        if not kernel:
            raise ValueError("a launch without a kernel expression")
        config = text[at + 3 : close]
        out.append(text[pos:start])
        out.append(f"::mpf_sim::launch({kernel}, {config})")
        pos = close + 3


DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\((?P<align>\d+)\)\s+)?(?P<type>[A-Za-z_][\w\s:]*?)\s+(?P<name>\w+)\s*\[\s*\]\s*;"
)
STATIC_SHARED = re.compile(
    r"__shared__\s+(?:__align__\((?P<align>\d+)\)\s+)?(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>\w+)\s*"
    r"(?P<dims>(?:\[[^\]\n]+\]\s*)*);"
)


def rewrite_shared(text: str) -> str:
    text = DYNAMIC_SHARED.sub(
        lambda m: f"{m['type']}* {m['name']} = ::mpf_sim::dynamic_shared_as<{m['type']}>({m['align'] or 16});", text
    )
    text = STATIC_SHARED.sub(
        lambda m: f"auto& {m['name']} = ::mpf_sim::shared<{m['type']}{m['dims'].strip()}, {m['align'] or 0}>([] {{}});",
        text,
    )
    if "__shared__" in text:
        raise ValueError("a __shared__ declaration the rewriter does not understand")
    return text


ASM = re.compile(r'asm\s+volatile\s*\(\s*"(?P<insn>[^"]*)"(?P<operands>[^;]*)\)\s*;')
OPERAND = re.compile(r'"[a-z]+"\((?P<expr>[^()]*(?:\([^()]*\))?[^()]*)\)')


# wgmma.cuh's warpgroup MMA: one asm statement whose string literals hold several PTX statements (';' inside),
# its accumulators as "+f"(d[i]) operands (or wgmma.cuh's macro of them), then the two descriptors and the
# transposes.
WGMMA = re.compile(r'asm\s+volatile\s*\((?P<body>(?:(?!\)\);|\basm\b).)*?"wgmma\.mma_async(?:(?!\)\);).)*\))\);', re.S)


def _wgmma_call(m: re.Match) -> str:
    body = m["body"]
    shape = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(f16|bf16)\.(f16|bf16)", body)
    acc = re.search(r'"\+f"\((\w+)\[0\]\)', body) or re.search(r"MPF_WGMMA_N\d+_ACC_OPERANDS\((\w+)\)", body)
    descs = re.findall(r'"l"\(([^()]*)\)', body)
    trans = re.findall(r'"n"\(([^()]*)\)', body)
    if not shape or not acc or len(descs) != 2 or len(trans) != 2 or shape[2] != shape[3]:
        raise ValueError("a wgmma.mma_async statement the rewriter does not understand")
    call = (f"::mpf_sim::wgmma_m64nNk16({acc[1]}, {shape[1]}, {descs[0]}, {descs[1]}, {trans[0]}, {trans[1]}, "
            f"{'true' if shape[2] == 'bf16' else 'false'});")
    return call + "\n" * m[0].count("\n")  # the line count stays


def _asm_call(m: re.Match) -> str:
    insn = m["insn"].replace("\\n", "").strip().rstrip(";").strip()
    operands = [o["expr"].strip() for o in OPERAND.finditer(m["operands"])]
    if insn == "":  # a compiler barrier on operands (wgmma.cuh's fence_operand): nothing to simulate
        return " ".join(f"(void)({o});" for o in re.findall(r'"[+=]?[a-z]+"\(([^()]*)\)', m["operands"])) or "(void)0;"
    if insn == "wgmma.fence.sync.aligned":
        return "::mpf_sim::wgmma_fence();"
    if insn == "wgmma.commit_group.sync.aligned":
        return "::mpf_sim::wgmma_commit();"
    if insn == "wgmma.wait_group.sync.aligned %0":
        return f"::mpf_sim::wgmma_wait({operands[0]});"
    if insn == "fence.proxy.async.shared::cta":
        return "::mpf_sim::fence_proxy_async();"
    if insn.startswith("cp.async.cg.shared.global") and insn.endswith(("16, %2", "[%1], 16")):
        dst, src, size = operands if len(operands) == 3 else (*operands, "16")
        inner = re.fullmatch(r"smem_addr\((.*)\)", dst)
        if not inner:
            raise ValueError(f"cp.async destination {dst!r}: expected smem_addr(pointer)")
        return f"::mpf_sim::cp_async_cg16({inner[1]}, {src}, {size});"
    if insn == "mbarrier.init.shared::cta.b64 [%0], %1":
        return f"::mpf_sim::mbar_init({operands[0]}, {operands[1]});"
    if insn == "fence.mbarrier_init.release.cluster":
        return "::mpf_sim::fence_mbarrier_init();"
    if insn == "mbarrier.arrive.shared::cta.b64 _, [%0]":
        return f"::mpf_sim::mbar_arrive({operands[0]}, false, 0);"
    if insn == "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1":
        return f"::mpf_sim::mbar_arrive({operands[0]}, true, {operands[1]});"
    if insn == "{.reg .pred p;mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;selp.u32 %0, 1, 0, p;}":
        out = re.search(r'"=r"\((\w+)\)', m["operands"])
        if not out:
            raise ValueError("mbarrier.try_wait without its output operand")
        return f"{out[1]} = ::mpf_sim::mbar_try_wait_parity({operands[0]}, {operands[1]}) ? 1u : 0u;"
    if insn == ("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[%0], [%1, {%2, %3, %4}], [%5]"):
        return f"::mpf_sim::tma_load_3d({', '.join(operands)});"
    if insn == ("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
                "[%0], [%1, {%2, %3, %4}], [%5], %6"):
        return f"::mpf_sim::tma_load_3d_multicast({', '.join(operands)});"
    if insn == "barrier.cluster.arrive.release":
        return "::mpf_sim::cluster_arrive();"
    if insn == "barrier.cluster.wait.acquire":
        return "::mpf_sim::cluster_wait();"
    if insn == ("{.reg .b32 remote;mapa.shared::cluster.u32 remote, %0, %1;"
                "mbarrier.arrive.shared::cluster.b64 _, [remote];}"):
        return f"::mpf_sim::mbar_arrive_cluster({operands[0]}, {operands[1]});"
    if insn in ("setmaxnreg.dec.sync.aligned.u32 %0", "setmaxnreg.inc.sync.aligned.u32 %0"):
        return f"::mpf_sim::setmaxnreg({operands[0]});"
    if insn == "cp.async.commit_group":
        return "::mpf_sim::cp_async_commit();"
    if insn == "cp.async.wait_group %0":
        return f"::mpf_sim::cp_async_wait({operands[0]});"
    raise ValueError(f"inline assembly the simulator does not know: {insn!r}")


def rewrite_asm(text: str) -> str:
    text = WGMMA.sub(_wgmma_call, text)
    text = ASM.sub(lambda m: _asm_call(m) + "\n" * m[0].count("\n"), text)  # the line count stays
    if re.search(r"\basm\b", text):
        raise ValueError("an asm statement the rewriter does not understand")
    return text


GRID_CONSTANT = re.compile(r"const\s+__grid_constant__\s+(?P<type>[\w:<>]+)\s+(?P<name>\w+)")


def rewrite_grid_constants(text: str) -> str:
    """A __grid_constant__ parameter is read in place, never copied: a const reference to the launch's copy."""
    text = GRID_CONSTANT.sub(lambda m: f"const {m['type']}& {m['name']}", text)
    if "__grid_constant__" in text:
        raise ValueError("a __grid_constant__ parameter the rewriter does not understand")
    return text


def rewrite(text: str) -> str:
    return rewrite_grid_constants(rewrite_asm(rewrite_shared(rewrite_launches(text))))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = argv[1], argv[2]
    with open(src, encoding="utf-8") as f:
        text = f.read()
    try:
        body = rewrite(text)
    except ValueError as e:
        print(f"{src}: {e}", file=sys.stderr)
        return 1
    if body.count("\n") != text.count("\n"):
        print(f"{src}: the rewrite changed the line count", file=sys.stderr)
        return 1
    # Includes by relative path (../kernels.h, ../core/...) resolve against csrc/ on the include path.
    body = re.sub(r'#include "\.\./', '#include "', body)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = dst + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f'#line 1 "{src}"\n')
        f.write(body)
    os.replace(tmp, dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
