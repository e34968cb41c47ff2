"""The README's promises: its length, its examples (executed verbatim), its headline numbers (those of the
benchmarks/RESULTS.md section it cites), and a repository that speaks only of the package."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT as ROOT

README = (ROOT / "README.md").read_text()
MAX_README_LINES = 150
MAX_RESULTS_LINES = 400
HEADLINE = re.compile(r"<!-- headline: (\S+)#(\S+) -->\n((?:\|.*\n)+)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _table_rows(block: str) -> list[str]:
    return [line.strip() for line in block.strip().splitlines() if not set(line.strip()) <= set("|-: ")]


def _section(markdown: str, anchor: str) -> str:
    """The text of the section whose heading turns into ``anchor`` (GitHub's rule: lower case, spaces to dashes)."""
    parts = re.split(r"^(#+ .*)$", markdown, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        slug = re.sub(r"[^a-z0-9 -]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")
        if slug == anchor:
            return body
    raise AssertionError(f"no section #{anchor}")


def test_readme_and_results_stay_short():
    assert len(README.splitlines()) <= MAX_README_LINES
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= MAX_RESULTS_LINES


def test_headline_numbers_are_those_of_the_results_section_they_cite():
    found = HEADLINE.findall(README)
    assert found, "the README's headline table must cite its RESULTS.md section"
    for path, anchor, table in found:
        section = _section((ROOT / path).read_text(), anchor)
        assert re.search(r"commit `[0-9a-f]{7,}`", section, re.I) and re.search(r"20\d\d-\d\d-\d\d", section)
        assert "versions" in section.lower()
        cited = _table_rows(section)
        for row in _table_rows(table):
            assert row in cited, f"README row not in {path}#{anchor}: {row}"


def _tiny_checkpoint(folder: Path) -> None:
    from tiny_models import tiny_model, tiny_tokenizer

    tiny_model(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


def test_readme_verify_example_runs(capsys):
    code = next(b for b in _python_blocks(README) if "verify_logits(" in b)
    exec(compile(code, "README.md", "exec"), {})
    assert "tensor(" in capsys.readouterr().out


def test_readme_rollout_example_runs(tmp_path, monkeypatch, capsys):
    code = next(b for b in _python_blocks(README) if "SpeculativeRollout(" in b)
    _tiny_checkpoint(tmp_path / "my-checkpoint")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    steps = [line.split() for line in capsys.readouterr().out.strip().splitlines()]
    assert [int(s[0]) for s in steps] == [0, 1, 2]
    assert int(steps[0][2]) == 0 and int(steps[1][2]) > 0  # nothing to reuse at step 0; drafts from step 1 on


def test_readme_trl_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    code = next(b for b in _python_blocks(README) if "SpecRLRollout(" in b)
    _tiny_checkpoint(tmp_path / "my-checkpoint")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["trainer"].state.global_step == 2
    assert len(scope["spec"].cache) > 0  # completions stored as next epoch's drafts


#: Text about how the project was built, not about the package, and paths of one machine.
_CIRCUMSTANCES = re.compile(
    "|".join(
        [
            r"\b(this|last|later|earlier|another|previous|next|work) session\b",
            r"\blent\b",
            r"\bdevice tool\b",
            r"/work/\w",
            r"/root/",
            r"/home/[a-z]",
            r"/Users/[A-Za-z]",
        ]
    ),
    re.I,
)


def test_tracked_files_speak_only_of_the_project():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".so", ".whl", ".gz", ".safetensors", ".parquet"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}: {m.group(0)!r}" for m in _CIRCUMSTANCES.finditer(text)]
    this = Path(__file__).relative_to(ROOT).as_posix()
    assert [h for h in hits if not h.startswith(this)] == [], hits[:10]


def test_environment_variables_are_few_and_documented():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    names = set()
    for name in files:
        path = ROOT / name
        if name == "CHANGELOG.md":  # names the variables that were removed
            continue
        if path.is_file() and path.suffix in {".py", ".sh", ".md", ".toml", ".yaml", ".cfg"} | {""}:
            names |= set(re.findall(r"\bSPEC_RL_[A-Z0-9_]+", path.read_text(errors="replace")))
    names -= {"SPEC_RL_DRAFT_STORE"}  # the marker file of a draft directory, not a variable
    api = (ROOT / "docs" / "api.md").read_text()
    assert len(names) <= 6, sorted(names)
    assert all(f"`{n}`" in api for n in names), sorted(n for n in names if f"`{n}`" not in api)
    assert not set(k for k in os.environ if k.startswith("SPEC_RL_")) - {"SPEC_RL_REQUIRE", "SPEC_RL_CACHE"}
