"""Paths the tests need: the repository root, its benchmarks/ and examples/, and the shared data folder beside it."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS = REPO_ROOT / "tests"
BENCHMARKS = REPO_ROOT / "benchmarks"
EXAMPLES = REPO_ROOT / "examples"
#: public GSM8K / MATH-500 files next to the checkout (tests that need them skip when it is absent)
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
