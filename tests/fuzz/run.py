"""`make fuzz`: random seeds for FUZZ_MINUTES (default 5), every oracle, shrunk reproducers written
to tests/fuzz/regressions/. Prints programs/second and the failures found; exit 1 if any."""

from __future__ import annotations

import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("FLOWJIT_VERIFY", "1")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from fuzz.generator import programs  # noqa: E402
from fuzz.oracles import check_gradients, check_program  # noqa: E402
from fuzz.reproducer import write_reproducer  # noqa: E402

ROUND = 50  # programs per hypothesis round (one seed each)


def fuzz_round(round_seed: int, counts: dict, smooth: bool) -> tuple | None:
    """One round of random programs; returns (program, error) for the shrunk failure, if any."""
    last_failure = []

    @seed(round_seed)
    @settings(max_examples=ROUND, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs(max_stmts=6 if smooth else 14, smooth=smooth))
    def run(program):
        counts["programs"] += 1
        try:
            if smooth:
                outcome = check_gradients(program.flowjit_source(), program.numpy_source(), program.inputs)
            else:
                outcome = check_program(program)
        except Exception as e:
            last_failure[:] = [program, e]  # hypothesis calls the shrunk example last
            raise
        counts["compiled"] += outcome.compiled
        counts["statements"] += len(program.stmts)

    try:
        run()
    except Exception:
        return tuple(last_failure) if last_failure else None
    return None


def main() -> int:
    minutes = float(os.environ.get("FUZZ_MINUTES", "5"))
    deadline = time.monotonic() + 60 * minutes
    counts = {"programs": 0, "compiled": 0, "statements": 0}
    failures = []
    symptoms: set[tuple[str, str]] = set()
    start = time.monotonic()
    rounds = 0
    while time.monotonic() < deadline:
        round_seed = random.randrange(2**32)
        failure = fuzz_round(round_seed, counts, smooth=rounds % 5 == 4)  # every 5th round: gradients
        rounds += 1
        if failure is not None:
            program, error = failure
            where = getattr(error, "where", type(error).__name__)
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            failures.append(first_line)
            # One reproducer per symptom (numbers aside): a known bug found again adds no file.
            symptom = (where, re.sub(r"[-+0-9.e]+", "#", first_line))
            path = "(same symptom as an earlier failure)"
            if symptom not in symptoms:
                symptoms.add(symptom)
                path = write_reproducer(program, f"{type(error).__name__}: {first_line}", where)
            print(f"FAILURE (seed {round_seed}) [{where}] {first_line}\n  reproducer: {path}")
        elapsed = time.monotonic() - start
        print(
            f"{elapsed:7.0f}s  {counts['programs']} programs ({counts['programs'] / elapsed:.1f}/s), "
            f"{counts['statements']} statements, {counts['compiled']} compiled, {len(failures)} failures",
            flush=True,
        )
    print(f"done: {counts['programs']} programs, {len(failures)} failures, {len(symptoms)} distinct symptoms")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
