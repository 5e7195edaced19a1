"""Proves from the built extension's machine code, on any x86-64 machine (AVX-512 hardware or not), that
the CPU clones use the vector widths of their instruction sets: every hot loop of the avx512 clone has
zmm (512-bit) instructions, the avx2 clone has ymm and no zmm, the baseline clone neither; and that no
clone calls the shared per-element math of csrc/core out of line (a policy's update, a conversion, a
rounding): such a call inside a loop keeps the loop scalar, whatever else it holds.

    python .ci/check_isa_clones.py [path/to/mpfused/_C*.so]     (exit status 1 on a failed check)
"""

import glob
import re
import subprocess
import sys
from pathlib import Path

# The loops that isa_clones.inc compiles per path (function names inside namespace baseline/avx2/avx512).
# A function counts as a hot loop when its symbol names one: the optimizer driver's loops may be compiled
# into visit<..., update_span<...>::lambda> or update_span<...> depending on GCC's inlining.
HOT_LOOPS = ["overflow_span", "update_span", "epilogue", "widen_lines"]
SYMBOL = re.compile(r"^[0-9a-f]+ <(.*)>:$")
CLONE = re.compile(r"::(baseline|avx2|avx512)::(\w+)")
POLICY = re.compile(r"mpf::(\w+Policy)\b")
# A packed FP32 multiply on full-width registers: the arithmetic of a vectorised loop (conversions and
# copies use ymm/zmm too, so counting registers alone would pass a loop left scalar).
PACKED_MUL = {"avx2": re.compile(r"\tvmulps\s.*%ymm"), "avx512": re.compile(r"\tvmulps\s.*%zmm")}


# A call or tail call (binutils before 2.36 print callq/jmpq) and the symbol it names, the last <...> of the
# line (a call through the GOT names it in a comment). A target with an offset (+0x..) is a jump inside a
# function, not a call.
CALL = re.compile(r"\t(?:call|jmp)q?\s.*<([^<>+]+)>\s*$")
# Mangled names: a function of namespace mpf, and one of its anonymous namespace (the clones and the
# backends' own helpers, which are not the shared core).
MPF_SCOPE = re.compile(r"_ZNK?3mpf")
MPF_LOCAL = re.compile(r"_ZNK?3mpf12_GLOBAL__N_1")


def clone_functions(so_path: str):
    """(clone, demangled symbol, instruction lines, the same lines with mangled names) for every function
    of the baseline/avx2/avx512 clones in the extension's machine code (objdump)."""
    def disassemble(*flags):
        return subprocess.run(["objdump", "-d", "--no-show-raw-insn", *flags, so_path], check=True,
                              capture_output=True, text=True).stdout.splitlines()
    current = None
    for line, raw in zip(disassemble("-C"), disassemble(), strict=True):
        m = SYMBOL.match(line)
        if m:
            if current:
                yield current
            c = CLONE.search(m.group(1))
            current = (c.group(1), m.group(1), [], []) if c else None
        elif current is not None and "\t" in line:
            current[2].append(line)
            current[3].append(raw)
    if current:
        yield current


def policy_vector_muls(functions) -> dict[tuple[str, str], int]:
    """(clone, optimizer policy) -> packed multiplies in the functions whose symbols name the policy: every
    policy's update must vectorise on every path (a conditional FP operation in it, e.g., keeps the avx2
    clone scalar while the avx512 one, with masks, vectorises)."""
    muls: dict[tuple[str, str], int] = {}
    for clone, name, lines, _ in functions:
        p = POLICY.search(name)
        if p and clone in PACKED_MUL:
            key = (clone, p.group(1))
            muls[key] = muls.get(key, 0) + sum(1 for line in lines if PACKED_MUL[clone].search(line))
    return muls


def shared_calls(functions) -> tuple[dict[tuple[str, str], int], int]:
    """((clone, callee) -> calls and tail calls from a clone's functions to functions of namespace mpf
    outside its anonymous namespace, all calls counted): the shared core (csrc/core, MPF_HD: forced inline)
    must be inlined into every clone. GCC stops inlining once a translation unit has grown past its limits,
    and then calls a policy's update once per element. The callee's scope is read from its mangled name, so
    template arguments from a clone do not hide a shared function."""
    calls: dict[tuple[str, str], int] = {}
    total = 0
    for clone, _, lines, raw in functions:
        for line, mangled in zip(lines, raw):
            m = CALL.search(mangled)
            if not m:
                continue
            total += 1
            target = m.group(1).split("@")[0]
            if MPF_SCOPE.match(target) and not MPF_LOCAL.match(target):
                callee = line.split(" <", 1)[1].rstrip().removesuffix(">")[:160] if " <" in line else target
                calls[(clone, callee)] = calls.get((clone, callee), 0) + 1
    return calls, total


def register_use(functions) -> dict[tuple[str, str], dict[str, int]]:
    """(clone, function) -> instruction count and counts of those naming ymm / zmm registers."""
    use: dict[tuple[str, str], dict[str, int]] = {}
    for clone, name, lines, _ in functions:
        fn = next((h for h in HOT_LOOPS if h in name), CLONE.search(name).group(2))
        n = use.setdefault((clone, fn), {"insns": 0, "ymm": 0, "zmm": 0})
        n["insns"] += len(lines)
        n["ymm"] += sum("%ymm" in line for line in lines)
        n["zmm"] += sum("%zmm" in line for line in lines)
    return use


def check(so_path: str) -> list[str]:
    """The failed checks (empty when the clones are as they should be)."""
    functions = list(clone_functions(so_path))
    use = register_use(functions)
    problems = []
    for fn in HOT_LOOPS:
        for clone in ("avx2", "avx512"):  # the baseline clone's loops may be inlined into their callers
            if (clone, fn) not in use:
                problems.append(f"{clone}::{fn} not found in {so_path}")
        if use.get(("avx512", fn), {}).get("zmm", 0) == 0:
            problems.append(f"avx512::{fn} has no zmm instruction: GCC kept to 256-bit vectors")
        if use.get(("avx2", fn), {}).get("ymm", 0) == 0:
            problems.append(f"avx2::{fn} has no ymm instruction")
    muls = policy_vector_muls(functions)
    if not muls:
        problems.append("no optimizer policy found in the CPU clones")
    for (clone, policy), n in sorted(muls.items()):
        if n == 0:
            problems.append(f"{clone}: the {policy} update has no packed multiply: its loop did not vectorise")
    calls, total = shared_calls(functions)
    if total == 0:
        problems.append("no call instruction found in the clones: objdump's output was not understood")
    for (clone, callee), n in sorted(calls.items()):
        problems.append(f"{clone}: {n} out-of-line call(s) to {callee}, a function of namespace mpf outside the "
                        "clones (csrc/core's MPF_HD functions must be inlined)")
    for (clone, fn), n in sorted(use.items()):
        if clone != "avx512" and n["zmm"]:
            problems.append(f"{clone}::{fn} uses zmm registers ({n['zmm']} instructions)")
        if clone == "baseline" and n["ymm"]:
            problems.append(f"baseline::{fn} uses ymm registers ({n['ymm']} instructions)")
    return problems


def main() -> int:
    paths = sys.argv[1:] or glob.glob(str(Path(__file__).resolve().parents[1] / "mpfused" / "_C*.so"))
    if len(paths) != 1:
        print(f"expected one built extension, found {paths}", file=sys.stderr)
        return 1
    problems = check(paths[0])
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"ISA clones OK in {Path(paths[0]).name}: {', '.join(HOT_LOOPS)} use zmm in avx512, ymm in avx2; "
              "every optimizer policy's update vectorises on both; no clone calls the shared core out of line")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
