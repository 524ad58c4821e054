"""`make fuzz`: random seeds for FUZZ_MINUTES (default 5), every oracle, shrunk reproducers written
to tests/fuzz/regressions/ (one per symptom). Prints programs/second and the failures found; exit 1
if any.

Each round (one seed, ROUND programs) runs in a child process: a compiler crash that kills the
process (an LLVM/MLIR assertion, a segfault in generated code) ends that round only, and the program
it was running is written out as a reproducer (unshrunk: there is no process left to shrink in).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("FLOWJIT_VERIFY", "1")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from fuzz.generator import programs  # noqa: E402
from fuzz.oracles import check_gradients, check_program  # noqa: E402
from fuzz.reproducer import write_reproducer  # noqa: E402

ROUND = 50  # programs per round (one seed each)
ROUND_TIMEOUT = 900  # seconds; a round that takes longer is reported as a hang


def fuzz_round(round_seed: int, smooth: bool, current_path: str) -> dict:
    """One round of random programs (in this process). Before each program is checked it is pickled
    to `current_path`, so the parent can report it if the process dies. Returns counts and the shrunk
    failure, if any."""
    counts = {"programs": 0, "compiled": 0, "statements": 0}
    last_failure = []

    @seed(round_seed)
    @settings(max_examples=ROUND, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs(max_stmts=6 if smooth else 14, smooth=smooth))
    def run(program):
        counts["programs"] += 1
        with open(current_path, "wb") as f:
            pickle.dump(program, f)
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
        if last_failure:
            program, error = last_failure
            counts["failure"] = {
                "where": getattr(error, "where", type(error).__name__),
                "message": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            }
            with open(current_path, "wb") as f:
                pickle.dump(program, f)
    return counts


def _run_child(round_seed: int, smooth: bool, current_path: str) -> dict:
    """`fuzz_round` in a child process; a crash or hang becomes a failure of the program it was running."""
    command = [sys.executable, os.path.abspath(__file__), "--round", str(round_seed), current_path]
    if smooth:
        command.append("--smooth")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=ROUND_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"programs": 1, "compiled": 0, "statements": 0, "failure": {"where": "hang", "message": "hang"}}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    message = f"the process died (exit status {done.returncode}): {tail[:300]}"
    return {"programs": 1, "compiled": 0, "statements": 0, "failure": {"where": "crash", "message": message}}


def main() -> int:
    minutes = float(os.environ.get("FUZZ_MINUTES", "5"))
    deadline = time.monotonic() + 60 * minutes
    totals = {"programs": 0, "compiled": 0, "statements": 0}
    failures = 0
    symptoms: set[tuple[str, str]] = set()
    start = time.monotonic()
    rounds = 0
    with tempfile.TemporaryDirectory(prefix="flowjit-fuzz-") as scratch:
        current_path = os.path.join(scratch, "current.pkl")
        while time.monotonic() < deadline:
            round_seed = random.randrange(2**32)
            smooth = rounds % 5 == 4  # every 5th round: gradient programs
            result = _run_child(round_seed, smooth, current_path)
            rounds += 1
            for key in totals:
                totals[key] += result[key]
            failure = result.get("failure")
            if failure is not None:
                failures += 1
                # One reproducer per symptom (numbers aside): a known bug found again adds no file.
                symptom = (failure["where"], re.sub(r"[-+0-9.e]+", "#", failure["message"]))
                path = "(same symptom as an earlier failure)"
                if symptom not in symptoms and os.path.exists(current_path):
                    symptoms.add(symptom)
                    with open(current_path, "rb") as f:
                        program = pickle.load(f)
                    path = write_reproducer(program, failure["message"], failure["where"])
                print(f"FAILURE (seed {round_seed}) [{failure['where']}] {failure['message']}\n  reproducer: {path}")
            elapsed = time.monotonic() - start
            print(
                f"{elapsed:7.0f}s  {totals['programs']} programs ({totals['programs'] / elapsed:.1f}/s), "
                f"{totals['statements']} statements, {totals['compiled']} compiled, {failures} failures",
                flush=True,
            )
    print(f"done: {totals['programs']} programs, {failures} failures, {len(symptoms)} distinct symptoms")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--round":
        counts = fuzz_round(int(sys.argv[2]), "--smooth" in sys.argv, sys.argv[3])
        print(json.dumps(counts))
        sys.exit(0)
    sys.exit(main())
