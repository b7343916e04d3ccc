"""tools/arm/count.py: the instructions per element of every kernel loop on every aarch64 table
(``python tools/arm/check.py --count``; docs/benchmarks.md): tools/arm/insn_count.cpp runs one loop
under qemu-user with the instruction-counting plugin tools/arm/insn_plugin.c, over 2^18 and over
2^16 elements; the difference of the counts over the difference of lengths leaves out start-up and
the arrays' filling. Needs what check.py built (build/arm-check/insn_count)."""

import concurrent.futures as cf
import os
import re

from arm_env import QEMU, ROOT, WORK, sh

# (loop of tools/arm/insn_count.cpp, bytes it moves per element: every stream read, and written
# where it is) for --count; the tables and the qemu CPU each runs on
COUNT_LOOPS = [
    ("fp32", 28),
    ("fp32-out", 32),
    ("bf16", 28),
    ("bf16-param", 30),
    ("f16", 28),
    ("mom-bf16", 20),
    ("mom-bf16-bf16", 20),
    ("mom-8bit", 16),
    ("mom-8bit-bf16", 16),
    ("sumsq", 4),
    ("sumsq-bf16", 2),
]
COUNT_TABLES = {
    "scalar": "max,sve=off",
    "neon": "max,sve=off",
    "sve128": "max,sve-max-vq=1",
    "sve256": "max,sve-max-vq=2",
    "sve512": "max,sve-max-vq=4",
}


def count_insns(jobs: int) -> None:
    """Prints, per loop and table, the instructions per element (docs/benchmarks.md): the count of
    a run over 2^18 elements less that of one over 2^16, over the difference."""
    plugin = os.path.join(WORK, "insn_plugin.so")
    r = sh(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-o",
            plugin,
            os.path.join(ROOT, "tools/arm/insn_plugin.c"),
        ]
    )
    if r.returncode:
        raise RuntimeError(f"building the qemu plugin failed:\n{r.stderr}")
    n1, n2 = 1 << 16, 1 << 18

    def one(job):
        table, loop, n = job
        r = sh(
            [
                QEMU,
                "-plugin",
                plugin,
                "-cpu",
                COUNT_TABLES[table],
                os.path.join(WORK, "insn_count"),
                table,
                loop,
                str(n),
            ]
        )
        found = re.search(r"insns (\d+)", r.stderr)
        if r.returncode or not found:
            raise RuntimeError(f"counting {table} {loop}: {r.stdout} {r.stderr}")
        return int(found.group(1))

    jobs_list = [(t, lp, n) for lp, _ in COUNT_LOOPS for t in COUNT_TABLES for n in (n1, n2)]
    with cf.ThreadPoolExecutor(jobs) as ex:
        counts = dict(zip(jobs_list, ex.map(one, jobs_list)))
    print("| loop | bytes/element | " + " | ".join(COUNT_TABLES) + " |")
    print("|---|---" + "|---" * len(COUNT_TABLES) + "|")
    for loop, nbytes in COUNT_LOOPS:
        per = [(counts[(t, loop, n2)] - counts[(t, loop, n1)]) / (n2 - n1) for t in COUNT_TABLES]
        print(f"| {loop} | {nbytes} | " + " | ".join(f"{x:.2f}" for x in per) + " |")
