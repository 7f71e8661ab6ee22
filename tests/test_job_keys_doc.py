"""docs/job-keys.md is the job TOML reference: it must be what docs/gen_job_keys.py writes from
checks/config.py today, and name every key the config reads. The README must not send a reader
to a file the repository does not have."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

from podkit.checks import config as cfg
from podkit.checks import gpus

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_job_keys", ROOT / "docs" / "gen_job_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> the row's cells, from the generated markdown."""
    rows: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in text.splitlines():
        if m := re.match(r"## \[(\w+)\]", line):
            section = m.group(1)
            rows[section] = {}
        elif section and (m := re.match(r"\| `(\w+)` \|", line)):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[section][m.group(1)] = cells
    return rows


def test_committed_reference_is_current():
    gen = _generator()
    committed = (ROOT / "docs" / "job-keys.md").read_text()
    assert committed == gen.render(), "docs/job-keys.md is stale: run .venv/bin/python docs/gen_job_keys.py"


def test_every_key_is_documented_with_type_default_and_description():
    rows = _rows(_generator().render())
    assert list(rows) == list(cfg.SECTIONS)
    for section, cls in cfg.SECTIONS.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        assert list(rows[section]) == fields, f"[{section}] rows differ from {cls.__name__}'s fields"
        for key, (_, toml_type, default, _allowed, description) in rows[section].items():
            assert toml_type and default.startswith("`") and description, f"{section}.{key}: {rows[section][key]}"
    # The defaults shown are the dataclass defaults, in TOML spelling.
    assert rows["train"]["lr"][2] == "`3e-4`" and cfg.TrainConfig().lr == 3e-4
    assert rows["train"]["double_quant"][2] == "`true`"
    assert rows["smoke"]["steps"][2] == f"`{cfg.SmokeConfig().steps}`"
    # Allowed values come from the validation itself.
    assert rows["train"]["precision"][3] == " \\| ".join(f"`{p}`" for p in cfg.PRECISIONS)
    assert rows["train"]["previous_outputs"][3] == "`stack` \\| `kept` \\| `freed`"
    assert rows["smoke"]["profile_every"][3] == "`>= 1`"
    assert "`V100-32GB`" in rows["cluster"]["gpu"][3]
    assert "`tiny`" in rows["model"]["preset"][3]
    assert "must not be negative" in rows["train"]["grad_clip"][3]


def test_supplied_descriptions_only_for_fields_without_a_docstring():
    """docs/gen_job_keys.py's UNDOCUMENTED fills gaps; once config.py documents a field, its entry must go."""
    gen = _generator()
    tree = ast.parse(Path(cfg.__file__).read_text())
    documented = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in {c.__name__ for c in cfg.SECTIONS.values()}:
            section = next(s for s, c in cfg.SECTIONS.items() if c.__name__ == node.name)
            for stmt, nxt in zip(node.body, node.body[1:]):
                if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    documented.add(f"{section}.{stmt.target.id}")
    known = {f"{s}.{f.name}" for s, c in cfg.SECTIONS.items() for f in dataclasses.fields(c)}
    for name in gen.UNDOCUMENTED:
        assert name in known, f"{name} is no field of the job config"
        assert name not in documented, f"{name} has a docstring now: drop it from UNDOCUMENTED"


def test_readme_links_stay_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "docs/job-keys.md" in readme
    assert "../shared" not in readme
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which the repository does not have"


def test_readme_names_every_catalog_gpu():
    readme = (ROOT / "README.md").read_text()
    missing = [g.name for g in gpus.CATALOG.values() if not re.search(rf"(?<![\w-]){re.escape(g.name)}(?![\w-])", readme)]
    assert not missing, f"README's GPU list lacks {missing}"
