"""Write docs/job-keys.md, the reference of every job TOML key, from checks/config.py itself.

The keys, defaults and accepted types come from the dataclasses (`checks.config.SECTIONS`) and the
type rule `_build` applies; the descriptions are the field docstrings, which Python drops at runtime,
so they are read from the source with `ast`; the allowed values and refusals are read from each
`__post_init__` (its `_choice`, `_positive` and `ConfigError` calls), the presets and GPU names from
their catalogs. So the reference changes when the code does: tests/test_job_keys_doc.py fails when
the committed file is not what this script writes.

    .venv/bin/python docs/gen_job_keys.py           # rewrite docs/job-keys.md
    .venv/bin/python docs/gen_job_keys.py --check   # exit 1 when docs/job-keys.md is stale
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podkit.checks import config as cfg  # noqa: E402
from podkit.checks import gpus  # noqa: E402
from podkit.checks.presets import PRESETS  # noqa: E402

OUT = ROOT / "docs" / "job-keys.md"

# Fields checks/config.py gives no docstring. The test fails when one of these gains a docstring (then
# the docstring is used and the entry must go) or names a field that no longer exists.
UNDOCUMENTED = {
    "model.layers": "Transformer blocks (explicit dimensions).",
    "model.heads": "Attention (query) heads (explicit dimensions).",
    "model.ffn": "MLP intermediate size (explicit dimensions).",
    "model.vocab": "Vocabulary size (explicit dimensions).",
    "model.qkv_bias": "The q, k and v projections have biases (as Qwen2's do).",
    "cluster.gpus_per_node": "GPU processes per node.",
    "cluster.nodes": "Hosts; the job's world is nodes x gpus_per_node processes.",
    "smoke.steps": "Optimizer steps of the smoke run (`bin/smoke --steps` overrides it).",
    "smoke.seed": "Seed of the smoke model's initialisation and of its synthetic data.",
}


def _toml_type(key: str, default) -> str:
    """What `cfg._build` accepts for the key: the default's type, widened as it widens it."""
    if key in cfg.LIST_KEYS:
        return "string or array of strings"
    if key in cfg.COUNT_OR_WORD_KEYS:
        return "string or integer"
    return {bool: "boolean", int: "integer", float: "float (an integer is accepted)", str: "string"}[type(default)]


def _toml_value(node: ast.expr, source: str) -> str:
    value = ast.literal_eval(node)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return ast.get_source_segment(source, node)  # 3e-4 as written, not 0.0003


def _placeholder(expr: ast.expr) -> str:
    """An f-string field as a name: self.base_quant -> base_quant, ', '.join(dims) -> dims."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        return expr.attr
    names = [n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id != "self"]
    return names[-1] if names else "..."


def _text(node: ast.expr | None) -> str:
    """A message as the user reads it: an f-string's fields shown as {name}; cut before ', got ...'."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "{" + _placeholder(v.value) + "}"
                       for v in node.values)
    else:
        return ""
    return text.split(", got ")[0].strip()


def _strings(node: ast.AST, assigned: dict[str, ast.AST]) -> list[str]:
    """Every string constant in a loop's iterable, through the names it uses that the function assigned."""
    found: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found.append(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in assigned:
            found += _strings(assigned[sub.id], {})
    return list(dict.fromkeys(found))


def _field_names(node: ast.expr, bound: dict[str, list[str]]) -> list[str]:
    """The 'section.key' names a ConfigError's first argument can take."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        names = [""]
        for v in node.values:
            if isinstance(v, ast.Constant):
                names = [n + v.value for n in names]
            elif isinstance(v.value, ast.Name) and v.value.id in bound:
                names = [n + b for n in names for b in bound[v.value.id]]
            else:
                return []  # a helper's generic f"{section}.{key}": its callers are read instead
        return names
    return []


def _rules(func: ast.FunctionDef, section: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """From a __post_init__: key -> allowed values, and 'section[.key]' -> refusals in words."""
    allowed: dict[str, list[str]] = {}
    refusals: dict[str, list[str]] = {}
    assigned = {t.id: n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}

    def visit(node: ast.AST, bound: dict[str, list[str]]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            bound = {**bound, node.target.id: _strings(node.iter, assigned)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            keys = (bound.get(args[1].id, []) if isinstance(args[1], ast.Name) else [ast.literal_eval(args[1])]
                    ) if len(args) > 1 and node.func.id in ("_choice", "_positive") else []
            if node.func.id == "_choice":
                for key in keys:  # the choices: a tuple expression over the module's names
                    allowed[key] = list(eval(ast.unparse(args[3]), vars(cfg)))
            elif node.func.id == "_positive":
                for key in keys:
                    allowed[key] = [">= 1"]
            elif node.func.id == "ConfigError":
                problem = _text(args[1] if len(args) > 1 else None)
                fix = _text(args[2] if len(args) > 2 else None)
                for name in _field_names(args[0], bound):
                    if name == section or name.startswith(section + "."):
                        refusals.setdefault(name, []).append(problem + (f" ({fix})" if fix else ""))
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(func, {})
    return allowed, refusals


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    source = Path(cfg.__file__).read_text()
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    external = {"model.preset": sorted(PRESETS), "cluster.gpu": [g.name for g in gpus.CATALOG.values()]}
    out = [
        "# Job config keys",
        "",
        "<!-- Generated by docs/gen_job_keys.py from checks/config.py; do not edit by hand. "
        "tests/test_job_keys_doc.py fails when this file is stale. -->",
        "",
        "Every key of a job TOML, by section, as `checks/config.py` reads it: the type the file must give "
        "(any other is refused with exit 2), the default when the key is left out, the allowed values or "
        "limits, and the field's own description. An unknown key or section is refused, with the closest "
        "known name.",
    ]
    for section, cls in cfg.SECTIONS.items():
        node = classes[cls.__name__]
        body = node.body
        post = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__post_init__")
        allowed, refusals = _rules(post, section)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        out += ["", f"## [{section}]", "", _cell(ast.get_docstring(node) or ""), "",
                "| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            key = stmt.target.id
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = nxt.value.value
            doc = doc or UNDOCUMENTED.get(f"{section}.{key}", "")
            limits = allowed.get(key) or external.get(f"{section}.{key}", [])
            cell = " \\| ".join(f"`{v}`" for v in limits)  # values hold no '|'; the escape is the table's
            rules = refusals.get(f"{section}.{key}", [])
            if rules:
                cell += ("; " if cell else "") + "refused: " + _cell("; ".join(dict.fromkeys(rules)))
            out.append(f"| `{key}` | {_toml_type(key, defaults[key])} | `{_toml_value(stmt.value, source)}` | {cell} "
                       f"| {_cell(doc)} |")
        whole = refusals.get(section, [])
        if whole:
            out += ["", "Refused for the section as a whole: " + "; ".join(_cell(r) for r in dict.fromkeys(whole)) + "."]
    return "\n".join(out) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run .venv/bin/python docs/gen_job_keys.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
